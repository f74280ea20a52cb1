"""The memory interface the agent graph writes every outcome to and reads similar past outcomes from.

`Outcome` is one evaluated candidate: what it changed, on which deployment, what it measured, whether it passed the
token-forcing gate (and why not), and the library versions it was measured with. Implementations: `JsonlMemory`
(a local file, for runs without Chroma) and the Chroma store (memory/chroma_store.py).
"""
from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path


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


class Memory(ABC):
    @abstractmethod
    def record(self, outcome: Outcome) -> str:
        """Store one outcome; returns its id. Safe to call from parallel agents."""

    @abstractmethod
    def similar(self, deployment: dict, k: int = 10) -> list[Hit]:
        """Past outcomes on the deployments closest to `deployment`, best first."""

    def search(self, text: str, k: int = 10) -> list[Hit]:
        """Past outcomes whose mechanism descriptions match `text` (implementations with text search override)."""
        return []


class JsonlMemory(Memory):
    """One JSON line per outcome in a local file; similarity = same target architecture, device and batch size."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def record(self, outcome: Outcome) -> str:
        line = json.dumps(outcome.to_dict(), sort_keys=True, default=str)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
        return outcome.candidate.get("id", "")

    def outcomes(self) -> list[Outcome]:
        if not self.path.exists():
            return []
        out = []
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                out.append(Outcome(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(f"memory file {self.path}, line {n}: not an outcome record ({e})") from e
        return out

    def similar(self, deployment: dict, k: int = 10) -> list[Hit]:
        keys = ("architecture", "device_name", "batch_size")
        hits = [Hit(o, sum(o.deployment.get(key) == deployment.get(key) for key in keys) / len(keys))
                for o in self.outcomes()]
        return sorted(hits, key=lambda h: -h.score)[:k]
