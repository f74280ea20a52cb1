"""The records the memory keeps: `Outcome`, one evaluated candidate, and `Hit`, one outcome retrieved with its score.

Plain data with no dependency on a store, so that records.py (how an outcome is described, embedded and scored),
base.py (the store interface) and both stores import it without importing each other.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields


@dataclass
class Outcome:
    candidate: dict                 # graph.candidates.Candidate.to_dict()
    deployment: dict                # target architecture/size, dtype, weight format, device + ceilings, batch, workload
    results: dict                   # speedup_vs_ar, speedup_vs_stock, tau, tokens_per_s, latency percentiles, memory
    gate: dict                      # passed, reason, epsilon, tokens_checked (empty when not gated)
    failure: str | None             # why it was rejected (compile error, kernel check, gate, slower), or None
    versions: dict                  # specpilot, torch, triton, transformers, driver
    time: str                       # ISO 8601
    run: str = ""                   # the optimize run (its output directory) that produced it
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Outcome":
        """From `to_dict()` output (a stored or exported record); a missing or unknown field raises ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"an outcome must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = set(data) - names, required - set(data)
        if unknown or missing:
            raise ValueError("not an outcome record: " + "; ".join(
                part for part in (f"unknown field(s) {', '.join(sorted(unknown))}" if unknown else "",
                                  f"missing field(s) {', '.join(sorted(missing))}" if missing else "") if part))
        return cls(**data)


@dataclass
class Hit:
    outcome: Outcome
    score: float                    # higher is closer; documented per implementation
    flags: list[str] = field(default_factory=list)   # e.g. "re-verify" when measured under other versions
    id: str = ""                    # the record's id in its store (ChromaMemory: `show ID`)
    similarity: float | None = None  # the closeness part of the score, where the implementation has one

    def to_dict(self) -> dict:
        """For AgentContext.memory_hits and JSON output."""
        return {"id": self.id, "score": self.score, "similarity": self.similarity, "flags": list(self.flags),
                "outcome": self.outcome.to_dict()}
