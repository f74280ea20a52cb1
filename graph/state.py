"""The optimize graph's state: one typed dict, checkpointed after every node (docs/AGENTS.md).

Keys written by nodes that run in parallel (the agents of one round) have reducers, so that their updates merge
instead of overwriting each other: records keyed by candidate id merge field by field, lists append, seconds add.
Everything here is plain JSON data: recipes as dicts, measurements as dicts, so that SQLite checkpoints, `history`
and LangGraph Studio can read every step.
"""
from __future__ import annotations

import operator
import secrets
from typing import Annotated, TypedDict

# The stop rule and the smallest win the graph acts on: measurement noise on a shared machine is a few
# percent, so a candidate must beat the current best by 2% to replace it (the policy provider routes on the same 2%).
MIN_GAIN = 0.02

DEFAULTS = {  # small enough that `specpilot optimize` on SmolLM2-135M on a CPU takes a few minutes
    "target": "smollm2-135m", "workload": "code", "device": None, "dtype": None, "batch_size": 1,
    "max_new_tokens": 32, "limit": 2, "budget_rounds": 2, "budget_minutes": 15.0, "budget_gpu_minutes": 15.0,
    "provider": "policy", "model": None, "base_url": None, "memory": None, "interactive": False,
    "max_candidates": 2, "profile_repeats": 2, "bench_repeats": 1, "salt": None, "out_dir": None,
    "gate_timeout_s": 600.0, "heads": None, "acceptance": None, "acceptance_ranks": None,
}


def make_settings(**given) -> dict:
    """The run's settings: DEFAULTS overridden by what was given (None keeps the default), device and dtype
    resolved the engine's way, and a fresh gate salt for the run unless one was given."""
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown optimize setting(s): {', '.join(sorted(unknown))}")
    s = dict(DEFAULTS) | {k: v for k, v in given.items() if v is not None}
    if s["device"] is None:
        import torch

        s["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    s["dtype"] = s["dtype"] or ("bf16" if str(s["device"]).startswith("cuda") else "fp32")
    if s["limit"] is not None and isinstance(s["batch_size"], int) and s["limit"] < s["batch_size"]:
        s["limit"] = s["batch_size"]  # one batch needs that many prompts (the bench skips a batch larger than them)
    # One salt for the whole run: every candidate is checked against one reference, computed once (docs/GATE.md).
    s["salt"] = s["salt"] or secrets.token_hex(8)
    return s


# -- reducers ----------------------------------------------------------------------------------------------------

def merge_records(old: dict | None, new: dict | None) -> dict:
    """id -> record; an update's fields replace those of the record with the same id, other fields stay."""
    out = dict(old or {})
    for key, record in (new or {}).items():
        out[key] = {**out.get(key, {}), **record}
    return out


def union(old: list | None, new: list | None) -> list:
    """Append the new items that are not there yet, in order."""
    out = list(old or [])
    out += [x for x in (new or []) if x not in out]
    return out


def widen(old: list | None, new: list | None) -> list | None:
    """[start, end] of work done in parallel: the earliest start and the latest end; None resets."""
    if new is None:
        return None
    if old is None:
        return list(new)
    return [min(old[0], new[0]), max(old[1], new[1])]


class OptimizeState(TypedDict, total=False):
    settings: dict                    # make_settings(): target, workload, device, dtype, batch, budget, provider ...
    deployment: dict                  # memory.records descriptor of the profiled deployment (+ workload, tokens)
    baselines: dict                   # round 1's side-by-side measurement of ar and stock
    best: dict                        # {recipe, path, source, round, measured, gate}: gated, measured, the fastest
    progression: Annotated[list, operator.add]   # per round: the best's speedups after the round
    profile: dict                     # tools.profile.profiler Profile.to_dict() of the best recipe this round
    gaps: list                        # the profile's gaps, ranked by end-to-end gain
    memory_hits: list                 # memory.Hit.to_dict() of similar deployments' outcomes, best first
    route: dict                       # {round, agents, reason, who}: the router's decision this round
    candidates: Annotated[dict, merge_records]   # candidate id -> record (proposal, validation, status)
    evaluations: Annotated[dict, merge_records]  # candidate id -> evaluation result (kernel check, gate, speed)
    tried: Annotated[list, union]     # every candidate id proposed so far: never proposed or evaluated again
    redirects: list                   # agents a person sent a candidate to, still to run this round
    agent_pass: int                   # 0 for the router's fan-out, +1 for each round of redirects
    agent_span: Annotated[list | None, widen]    # wall span of the agents running in parallel, not yet counted
    round: int
    trail: Annotated[list, operator.add]         # every decision: {round, node, who, decision, why}
    stop_reason: str | None
    elapsed_s: Annotated[float, operator.add]    # wall time the graph's work took (not a person's think time)
    device_s: Annotated[float, operator.add]     # time measurements held the device (the GPU-minutes budget)


def decision(round_: int, node: str, who: str, what: str, why: str = "", **extra) -> dict:
    """One trail entry: who decided what, and why."""
    return {"round": round_, "node": node, "who": who, "decision": what, "why": why, **extra}


def budget_spent(state: dict, extra_elapsed_s: float = 0.0, extra_device_s: float = 0.0,
                 count_rounds: bool = True) -> str | None:
    """Why the run's budget is spent, or None while some is left. Within a round (count_rounds=False) only the
    minutes count: the round under way is not over yet."""
    s = state["settings"]
    elapsed = state.get("elapsed_s", 0.0) + extra_elapsed_s
    device = state.get("device_s", 0.0) + extra_device_s
    if count_rounds and state.get("round", 0) >= s["budget_rounds"]:
        return f"budget: {s['budget_rounds']} round(s) done"
    if elapsed >= 60 * s["budget_minutes"]:
        return f"budget: {elapsed / 60:.1f} of {s['budget_minutes']:g} wall minutes used"
    if device >= 60 * s["budget_gpu_minutes"]:
        return f"budget: {device / 60:.1f} of {s['budget_gpu_minutes']:g} device minutes used"
    return None
