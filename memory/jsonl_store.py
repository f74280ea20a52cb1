"""The mechanism memory in one local JSON-lines file: no Chroma, no text model, nothing but the standard library.

`--memory PATH.jsonl` (or open_memory("PATH.jsonl"), or $SPECPILOT_MEMORY ending in .jsonl) opens it: for machines
without chromadb (a GPU box with no internet) and for tests. Each line is one record in the export format,
`{"id": ..., "outcome": {...}}` (ChromaMemory.export_jsonl writes the same), so the file can be imported into a
Chroma store as it is (`specpilot memory import PATH.jsonl`) and an export can be opened as a memory. Lines that
hold a bare outcome (the format before ids) are read too, under records.record_id.

The lookups score as ChromaMemory does (records.combined_score, the same "failed" / "re-verify" flags), over every
record in the file rather than a nearest-neighbour pool:

- similar(deployment): similarity = exp(-d^2) of the deployment-vector distance (records.deployment_vector). A
  descriptor that lacks a field the vector needs (hand-written or from an older run) falls back to the share of
  architecture, device_name and batch_size that match.
- search(text): similarity = the cosine of the word counts of `text` and of the record's mechanism text
  (records.mechanism_text): a word match, not the MiniLM embedding Chroma uses. Cosine 0 is no match.

Writes append one line under a thread lock and an fcntl lock on the file (several processes may share it); the same
outcome twice is stored once. Reads read the whole file each time, so records written by another process are seen.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import threading
from collections import Counter
from pathlib import Path

from .base import Memory, MemoryStoreError, move_aside, read_export
from .outcome import Hit, Outcome
from .records import (combined_score, deployment_vector, mechanism_text, outcome_json, record_id,
                      similarity_from_distance)

FALLBACK_KEYS = ("architecture", "device_name", "batch_size")
_WORD = re.compile(r"[a-z0-9]+")


def is_jsonl_path(spec) -> bool:
    """A memory spec that names a JSON-lines file (ends in .jsonl)."""
    return spec is not None and str(spec).lower().endswith(".jsonl")


def words(text: str) -> Counter:
    return Counter(_WORD.findall(str(text).lower()))


def word_cosine(a: Counter, b: Counter) -> float:
    dot = sum(n * b[w] for w, n in a.items() if w in b)
    if not dot:
        return 0.0
    return dot / (math.sqrt(sum(n * n for n in a.values())) * math.sqrt(sum(n * n for n in b.values())))


class JsonlMemory(Memory):
    def __init__(self, path: str | Path, fresh: bool = False, versions: dict | None = None):
        """`fresh`: move an existing file aside (kept, never deleted; the new name is in `moved_aside`) and start an
        empty one. `versions`: what records are compared with for "re-verify" (default: records.current_versions())."""
        self.path = Path(path).expanduser().resolve()
        self.location = str(self.path)
        self.moved_aside: Path | None = None
        self._versions = versions
        self._lock = threading.Lock()
        if self.path.exists() and not self.path.is_file():
            raise MemoryStoreError(f"memory file {self.path} is not a file")
        if fresh and self.path.exists():
            self.moved_aside = move_aside(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch(exist_ok=True)
        except OSError as e:
            raise MemoryStoreError(f"memory file {self.path} cannot be created: {e}") from e
        self.records()  # a corrupted file is refused now, not at the first lookup

    # -- the file -------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, mode: str, exclusive: bool):
        with self._lock, open(self.path, mode) as f:
            fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield f
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _parse(self, text: str) -> list[tuple[str, Outcome]]:
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if isinstance(row, dict) and set(row) == {"id", "outcome"}:
                    if not isinstance(row["id"], str) or not row["id"]:
                        raise ValueError('expected {"id": "...", "outcome": {...}}')
                    out.append((row["id"], Outcome.from_dict(row["outcome"])))
                else:  # a bare outcome
                    outcome = Outcome.from_dict(row)
                    out.append((record_id(outcome), outcome))
            except ValueError as e:  # json.JSONDecodeError is one
                raise MemoryStoreError(
                    f"memory file {self.path}, line {n}: not an outcome record ({e}). Start a new file with "
                    f"--memory-fresh (JsonlMemory(path, fresh=True)): it moves {self.path.name} aside, deleting "
                    "nothing") from e
        return out

    def _read(self) -> list[tuple[str, Outcome]]:
        if not self.path.exists():
            return []
        with self._locked("r", exclusive=False) as f:
            return self._parse(f.read())

    # -- writing --------------------------------------------------------------------------------------------------

    def record(self, outcome: Outcome) -> str:
        """Append one outcome under records.record_id (the same outcome twice is stored once); returns the id."""
        rid = record_id(outcome)
        self._append([(rid, outcome)])
        return rid

    def _append(self, rows: list[tuple[str, Outcome]]) -> int:
        with self._locked("a+", exclusive=True) as f:
            f.seek(0)
            have = {rid for rid, _ in self._parse(f.read())}
            new = []
            for rid, outcome in rows:
                if rid not in have:
                    have.add(rid)
                    new.append(json.dumps({"id": rid, "outcome": json.loads(outcome_json(outcome))}, sort_keys=True))
            if new:
                f.write("".join(line + "\n" for line in new))
                f.flush()
                os.fsync(f.fileno())
        return len(new)

    # -- reading --------------------------------------------------------------------------------------------------

    def records(self) -> list[tuple[str, Outcome]]:
        """Every (id, outcome), oldest first (by Outcome.time, then id)."""
        return sorted(self._read(), key=lambda r: (r[1].time, r[0]))

    def outcomes(self) -> list[Outcome]:
        """Every outcome, in the order written."""
        return [o for _, o in self._read()]

    def count(self) -> int:
        return len(self._read())

    def _hit(self, rid: str, outcome: Outcome, similarity: float) -> Hit:
        return Hit(outcome, combined_score(similarity, outcome), self.flags(outcome), rid, similarity)

    def similar(self, deployment: dict, k: int = 10) -> list[Hit]:
        """What was tried on deployments like this one, best first: score = exp(-d^2) x speedup_vs_ar (records.py)."""
        if k <= 0:
            return []
        try:
            here = deployment_vector(deployment)
        except ValueError:
            here = None
        hits = []
        for rid, outcome in self._read():
            hits.append(self._hit(rid, outcome, self._closeness(here, deployment, outcome.deployment or {})))
        return sorted(hits, key=lambda h: (-h.score, h.id))[:k]

    @staticmethod
    def _closeness(here: list[float] | None, deployment: dict, other: dict) -> float:
        if here is not None:
            try:
                return similarity_from_distance(math.dist(here, deployment_vector(other)))
            except ValueError:
                pass
        return sum(other.get(key) == deployment.get(key) for key in FALLBACK_KEYS) / len(FALLBACK_KEYS)

    def search(self, text: str, k: int = 10) -> list[Hit]:
        """Outcomes whose mechanism text shares words with `text`, best word match first (cosine > 0 only),
        failures among them flagged; equal matches in order of their combined score (as ChromaMemory.search)."""
        if k <= 0:
            return []
        query = words(text)
        hits = []
        for rid, outcome in self._read():
            sim = word_cosine(query, words(mechanism_text(outcome)))
            if sim > 0:
                hits.append(self._hit(rid, outcome, sim))
        return sorted(hits, key=lambda h: (-round(h.similarity, 6), -h.score, h.id))[:k]

    # -- export / import ------------------------------------------------------------------------------------------

    def import_jsonl(self, path: str | Path) -> int:
        """Records from an export file, under their own ids; ids already here are kept as they are (an id is the
        hash of its outcome). Returns how many lines were read."""
        rows = read_export(path)
        self._append(rows)
        return len(rows)
