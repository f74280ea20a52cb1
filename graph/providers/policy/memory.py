"""Memory as the policy reads it: past outcomes on similar deployments (memory.base.Hit as dicts) as verdicts, the
closest deployment first. A change that passed the gate and sped things up there is proposed before the catalog; one
that failed there is not proposed at all (provider.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ...candidates import AGENTS
from .recipes import agent_name


@dataclass(frozen=True)
class MemoryVerdict:
    """One past outcome as the policy reads it."""
    candidate: dict             # Candidate.to_dict() of the outcome
    passed: bool                # gate passed, no failure recorded, and faster
    failed: bool                # a failure was recorded (compile error, kernel check, gate, slower)
    why: str                    # "passed on <deployment> with 1.40x over stock" / "failed on <deployment>: gate"
    score: float
    speedup: float | None = None  # what it measured (memory_speedup), on a pass


def describe_deployment(dep: dict) -> str:
    """A short name for a memory outcome's deployment, from whichever of its keys it has."""
    what = dep.get("architecture") or dep.get("target") or "a deployment"
    parts = [str(what)]
    if dep.get("dtype"):
        parts.append(str(dep["dtype"]))
    where = dep.get("device_name") or dep.get("device")
    if where:
        parts.append(f"on {where}")
    if dep.get("batch_size") is not None:
        parts.append(f"B={dep['batch_size']}")
    if dep.get("workload"):  # a similar deployment often differs only here: say which workload it was measured on
        parts.append(f"{dep['workload']} workload")
    return " ".join(parts)


def memory_speedup(results: dict) -> tuple[float, str] | None:
    """The speedup an outcome measured and what it is over: over the recipe it changed when recorded, else over
    stock, else over ar."""
    for key, over in (("speedup", "the recipe it changed"), ("speedup_vs_stock", "stock"), ("speedup_vs_ar", "ar")):
        value = results.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), over
    return None


def read_memory(hits: list[dict]) -> list[MemoryVerdict]:
    """Hits (memory.base.Hit as dicts: outcome, score, flags), best first, as verdicts: the closest deployment first,
    and among equally close ones the largest measured speedup first (stable: other ties keep memory's order)."""
    out = []

    def rank(hit: dict) -> tuple[float, float]:
        speed = memory_speedup((hit.get("outcome") or {}).get("results") or {})
        return -float(hit.get("score", 0.0)), -(speed[0] if speed else 0.0)

    for hit in sorted(hits or [], key=rank):
        outcome = hit.get("outcome") or {}
        cand = outcome.get("candidate") or {}
        if not isinstance(cand, dict) or not (cand.get("recipe_patch") or cand.get("kernel")):
            continue
        where = describe_deployment(outcome.get("deployment") or {})
        gate, failure = outcome.get("gate") or {}, outcome.get("failure")
        speed = memory_speedup(outcome.get("results") or {})
        # the store's "failed" / "failure: ..." flags repeat what `why` says; "re-verify" and the like do not
        flags = [str(f) for f in hit.get("flags") or [] if f != "failed" and not str(f).startswith("failure: ")]
        note = f" (flags: {', '.join(flags)})" if flags else ""
        if failure or gate.get("passed") is False:
            why = f"failed on {where}: {failure or gate.get('reason') or 'the gate rejected it'}"
            out.append(MemoryVerdict(cand, False, True, why + note, float(hit.get("score", 0.0))))
        elif gate.get("passed") is True and speed and speed[0] > 1.0:
            why = f"passed on {where} with {speed[0]:.2f}x over {speed[1]}"
            out.append(MemoryVerdict(cand, True, False, why + note, float(hit.get("score", 0.0)), speed[0]))
    return out


def memory_agents(hits: list[dict]) -> list[str]:
    """Agents whose changes passed and sped things up on similar deployments, best hit first."""
    agents = []
    for v in read_memory(hits):
        agent = agent_name(v.candidate.get("agent", ""))
        if v.passed and agent in AGENTS and agent not in agents:
            agents.append(agent)
    return agents
