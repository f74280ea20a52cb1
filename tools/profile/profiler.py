"""Where a deployment's step time goes, against its floors, as a ranked list of gaps for the agents.

    specpilot profile --target T --recipe R --workload W --out DIR

Measures (1) the real step time (graphed on CUDA) of the engine's own loop, (2) the step's phases on the eager
step through the decoder's `phase_timer` hook: draft, verify, bookkeeping (CUDA events on GPU, perf_counter on
CPU), host sync (time blocked reading the step's tokens) and idle (the rest of the step's wall time), (3) the top
kernels from torch.profiler with the achieved bandwidth of GEMMs, (4) tau and acceptance per draft position, and
(5) the cost model's floors on the calibrated ceilings. Gaps = measured - floor per component, ranked by the
end-to-end gain closing each alone would bring, each assigned to the agent that owns it. docs/COSTMODEL.md has the
JSON schema and how the router reads it.

A recipe that names candidate kernel files is candidate code, never imported in this process: the profile then
runs in a sandboxed child (`python -m specpilot.tools.profile.profiler` through tools/sandbox/process.run_python,
handed in by the caller as `sandbox=`: tools/profile may not import tools/sandbox, tests/test_layering.py), and only
its JSON comes back. Without a sandbox such a recipe is refused.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from ...engine import loader, packaged
from ...engine.decode import StopCondition
from ...engine.engine import Engine
from ...engine.loader import LoadedModel
from ...engine.errors import SpecPilotError
from ...engine.recipe import LOOKUP_MAX_NGRAM, Recipe, load_recipe, parse, with_absolute_paths
from ...engine.workloads import absolute_spec, load_workload
from ...kernels import is_candidate_path
from . import calibrate
from .costmodel import Deployment, DeviceCeilings, ModelShape, eagle3_shape, predict, tree_draft_widths
from .kernel_stats import phase_events, top_kernels
from .native_stderr import quiet_profile
from .phase_timer import DEVICE_PHASES, PHASES, PhaseTimer, loop_steps, trimmed_mean

SCHEMA_VERSION = 1
CHILD = "specpilot.tools.profile.profiler"  # the sandboxed child's module (main() below)
SANDBOX_TIMEOUT_S = 3600.0  # the default wall-clock limit of a sandboxed profile
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Profile:
    meta: dict
    step: dict
    phases: dict
    acceptance: dict
    top_kernels: list
    ceilings: dict
    floors: dict
    prediction: dict
    gaps: list

    def to_dict(self) -> dict:
        return {"schema": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise SpecPilotError(f"a profile without {', '.join(missing)}")
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def table(self) -> str:
        s, ph, m = self.step, self.phases, self.meta
        replay = f", graph replay {s['replay_s'] * 1e3:.3f} ms" if s.get("replay_s") else ""
        lines = [f"{m['target']} / {m['recipe']} on {m['device']}, B={m['batch_size']}: step {s['loop_s'] * 1e3:.3f} ms"
                 f"{replay} (eager {s['eager_s'] * 1e3:.3f} ms), tau {self.acceptance['tau']:.2f}, "
                 f"{s['tokens_per_s']:.1f} tok/s",
                 "phases (eager step): " + ", ".join(f"{p} {ph[p] * 1e3:.3f}" for p in PHASES) + " ms",
                 self.prediction_line(),
                 f"{'rank':>4}  {'gap':<28} {'measured':>10} {'floor':>10} {'gain':>7}  agent"]
        for i, g in enumerate(self.gaps, 1):
            lines.append(f"{i:>4}  {g['component'][:28]:<28} {g['measured_s'] * 1e3:>8.3f}ms "
                         f"{g['floor_s'] * 1e3:>8.3f}ms {g['gain'] * 100:>6.1f}%  {g['agent']}: {g['reason']}")
        return "\n".join(lines)

    def prediction_line(self) -> str:
        """The cost model's step on the calibrated ceilings against the measured one: how far to trust its numbers."""
        pred, s = self.prediction["graphed"], self.step
        measured = s.get("replay_s") or s["loop_s"]
        return (f"cost model on the calibrated ceilings: step {pred['step_s'] * 1e3:.3f} ms, "
                f"{pred['tokens_per_s']:.1f} tok/s predicted; measured {measured * 1e3:.3f} ms "
                f"(predicted / measured {pred['step_s'] / measured:.2f})")


