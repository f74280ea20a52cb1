"""Mechanism memory: verified mechanisms and failures, retrieved by deployment similarity or by what they did.

`open_memory()` is how the graph and the CLI get a store: ChromaMemory (memory/chroma_store.py) at a local path or
on a Chroma server, or JsonlMemory (memory/jsonl_store.py) when the path ends in .jsonl. chromadb is imported only
when a Chroma store is opened. docs/MEMORY.md describes the records, the two lookups and their scores.
"""
from __future__ import annotations

import os
from pathlib import Path

from .base import Hit, Memory, MemoryStoreError, Outcome
from .jsonl_store import JsonlMemory, is_jsonl_path

__all__ = ["Hit", "JsonlMemory", "Memory", "MemoryStoreError", "Outcome", "open_memory"]


def open_memory(path: str | Path | None = None, url: str | None = None, fresh: bool = False) -> Memory:
    """The memory at `path` (default: $SPECPILOT_MEMORY, else ~/.local/share/specpilot/memory) or on the Chroma
    server at `url` ("http://HOST:PORT"). A path ending in .jsonl is a JsonlMemory file (no Chroma); any other
    path a Chroma store directory. fresh=True moves an existing local store aside (kept, never deleted; the new
    name is in the returned store's `moved_aside`) and starts an empty one."""
    if url is None:
        where = path if path is not None else os.environ.get("SPECPILOT_MEMORY") or None
        if is_jsonl_path(where):
            return JsonlMemory(where, fresh=fresh)
    from .chroma_store import ChromaMemory

    return ChromaMemory(path=path, url=url, fresh=fresh)
