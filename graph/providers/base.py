"""The provider interface: who decides, in the graph, which agents act and what they propose.

`policy` (deterministic, no LLM, the offline default) and `openai` (any OpenAI-compatible endpoint) implement it.
A provider never evaluates anything: it only returns decisions as data, which the graph validates.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..candidates import AgentContext, Candidate, RouteDecision


class Provider(ABC):
    name: str = "provider"

    @abstractmethod
    def route(self, gaps: list[dict], memory_hits: list[dict], deployment: dict) -> RouteDecision:
        """Which agents act this round, given the ranked gaps (each with its `agent` and `gain`) and memory hits."""

    @abstractmethod
    def propose(self, ctx: AgentContext) -> list[Candidate]:
        """Up to ctx.max_candidates candidates for agent ctx.agent, none of whose ids is in ctx.tried."""