def _acceptance(rows_by_batch: list[list], k: int) -> dict:
    steps = [n for rows in rows_by_batch for r in rows for n in r.accepted]
    reach = [sum(1 for n in steps if n >= i) for i in range(k + 1)]
    per_pos = [reach[i] / reach[i - 1] if reach[i - 1] else 0.0 for i in range(1, k + 1)]
    batch_steps = sum(max((len(r.accepted) for r in rows), default=0) * len(rows) for rows in rows_by_batch)
    found = [n for rows in rows_by_batch for r in rows for n in r.found]
    return {"k": k, "tau": (sum(steps) + len(steps)) / max(1, len(steps)), "perfect_tau": k + 1,
            "per_position": per_pos, "row_steps": len(steps),
            # row-steps whose drafter found at least one draft (what ragged verification lends to the others)
            "draft_availability": sum(1 for n in found if n > 0) / len(found) if found else None,
            "active_fraction": len(steps) / batch_steps if batch_steps else 1.0}


def _deployment(target: LoadedModel, engine: Engine, recipe: Recipe, batch: int, kernels: dict) -> Deployment:
    model, dec = target.model, engine.decoder
    draft_kernels = kernels.get("draft")
    if recipe.drafter.kind in ("layerskip", "model", "eagle3") and draft_kernels:
        # per draft forward (k of them a step: a chain's drafts, a tree's levels), less its argmax or top-k
        draft_kernels = max(1, round(draft_kernels / recipe.k) - 1)
    drafter_model = None
    kind, head_drafter = recipe.drafter.kind, dec.drafter
    if kind == "replay":  # priced as what it runs: its cost head's drafting, or (none) a search over the history
        head_drafter = dec.drafter.cost
        kind = "eagle3" if head_drafter is not None else "ngram"
    if kind == "model":
        drafter_model = ModelShape.from_config(dec.drafter.model.cfg)
    elif kind == "eagle3":
        drafter_model = eagle3_shape(head_drafter.head.cfg)
    elem = model.embed.element_size()
    book = (kernels.get("bookkeeping") or 0) + (kernels.get("launch") or 0)
    attention = "sdpa" if recipe.kernels.get("attention") == "builtin:sdpa" else "math"
    return Deployment(ModelShape.from_config(model.cfg), bytes_per_param=elem, dtype_bytes=elem, batch=batch,
                      k=recipe.k, drafter_kind=kind, drafter_model=drafter_model,
                      drafter_layers=recipe.drafter.layers,
                      ngram_orders=recipe.drafter.max_ngram - recipe.drafter.min_ngram + 1,
                      lookup_orders=LOOKUP_MAX_NGRAM - recipe.drafter.lookup + 1 if recipe.drafter.lookup else 0,
                      head_k=recipe.drafter.head_k or None,
                      context_len=dec._cache.max_len,
                      kernels_per_target_forward=round(kernels["verify"]) if kernels.get("verify") else None,
                      kernels_per_draft_forward=round(draft_kernels) if draft_kernels else None,
                      kernels_bookkeeping=round(book) or None, cuda_graphs=dec.cuda_graphs, attention=attention,
                      controller=recipe.batch.controller, ragged=recipe.batch.ragged,
                      fractions=tuple(recipe.batch.fractions),
                      tree_nodes=dec.verify_width if recipe.verification == "tree" else None,
                      draft_widths=tree_draft_widths(dec.tree) if dec.tree is not None
                      and kind == "eagle3" else None)


