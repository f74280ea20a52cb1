"""What flows through the agent graph: the context an agent sees, the candidates it proposes, the router's choice.

A candidate is a change to the current best recipe (a JSON patch deep-merged into it) with the agent's reason, and,
for the kernel-writer, optionally new kernel source for one slot. Candidates are plain data: providers (policy or an
LLM) make them, the graph validates them against the recipe schema, the sandboxed tools evaluate them, and the memory
records how they fared. Nothing here runs candidate code.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

AGENTS = ("kernel_writer", "algorithm", "scheduler")


class CandidateError(ValueError):
    """A provider's answer that is not a valid candidate; the message names the field."""


@dataclass(frozen=True)
class KernelSource:
    slot: str      # linear | rmsnorm | attention | accept
    source: str    # Python source defining a function named after the slot


@dataclass(frozen=True)
class Candidate:
    agent: str
    reason: str
    recipe_patch: dict = field(default_factory=dict)   # recipe fields to change, deep-merged into the current recipe
    kernel: KernelSource | None = None
    origin: str = "policy"                              # policy | openai:<model> | memory | human
    # The speedup this change measured on a similar deployment (memory), over the recipe it changed: remembered
    # winners are evaluated first, the strongest first (a warm start). Not part of the id.
    prior: float | None = None

    @property
    def id(self) -> str:
        """Content hash: the same change proposed twice (by any agent) is evaluated once."""
        body = json.dumps({"patch": self.recipe_patch, "kernel": asdict(self.kernel) if self.kernel else None},
                          sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def to_dict(self) -> dict:
        return {"id": self.id, **asdict(self)}

    @classmethod
    def from_dict(cls, data, agent: str | None = None, origin: str = "policy") -> "Candidate":
        """Validate an untrusted mapping (an LLM's answer, an edited JSON) into a Candidate."""
        if not isinstance(data, dict):
            raise CandidateError(f"a candidate must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"id", "agent", "reason", "recipe_patch", "kernel", "origin", "prior"}
        if unknown:
            raise CandidateError(f"unknown candidate field(s): {', '.join(sorted(unknown))}")
        agent = data.get("agent", agent)
        if agent not in AGENTS:
            raise CandidateError(f"candidate field 'agent': {agent!r} is not one of {', '.join(AGENTS)}")
        reason = data.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise CandidateError("candidate field 'reason': a non-empty string is required")
        patch = data.get("recipe_patch", {})
        if not isinstance(patch, dict):
            raise CandidateError(f"candidate field 'recipe_patch': expected an object, got {type(patch).__name__}")
        kernel = data.get("kernel")
        if kernel is not None:
            if not isinstance(kernel, dict) or set(kernel) != {"slot", "source"} or not all(
                    isinstance(v, str) for v in kernel.values()):
                raise CandidateError("candidate field 'kernel': expected {\"slot\": str, \"source\": str}")
            kernel = KernelSource(**kernel)
        if not patch and kernel is None:
            raise CandidateError("a candidate must change something: give 'recipe_patch' or 'kernel'")
        prior = data.get("prior")
        if prior is not None and (isinstance(prior, bool) or not isinstance(prior, (int, float)) or prior <= 0):
            raise CandidateError(f"candidate field 'prior': a positive number or null, got {prior!r}")
        return cls(agent, reason.strip(), patch, kernel, data.get("origin", origin),
                   None if prior is None else float(prior))


def merge_patch(recipe: dict, patch: dict) -> dict:
    """The recipe with `patch` deep-merged in (objects merge key by key; anything else replaces)."""
    out = dict(recipe)
    for key, value in patch.items():
        out[key] = merge_patch(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass
class AgentContext:
    """Everything one agent sees in one round (also what its prompt template is rendered with)."""
    agent: str
    deployment: dict            # target, device, dtype, batch size, workload, device ceilings
    recipe: dict                # the current best recipe, as JSON
    profile: dict               # the profiler's last Profile.to_dict()
    gaps: list[dict]            # the profile's ranked gaps, each with the agent the router assigns it to (an
    # agent's levers may answer another's gap: the fused layer, the kernel-writer's, removes a launch-bound verify
    # step's kernels, which the scheduler owns)
    memory_hits: list[dict]     # past outcomes on similar deployments (memory/), best first
    tried: list[str]            # ids of candidates already evaluated: do not propose them again
    max_candidates: int = 3


@dataclass
class RouteDecision:
    agents: list[str]           # the agents that act this round (several run in parallel)
    reason: str
