"""Mechanism memory: verified mechanisms and failures, retrieved by deployment similarity or by what they did.

`open_memory()` is how the graph and the CLI get a store: ChromaMemory (memory/chroma_store.py) at a local path or
on a Chroma server. docs/MEMORY.md describes the records, the two lookups and their scores.
"""
from __future__ import annotations

from pathlib import Path

from .base import Hit, JsonlMemory, Memory, Outcome

__all__ = ["Hit", "JsonlMemory", "Memory", "Outcome", "open_memory"]


def open_memory(path: str | Path | None = None, url: str | None = None, fresh: bool = False) -> Memory:
    """The Chroma memory at `path` (default: $SPECPILOT_MEMORY, else ~/.local/share/specpilot/memory) or on the
    server at `url` ("http://HOST:PORT"). fresh=True moves an existing local store aside (kept, never deleted; the
    new name is in the returned store's `moved_aside`) and starts an empty one."""
    from .chroma_store import ChromaMemory

    return ChromaMemory(path=path, url=url, fresh=fresh)