def _gap(component, measured, floor, step_s, agent, reason) -> dict:
    gap = max(0.0, measured - floor)
    return {"component": component, "measured_s": measured, "floor_s": floor, "gap_s": gap,
            "gain": step_s / max(step_s - gap, 0.01 * step_s) - 1.0, "agent": agent, "reason": reason}


def _gaps(step: dict, phases: dict, acc: dict, pred, top: list, batch: int, k: int, cuda: bool) -> list:
    """Measured - floor per component, in the real step's time (phases are scaled from the eager step)."""
    T, wall, replay = step["loop_s"], phases["wall"], step.get("replay_s")
    busy = sum(phases[p] for p in DEVICE_PHASES)
    scale = replay / max(busy, 1e-12) if replay else T / max(wall, 1e-12)
    real = {p: phases[p] * scale for p in DEVICE_PHASES}
    kt, kn = phases.get("kernel_s") or {}, phases.get("kernels") or {}
    if replay and all(p in kt for p in (DEVICE_PHASES if k else DEVICE_PHASES[1:])):
        # graphed: each phase's kernels' own device time, plus its share of the replay's gaps between kernels
        n = sum(kn.get(p, 0) for p in DEVICE_PHASES)
        gap = max(0.0, replay - sum(kt.get(p, 0.0) for p in DEVICE_PHASES)) / max(n, 1)
        real = {p: kt.get(p, 0.0) + kn.get(p, 0) * gap for p in DEVICE_PHASES}
    idle = max(0.0, T - replay) if replay else phases["idle"] * scale
    gaps = []
    for name in DEVICE_PHASES:
        cost, m = getattr(pred, name), real[name]
        if name == "draft" and not k:
            continue
        floor = cost.floor_s
        if name == "draft":
            agent, why = "algorithm", f"drafting takes {m / T:.0%} of the step ({cost.kernels} kernels)"
        elif cost.launch_s >= 0.5 * m:
            per = cost.launch_s / max(1, cost.kernels) * 1e6
            agent, why = "scheduler", (f"launch-bound: {cost.kernels} kernels x {per:.1f} us = "
                                       f"{cost.launch_s * 1e3:.3f} ms of {m * 1e3:.3f} ms")
        else:
            bound = "memory" if cost.memory_s >= cost.compute_s else "compute"
            agent, why = "kernel-writer", f"at {floor / max(m, 1e-12):.0%} of its {bound} floor"
        gaps.append(_gap(name, m, floor, T, agent, why))
    if cuda:
        gaps.append(_gap("host_sync", phases["host_sync"], phases["host_sync"], T, "scheduler",
                         "overlaps device work on CUDA; its exposed cost shows as idle"))
    else:
        gaps.append(_gap("host_sync", phases["host_sync"] * scale, 0.0, T, "scheduler",
                         "host blocked reading each step's tokens"))
    gaps.append(_gap("idle", idle, 0.0, T, "scheduler", "host work between steps not overlapped with the device"))
    if k:
        g = _gap("acceptance", T / acc["tau"], T / (k + 1), T, "algorithm",
                 f"tau {acc['tau']:.2f} of a perfect {k + 1}; per position "
                 + ", ".join(f"{a:.2f}" for a in acc["per_position"][:4]))
        gaps.append(g | {"gain": (k + 1) / acc["tau"] - 1.0})
    if batch > 1:
        f = acc["active_fraction"]
        g = _gap("batching_dilution", T, T * f, T, "scheduler",
                 f"{1 - f:.0%} of row-steps ran for rows that had already finished")
        gaps.append(g | {"gain": 1.0 / max(f, 1e-12) - 1.0})
    # CPU op times under torch.profiler carry its overhead: scaled to the real step (device kernel times are not).
    ks = 1.0 if cuda else T / max(step["profiled_s"], 1e-12)
    for kern in [t for t in top if t.get("floor_s") is not None][:3]:
        calls = kern["count"] / max(1, step["profiled_steps"])
        gaps.append(_gap(f"kernel {kern['op']} {kern['shapes']}", kern["per_step_s"] * ks, kern["floor_s"] * calls
                         / kern["count"], T, "kernel-writer",
                         f"{kern['bandwidth_fraction']:.0%} of copy bandwidth, {calls:.0f} calls a step"))
    return sorted(gaps, key=lambda g: -g["gain"])


