"""What the nodes use besides the state: the provider that decides and the memory that remembers.

Neither is JSON, so neither lives in the checkpointed state. `specpilot optimize` / `resume` register them for the
run's directory; anything else that runs the graph (LangGraph Studio through langgraph.json, a test) gets them
built from the run's settings on first use.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ..memory import Memory, open_memory
from .candidates import AgentContext, Candidate, RouteDecision
from .providers import make_provider
from .providers.base import Provider


@dataclass
class RunContext:
    provider: Provider
    memory: Memory


_contexts: dict[str, RunContext] = {}
_guard = threading.Lock()


def _key(out_dir) -> str:
    return str(Path(out_dir).resolve())


def register(out_dir, ctx: RunContext) -> None:
    with _guard:
        _contexts[_key(out_dir)] = ctx


def release(out_dir) -> None:
    with _guard:
        _contexts.pop(_key(out_dir), None)


def open_run_memory(spec: str | None) -> Memory:
    """--memory PATH (a Chroma store directory, or a JSON-lines file when it ends in .jsonl), or a Chroma server
    when it is an http(s) URL; None: the default local store. chromadb is imported only for a Chroma store."""
    if spec and str(spec).startswith(("http://", "https://")):
        return open_memory(url=spec)
    return open_memory(path=spec)


def context_for(settings: dict) -> RunContext:
    with _guard:
        ctx = _contexts.get(_key(settings["out_dir"]))
        if ctx is None:
            ctx = RunContext(make_provider(settings["provider"], settings["model"], settings["base_url"]),
                             open_run_memory(settings["memory"]))
            _contexts[_key(settings["out_dir"])] = ctx
        return ctx


def provider_name(provider: Provider) -> str:
    return getattr(provider, "name", None) or type(provider).__name__


def _provider_notes(provider: Provider, start: int, step: str) -> list[dict]:
    """The provider's own notes on one step (the OpenAI provider records whether the LLM answered, was repaired,
    or its policy fallback decided)."""
    trail = getattr(provider, "trail", None)
    if not isinstance(trail, list):
        return []
    return [n for n in trail[start:] if isinstance(n, dict) and n.get("step") == step]


def who_decided(provider: Provider, notes: list[dict]) -> tuple[str, str]:
    """(who, why) for the trail: the provider, or its fallback when it said it fell back. Memory's notes are not
    part of it: each is a trail entry of its own (memory_notes)."""
    name = provider_name(provider)
    fallback = [n for n in notes if n.get("source") == "policy-fallback"]
    if fallback:
        return f"fallback:policy (for {name})", fallback[-1].get("why", "")
    return name, "; ".join(f"{n.get('source')}: {n.get('why')}" for n in notes
                           if n.get("source") not in ("llm", "memory"))


def memory_notes(notes: list[dict]) -> list[dict]:
    """What memory kept the provider from proposing: {candidate, recipe_patch, why} per change (the policy's
    notes with source "memory"; why is the failed outcome's verdict, e.g. "failed on <deployment>: gate: ...")."""
    return [{"candidate": n.get("candidate"), "recipe_patch": n.get("recipe_patch"), "why": n.get("why", "")}
            for n in notes if n.get("source") == "memory"]


def route(ctx: RunContext, gaps: list[dict], hits: list[dict], deployment: dict) -> tuple[RouteDecision, str, str]:
    start = len(getattr(ctx.provider, "trail", None) or [])
    decision = ctx.provider.route(gaps, hits, deployment)
    who, note = who_decided(ctx.provider, _provider_notes(ctx.provider, start, "route"))
    return decision, who, note


def propose(ctx: RunContext, agent_ctx: AgentContext) -> tuple[list[Candidate], str, str, list[dict]]:
    """(candidates, who decided, their note, memory_notes: the changes memory kept out)."""
    start = len(getattr(ctx.provider, "trail", None) or [])
    found = ctx.provider.propose(agent_ctx)
    notes = _provider_notes(ctx.provider, start, f"propose:{agent_ctx.agent}")
    who, note = who_decided(ctx.provider, notes)
    return list(found or []), who, note, memory_notes(notes)
