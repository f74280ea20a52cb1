"""The mechanism memory on Chroma: every evaluated candidate, found again by deployment or by what it did.

Two collections share record ids: `specpilot-deployments` holds each record's deployment vector
(records.deployment_vector, squared-L2 space) and `specpilot-mechanisms` its mechanism description embedded by
all-MiniLM-L6-v2 (text_embedding, cosine space). Both keep the full Outcome JSON in the record's metadata, so either
lookup returns whole outcomes in one query. Embeddings are always computed here and passed explicitly; collections
are created with embedding_function=None, so Chroma's default embedding function (which downloads) never runs.

A lookup takes the nearest max(4k, 64) records by vector and re-ranks them by the combined score of
records.combined_score; it flags failures ("failed", ranked below every success) and records measured under other
library versions than this process has ("re-verify"). docs/MEMORY.md has the whole contract.

Where: an embedded PersistentClient at `path` (default $SPECPILOT_MEMORY, else $XDG_DATA_HOME/specpilot/memory,
else ~/.local/share/specpilot/memory), or a Chroma server at `url="http://HOST:PORT"` (HttpClient). Telemetry is off.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from . import text_embedding
from .base import Memory, MemoryStoreError, move_aside, read_export
from .outcome import Hit, Outcome
from .records import (EMBEDDING_VERSION, combined_score, deployment_vector, feature_names, mechanism_text,
                      outcome_json, record_id, similarity_from_distance, worked)

DEPLOYMENTS = "specpilot-deployments"
MECHANISMS = "specpilot-mechanisms"
DEPLOYMENT_EMBEDDING = f"specpilot-deployment-v{EMBEDDING_VERSION}"
TEXT_EMBEDDING = f"{text_embedding.MODEL_NAME} mean-pooled L2-normalised"
CANDIDATE_POOL = 64         # records re-ranked per lookup at least (4k when k is larger)
SERVER_ATTEMPTS = 6         # a server write or read is retried on transport errors: 0.05 s, 0.1 s, ... 1.6 s apart
LOCAL_ATTEMPTS = 4          # an embedded store only on "database is locked" (another process writing)
PAGE = 1000                 # records read per request when listing


def default_path() -> Path:
    if os.environ.get("SPECPILOT_MEMORY"):
        return Path(os.environ["SPECPILOT_MEMORY"]).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "specpilot" / "memory"


# One lock per store (path or URL), shared by every ChromaMemory on it in this process: Chroma shares one client
# system per path, and a record is two writes (mechanism, deployment) that belong together.
_store_locks: dict[str, threading.Lock] = {}
_store_locks_guard = threading.Lock()


def _store_lock(location: str) -> threading.Lock:
    with _store_locks_guard:
        return _store_locks.setdefault(location, threading.Lock())


def _settings():
    from chromadb.config import Settings

    return Settings(anonymized_telemetry=False)


def _open_in_this_process(path: Path) -> bool:
    from chromadb.api.shared_system_client import SharedSystemClient

    return str(path) in getattr(SharedSystemClient, "_identifier_to_system", {})


def _transient(error: Exception, server: bool) -> bool:
    import httpx
    from chromadb.errors import InternalError, RateLimitError

    if server:
        return isinstance(error, (httpx.TransportError, InternalError, RateLimitError))
    return isinstance(error, InternalError) and "locked" in str(error).lower()


class ChromaMemory(Memory):
    def __init__(self, path: str | Path | None = None, url: str | None = None, fresh: bool = False,
                 versions: dict | None = None):
        """`versions`: what records are compared with for "re-verify" (default: records.current_versions())."""
        if path is not None and url is not None:
            raise ValueError("give a memory path or a memory server URL, not both")
        self._versions = versions
        self.moved_aside: Path | None = None  # where fresh=True put the previous store
        self.server = url is not None
        if self.server:
            if fresh:
                raise ValueError("a fresh store applies to a local path; a Chroma server manages its own storage")
            self.location = url
            self._client = self._http_client(url)
        else:
            self.path = Path(path).expanduser().resolve() if path is not None else default_path().resolve()
            self.location = str(self.path)
            if fresh and self.path.exists():
                if _open_in_this_process(self.path):
                    raise MemoryStoreError(f"memory store {self.path} is open in this process; close it before "
                                           "starting a fresh one")
                self.moved_aside = move_aside(self.path)
            self._client = self._persistent_client(self.path)
        self._lock = _store_lock(self.location)
        try:
            self._deployments = self._collection(DEPLOYMENTS, "l2", DEPLOYMENT_EMBEDDING, len(feature_names()))
            self._mechanisms = self._collection(MECHANISMS, "cosine", TEXT_EMBEDDING, text_embedding.DIMENSION)
        except MemoryStoreError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise self._unusable(e) from e

    # -- opening --------------------------------------------------------------------------------------------------

    def _unusable(self, e: Exception) -> MemoryStoreError:
        if self.server:
            return MemoryStoreError(f"memory server {self.location}: {type(e).__name__}: {e}")
        return MemoryStoreError(
            f"memory store {self.path} is corrupted or unreadable ({type(e).__name__}: {e}). Start a new store with "
            f"--memory-fresh (open_memory(fresh=True)): it moves {self.path} aside to {self.path.name}.aside-<time>, "
            "deleting nothing")

    def _persistent_client(self, path: Path):
        import chromadb

        if path.exists() and not path.is_dir():
            raise MemoryStoreError(f"memory store {path} is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
            return chromadb.PersistentClient(path=str(path), settings=_settings())
        except Exception as e:  # sqlite, the Rust bindings and the OS each fail in their own way
            raise self._unusable(e) from e

    def _http_client(self, url: str):
        import chromadb

        parts = urlparse(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"memory server URL {url!r}: expected http://HOST:PORT")
        port = parts.port or (443 if parts.scheme == "https" else 8000)  # 8000: `chroma run`'s default port
        try:
            return chromadb.HttpClient(host=parts.hostname, port=port, ssl=parts.scheme == "https",
                                       settings=_settings())
        except Exception as e:
            raise MemoryStoreError(f"memory server {url} cannot be reached: {e}") from e

    def _collection(self, name: str, space: str, embedding: str, dimension: int):
        from chromadb.errors import NotFoundError

        try:
            col = self._client.get_collection(name, embedding_function=None)
        except NotFoundError:
            col = self._client.get_or_create_collection(
                name, embedding_function=None, configuration={"hnsw": {"space": space}},
                metadata={"embedding": embedding, "dimension": dimension})
        found = (col.metadata or {}).get("embedding")
        if found != embedding:
            raise MemoryStoreError(
                f"memory {self.location}: collection {name} holds {found} vectors, this specpilot computes "
                f"{embedding}. Export it (`specpilot memory export FILE`) and import FILE into a new store: "
                "import embeds every record again")
        return col

    def close(self) -> None:
        client, self._client = getattr(self, "_client", None), None
        if client is not None and hasattr(client, "close"):
            client.close()

    def __enter__(self) -> "ChromaMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- Chroma calls ---------------------------------------------------------------------------------------------

    def _call(self, what: str, fn):
        """fn() under the store's lock, retried on transient errors; a Chroma error names the store."""
        from chromadb.errors import ChromaError

        attempts = SERVER_ATTEMPTS if self.server else LOCAL_ATTEMPTS
        for attempt in range(attempts):
            try:
                with self._lock:
                    return fn()
            except Exception as e:
                if attempt + 1 < attempts and _transient(e, self.server):
                    time.sleep(0.05 * 2 ** attempt)
                    continue
                if isinstance(e, ChromaError) or _transient(e, self.server):
                    raise MemoryStoreError(f"memory {self.location}: {what} failed: {type(e).__name__}: {e}") from e
                raise

    # -- writing --------------------------------------------------------------------------------------------------

    def record(self, outcome: Outcome) -> str:
        """Store one outcome under records.record_id (the same outcome twice is stored once); returns the id."""
        rid = record_id(outcome)
        self._write([rid], [outcome])
        return rid

    def _write(self, ids: list[str], outcomes: list[Outcome]) -> None:
        # Everything slow (embedding) happens before taking the lock; upserts make a retried write harmless.
        texts = [mechanism_text(o) for o in outcomes]
        deployment_vectors = [deployment_vector(o.deployment) for o in outcomes]
        text_vectors = text_embedding.encode(texts)
        metas = [_metadata(o) for o in outcomes]
        self._call("writing records", lambda: (
            self._mechanisms.upsert(ids=ids, embeddings=text_vectors, metadatas=metas, documents=texts),
            self._deployments.upsert(ids=ids, embeddings=deployment_vectors, metadatas=metas)))

    # -- reading --------------------------------------------------------------------------------------------------

    def similar(self, deployment: dict, k: int = 10) -> list[Hit]:
        """What was tried on deployments like this one, best first: score = exp(-d^2) x speedup_vs_ar (records.py)."""
        rows = self._query(self._deployments, deployment_vector(deployment), k, "similar deployments")
        return self._rank(rows, lambda squared_l2: similarity_from_distance(math.sqrt(max(squared_l2, 0.0))), k)

    def search(self, text: str, k: int = 10) -> list[Hit]:
        """Outcomes whose mechanism description matches `text`, best text match first (cosine > 0 only), failures
        among them flagged: a search asks "what do we know about this mechanism", and the failure that matches
        best is often the answer (Hit.score keeps the combined score)."""
        [vector] = text_embedding.encode([text])
        rows = self._query(self._mechanisms, vector, k, "text search")
        hits = self._rank(rows, lambda cosine_distance: max(0.0, 1.0 - cosine_distance), len(rows))
        # equal texts (the same mechanism on several deployments) rank by their combined score
        hits = sorted((h for h in hits if h.similarity > 0), key=lambda h: (-round(h.similarity, 6), -h.score, h.id))
        return hits[:k]  # a cosine <= 0 is no match at all

    def _query(self, collection, vector: list[float], k: int, what: str) -> list[tuple[str, dict, float]]:
        if k <= 0:
            return []
        res = self._call(what, lambda: collection.query(query_embeddings=[vector], n_results=max(4 * k, CANDIDATE_POOL),
                                                        include=["metadatas", "distances"]))
        return list(zip(res["ids"][0], res["metadatas"][0], res["distances"][0]))

    def _rank(self, rows, similarity, k: int) -> list[Hit]:
        hits = []
        for rid, meta, distance in rows:
            outcome = self._outcome(rid, meta)
            sim = similarity(distance)
            hits.append(Hit(outcome, combined_score(sim, outcome), self.flags(outcome), rid, sim))
        return sorted(hits, key=lambda h: (-h.score, h.id))[:k]

    def _outcome(self, rid: str, meta: dict | None) -> Outcome:
        try:
            return Outcome.from_dict(json.loads((meta or {})["outcome"]))
        except (KeyError, TypeError, ValueError) as e:
            raise MemoryStoreError(f"memory {self.location}: record {rid} is not an outcome record ({e})") from e

    def get(self, rid: str) -> Outcome:
        res = self._call("reading a record", lambda: self._deployments.get(ids=[rid], include=["metadatas"]))
        if not res["ids"]:
            raise KeyError(f"no record {rid!r} in memory {self.location}")
        return self._outcome(rid, res["metadatas"][0])

    def count(self) -> int:
        return self._call("counting records", self._deployments.count)

    def records(self) -> list[tuple[str, Outcome]]:
        """Every (id, outcome), oldest first (by Outcome.time, then id)."""
        out, offset = [], 0
        while True:
            res = self._call("listing records", lambda: self._deployments.get(limit=PAGE, offset=offset,
                                                                              include=["metadatas"]))
            out += [(rid, self._outcome(rid, meta)) for rid, meta in zip(res["ids"], res["metadatas"])]
            if len(res["ids"]) < PAGE:
                return sorted(out, key=lambda r: (r[1].time, r[0]))
            offset += PAGE

    # -- export / import ------------------------------------------------------------------------------------------

    def import_jsonl(self, path: str | Path, batch: int = 64) -> int:
        """Records from export_jsonl's file, under their own ids (existing ids are overwritten); both embeddings are
        computed again here. Returns how many."""
        rows = read_export(path)
        ids, outcomes = [rid for rid, _ in rows], [o for _, o in rows]
        for i in range(0, len(ids), batch):
            self._write(ids[i: i + batch], outcomes[i: i + batch])
        return len(ids)


def _metadata(o: Outcome) -> dict:
    """The full outcome JSON, and the scalar fields worth filtering on (Chroma metadata holds no None)."""
    d, c = o.deployment or {}, o.candidate or {}
    meta = {"outcome": outcome_json(o), "candidate_id": c.get("id"), "agent": c.get("agent"), "worked": worked(o),
            "architecture": d.get("architecture"), "device_name": d.get("device_name"),
            "batch_size": d.get("batch_size"), "time": o.time, "run": o.run, "embedding_version": EMBEDDING_VERSION}
    value = (o.results or {}).get("speedup_vs_ar")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        meta["speedup_vs_ar"] = float(value)
    return {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))}