def _timed_run(dec, batches, stop, timer=None):
    dec.phase_timer, overlap = timer, dec.overlap
    dec.overlap = dec.overlap and timer is None  # phases need one step in flight at a time
    try:
        rows, decode_s, steps = [], 0.0, 0
        for b in batches:
            rows.append(dec.generate(b, stop))
            decode_s, steps = decode_s + dec.last_stats.decode_s, steps + dec.last_stats.steps
        return rows, decode_s, steps
    finally:
        dec.phase_timer, dec.overlap = None, overlap


def profile(target: str | LoadedModel, recipe: str | Recipe = "stock", workload: str = "code",
            limit: int | None = None, max_new_tokens: int = 64, batch_size: int = 1, device: str | None = None,
            dtype: str | None = None, out_dir: str | Path | None = None, prompts: list[list[int]] | None = None,
            repeats: int = 2, ceilings: DeviceCeilings | None = None, profiled_tokens: int = 16, sandbox=None,
            sandbox_timeout_s: float = SANDBOX_TIMEOUT_S) -> Profile:
    """Profile one deployment (a target under a recipe at a batch size) on a workload's first turns. `sandbox`:
    tools/sandbox/process (the module), in which a recipe naming candidate kernel files is profiled."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # What was typed (recipe, workload) is read before the model loads: a bad one fails at once.
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, target if isinstance(target, str) else None)  # `stock` is the target's
    questions = load_workload(workload, limit or batch_size) if prompts is None else None
    args = (workload, limit, max_new_tokens, batch_size, device, dtype, prompts, repeats, ceilings, profiled_tokens)
    if [impl for impl in recipe.kernels.values() if is_candidate_path(impl)]:
        result = profile_in_sandbox(target, recipe, *args, sandbox=sandbox, timeout_s=sandbox_timeout_s)
    else:
        result = _profile_here(target, recipe, questions, *args)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "profile.json").write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return result


def _profile_here(target, recipe: Recipe, questions, workload, limit, max_new_tokens, batch_size, device, dtype,
                  prompts, repeats, ceilings, profiled_tokens) -> Profile:
    cuda = device.startswith("cuda")
    if isinstance(target, LoadedModel):
        name = target.source
    else:
        name, target = target, loader.load(target, dtype or ("bf16" if cuda else "fp32"), device)
    engine = Engine(target, recipe)
    dec, k, B = engine.decoder, recipe.k, batch_size
    source = workload if prompts is None else "token ids given"
    if prompts is None:
        prompts = [engine.encode(q.turns[0]) for q in questions]
    prompts = (prompts * B)[: max(len(prompts), B)]
    batches = [prompts[i: i + B] for i in range(0, len(prompts) - B + 1, B)]
    stop = StopCondition(max_new_tokens)
    engine.prepare(prompts, max_new_tokens)  # a replay drafter's references (the decoder's calls below need them)
    dec.generate(batches[0], stop)  # compile, capture
    if cuda:
        _timed_run(dec, batches[:1], StopCondition(4), PhaseTimer(device, k))  # the eager path's first use
    normal, timers = [], []
    for _ in range(repeats):  # interleaved, and the fastest of each kept: other load only ever adds time
        normal.append(_timed_run(dec, batches, stop))
        timers.append(PhaseTimer(device, k))
        _timed_run(dec, batches, stop, timers[-1])
    rows, decode_s, steps = min(normal, key=lambda r: trimmed_mean(loop_steps(r[0])))
    phases = min(timers, key=lambda t: t.mean()["wall"]).mean()
    replay = dec.time_graph_replay() if cuda and dec.cuda_graphs else None
    ranges = PhaseTimer(device, k, ranges=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with quiet_profile(activities=acts, record_shapes=True) as prof:  # kineto's log lines filtered
        _timed_run(dec, batches[:1], StopCondition(min(max_new_tokens, profiled_tokens)), ranges)
    psteps = len(ranges.steps)
    kernels, kernel_s, inside = phase_events(prof.events(), cuda, psteps)
    dev = ceilings or calibrate.load_or_measure(device)
    top = top_kernels(inside, cuda, psteps, target.model.embed.element_size(), dev)
    acc = _acceptance(rows, k)
    dep = _deployment(target, engine, recipe, B, kernels)
    pred = predict(dep, dev, acc["per_position"])
    eager = predict(replace(dep, cuda_graphs=False), dev, acc["per_position"])
    tokens = sum(len(r.tokens) - 1 for batch in rows for r in batch)
    step = {"loop_s": trimmed_mean(loop_steps(rows)), "loop_mean_s": decode_s / max(1, steps), "replay_s": replay,
            "eager_s": phases["wall"], "steps": steps,
            "decode_s": decode_s, "tokens": tokens, "tokens_per_s": tokens / decode_s if decode_s else 0.0,
            "graphed": bool(dec.cuda_graphs), "profiled_steps": psteps, "profiled_s": ranges.mean()["wall"]}
    phases = phases | {"sum_s": sum(phases[p] for p in PHASES) - (phases["host_sync"] if cuda else 0.0),
                       "overlapped": ["host_sync"] if cuda else [], "kernels": kernels, "kernel_s": kernel_s,
                       "timing": "cuda events" if cuda else "perf_counter"}
    floors = {p: {"memory_s": c.memory_s, "compute_s": c.compute_s, "floor_s": c.floor_s, "launch_s": c.launch_s,
                  "kernels": c.kernels} for p, c in (("draft", pred.draft), ("verify", pred.verify),
                                                     ("bookkeeping", pred.bookkeeping))}
    floors |= {"memory_floor_s": pred.memory_floor_s, "compute_floor_s": pred.compute_floor_s,
               "launch_floor_s": pred.launch_floor_s,
               "perfect_tokens_per_s": step["tokens_per_s"] * (k + 1) / acc["tau"]}
    meta = {"target": str(name), "recipe": recipe.name, "device": device, "device_name": dev.name,
            "dtype": str(target.model.dtype).split(".")[-1], "batch_size": B, "k": k, "drafter": recipe.drafter.kind,
            "workload": source, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "context_len": dep.context_len,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    result = Profile(meta, step, phases, acc, top, asdict(dev), floors,
                     {"graphed": pred.to_dict(), "eager": eager.to_dict(), "deployment": _dep_dict(dep)},
                     _gaps(step, phases, acc, pred, top, B, k, cuda))
    return result


def _dep_dict(dep: Deployment) -> dict:
    d = asdict(dep)
    d["model"] = asdict(dep.model) | {"params": dep.model.params}
    return d


# -- candidate code: the profile in a sandboxed child ---------------------------------------------------------------

def _sandbox_failure(r) -> str:
    """How the child ended without a result, and the last line it wrote on stderr (as tools/bench/run.py says it)."""
    tail = (r.stderr_tail or "").strip()
    last = tail.splitlines()[-1][-300:] if tail else "no output on stderr"
    how = {"timeout": f"killed after {r.seconds:.0f} s (its wall-clock limit)", "crash": f"killed by {r.signal}",
           "signal": f"killed by {r.signal}", "oom": "out of memory" + (f" (killed by {r.signal})" if r.signal else ""),
           "exception": f"exit status {r.returncode}"}.get(r.kind, "no JSON result on its last stdout line")
    return f"{how}: {last}"


def profile_in_sandbox(target, recipe: Recipe, workload, limit, max_new_tokens, batch_size, device, dtype, prompts,
                       repeats, ceilings, profiled_tokens, sandbox, timeout_s: float) -> Profile:
    """The profile of a recipe that names candidate kernel files, measured in a sandboxed child; only its JSON is
    read here."""
    files = [impl for impl in recipe.kernels.values() if is_candidate_path(impl)]
    if sandbox is None:
        raise SpecPilotError(f"recipe names candidate kernel files ({', '.join(files)}): they run only in the sandbox, "
                             "and none was given (profile(..., sandbox=specpilot.tools.sandbox.process))")
    name = target.source if isinstance(target, LoadedModel) else str(target)
    if isinstance(target, LoadedModel):  # the child loads its own copy
        dtype = dtype or _DTYPES.get(target.model.dtype)
    # Done here, on package code only: the child's filesystem may be read-only outside its temp dir, and a candidate
    # must not write the shared caches (a GGUF's dequantized directory, the device's calibration).
    source = str(loader.source_dir(name))
    ceilings = ceilings or calibrate.load_or_measure(device)
    kwargs = {"target": str(Path(source).resolve()),
              "recipe": asdict(with_absolute_paths(recipe)), "workload": absolute_spec(workload), "limit": limit, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
              "device": device, "dtype": dtype, "prompts": prompts, "repeats": repeats,
              "ceilings": asdict(ceilings), "profiled_tokens": profiled_tokens}
    cuda = device.startswith("cuda")
    memory = None
    if not cuda:  # no address-space cap on CUDA (the driver reserves huge virtual ranges); on CPU the machine's RAM
        with contextlib.suppress(ValueError, OSError, AttributeError):
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = sandbox.SandboxLimits(wall_s=float(timeout_s), memory_bytes=memory, gpu=cuda)
    caches = {"SPECPILOT_CACHE": str(loader.cache_root()), "SPECPILOT_MODELS": str(packaged.models_dir()),
              "HF_HOME": os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")}
    print(f"specpilot: profile: the recipe names candidate kernel files ({', '.join(files)}): running in the sandbox",
          file=sys.stderr)
    r = sandbox.run_python([CHILD], {"kwargs": kwargs}, limits, env=caches)
    if not (r.kind == "ok" and isinstance(r.output, dict)):
        raise SpecPilotError(f"the profile in the sandbox failed: {_sandbox_failure(r)}")
    if "error" in r.output:
        raise SpecPilotError(f"the profile in the sandbox: {' '.join(str(r.output['error']).split())[:500]}")
    result = Profile.from_dict(r.output.get("profile") or {})
    result.meta["target"] = name  # as given, not the directory it resolved to
    return result


def main() -> int:
    """The sandboxed child: {"kwargs": profile()'s arguments as JSON} on stdin, {"profile": ...} as the last stdout
    line."""
    kw = json.load(sys.stdin)["kwargs"]
    try:
        recipe = parse(kw.pop("recipe"))
        ceilings = DeviceCeilings(**kw["ceilings"])
        prompts = kw["prompts"]
        questions = load_workload(kw["workload"], kw["limit"] or kw["batch_size"]) if prompts is None else None
        with contextlib.redirect_stdout(sys.stderr):
            p = _profile_here(kw["target"], recipe, questions, kw["workload"], kw["limit"], kw["max_new_tokens"],
                              kw["batch_size"], kw["device"], kw["dtype"], prompts, kw["repeats"], ceilings,
                              kw["profiled_tokens"])
        answer = {"profile": json.loads(json.dumps(p.to_dict(), default=str))}
    except Exception as e:  # noqa: BLE001 - the parent reports it as one line
        answer = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:500]}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
