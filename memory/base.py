"""The memory interface the agent graph writes every outcome to and reads similar past outcomes from.

The records are memory/outcome.py's `Outcome` (one evaluated candidate: what it changed, on which deployment, what it
measured, whether it passed the token-forcing gate and why not, the library versions it was measured with) and
`Hit` (a retrieved outcome with its score); both are re-exported here. Implementations: `JsonlMemory`
(memory/jsonl_store.py: a local JSON-lines file, no Chroma and no text model) and the Chroma store
(memory/chroma_store.py).
"""
from __future__ import annotations

import json
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path

from ..engine.errors import SpecPilotError
from .outcome import Hit, Outcome
from .records import current_versions, failure_reason, outcome_json, version_differences, worked


class MemoryStoreError(SpecPilotError):
    """The store cannot be opened or used; the message names its path or URL and what to do."""


def move_aside(path: Path) -> Path:
    """Rename a store to <path>.aside-<time>[-n] and return the new name: a bad store is kept, never deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.aside-{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.aside-{stamp}-{n}"), n + 1
    os.rename(path, aside)
    return aside


class Memory(ABC):
    """What the graph uses (record, similar) and what `specpilot memory` uses besides (search, get, count, records,
    flags, export_jsonl, import_jsonl, close; a store is a context manager). `location` names the store."""

    location: str = ""
    moved_aside: Path | None = None  # where fresh=True put the previous store

    @abstractmethod
    def record(self, outcome: Outcome) -> str:
        """Store one outcome; returns its id. Safe to call from parallel agents."""

    @abstractmethod
    def similar(self, deployment: dict, k: int = 10) -> list[Hit]:
        """Past outcomes on the deployments closest to `deployment`, best first."""

    def search(self, text: str, k: int = 10) -> list[Hit]:
        """Past outcomes whose mechanism descriptions match `text` (implementations with text search override)."""
        return []

    @abstractmethod
    def records(self) -> list[tuple[str, Outcome]]:
        """Every (id, outcome), oldest first."""

    def get(self, rid: str) -> Outcome:
        for found, outcome in self.records():
            if found == rid:
                return outcome
        raise KeyError(f"no record {rid!r} in memory {self.location}")

    def count(self) -> int:
        return len(self.records())

    @property
    def versions(self) -> dict:
        """The library versions records are compared with for "re-verify": what a store was given, else this
        process's own (measured once)."""
        if getattr(self, "_versions", None) is None:
            self._versions = current_versions()
        return self._versions

    def flags(self, outcome: Outcome) -> list[str]:
        """"failed" with "failure: why"; "re-verify" with "measured with: torch X (now Y), …"."""
        out = []
        if not worked(outcome):
            out += ["failed", f"failure: {failure_reason(outcome)}"]
        diffs = version_differences(outcome.versions, self.versions)
        if diffs:
            out += ["re-verify", "measured with: " + ", ".join(diffs)]
        return out

    def export_jsonl(self, path: str | Path) -> int:
        """One {"id", "outcome"} JSON line per record, oldest first; returns how many. Written atomically."""
        path = Path(path)
        lines = [json.dumps({"id": rid, "outcome": json.loads(outcome_json(o))}, sort_keys=True)
                 for rid, o in self.records()]
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
        return len(lines)

    @abstractmethod
    def import_jsonl(self, path: str | Path) -> int:
        """Records from an export_jsonl file under their own ids (read with `read_export`); returns how many."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_export(path: str | Path) -> list[tuple[str, Outcome]]:
    """The (id, outcome) rows of an export_jsonl file, in order; a missing file or a bad line raises an error naming
    it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"memory export {path} not found")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not row["id"]:
                raise ValueError('expected {"id": "...", "outcome": {...}}')
            rows.append((row["id"], Outcome.from_dict(row.get("outcome"))))
        except ValueError as e:
            raise ValueError(f"memory export {path}, line {n}: {e}") from e
    return rows
