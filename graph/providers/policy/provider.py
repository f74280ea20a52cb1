"""PolicyProvider: the policy's routes (the agents whose gaps promise MIN_GAIN, then those memory found a passing
change of) and proposals (memory's passing changes first, then the agent's catalog, one option per recipe field first;
a change that failed on a similar deployment, was tried already or changes nothing is left out, and an agent that
proposes nothing says why)."""
from __future__ import annotations

import json
import threading

from ....engine.recipe import Recipe, RecipeError, parse
from ...candidates import AGENTS, AgentContext, Candidate, KernelSource, RouteDecision, merge_patch
from ...proposals import changes
from ..base import Provider
from .algorithm import algorithm_options
from .catalog import MIN_GAIN, Option, Skips, _gaps_of
from .costview import CostView
from .kernel_writer import kernel_writer_options
from .memory import MemoryVerdict, memory_agents, read_memory
from .recipes import agent_name, apply_patch, checkable_patch, patch_error, recipe_effect
from .scheduler import scheduler_options


class PolicyProvider(Provider):
    """Deterministic decisions from the profile, the cost model and memory; no LLM."""

    name = "policy"

    def __init__(self):
        # Notes on its decisions for the graph to show (graph/context.py reads them per step, as the OpenAI provider's):
        # here, each change that memory kept it from proposing, and why.
        self.trail: list[dict] = []
        self._lock = threading.Lock()

    def route(self, gaps: list[dict], memory_hits: list[dict], deployment: dict) -> RouteDecision:
        best: dict[str, float] = {}
        why: dict[str, list[str]] = {}
        for g in gaps or []:
            agent, gain = agent_name(g.get("agent", "")), float(g.get("gain", 0.0))
            if agent in AGENTS and gain >= MIN_GAIN:
                best[agent] = max(best.get(agent, 0.0), gain)
                why.setdefault(agent, []).append(f"{g.get('component')} {gain:.1%}")
        if not best:
            top = max(gaps or [], key=lambda g: g.get("gain", 0.0), default=None)
            largest = f"largest: {top.get('component')} {top.get('gain', 0.0):.1%}" if top else "no gaps"
            return RouteDecision([], f"no gap promises >= {MIN_GAIN:.0%} ({largest}): stop")
        agents = sorted(best, key=lambda a: (-best[a], AGENTS.index(a)))
        parts = [f"{a} ({', '.join(why[a])})" for a in agents]
        if "algorithm" not in agents and not _gaps_of(gaps, "draft", "acceptance"):
            # Without a drafter the profile has no draft or acceptance gap: the gaps cannot price speculation before
            # any acceptance is measured, so the algorithm agent is sent to try it whenever the graph goes on.
            agents.append("algorithm")
            parts.append("algorithm (no drafter: no draft or acceptance gap prices speculation yet)")
        for a in memory_agents(memory_hits):
            if a not in agents:
                agents.append(a)
                parts.append(f"{a} (memory: a change that passed and sped up a similar deployment)")
        return RouteDecision(agents, "gaps >= 2%: " + "; ".join(parts))

    def propose(self, ctx: AgentContext) -> list[Candidate]:
        recipe = parse(ctx.recipe)
        # One verdict per change (compared by what the engine would run, not by how the patch is written): the
        # best-scored hit, i.e. the closest deployment, decides.
        verdicts: dict[str, MemoryVerdict] = {}
        for v in read_memory(ctx.memory_hits):
            key = self._effect(ctx.recipe, v.candidate.get("recipe_patch") or {}, _kernel(v.candidate))
            verdicts.setdefault(key or str(v.candidate.get("id")), v)
        failed = {key: v for key, v in verdicts.items() if v.failed}
        failed_ids = {v.candidate.get("id"): v for v in verdicts.values() if v.failed and v.candidate.get("id")}

        picked: list[Candidate] = []
        effects: set[str] = set()
        skipped = Skips()  # why nothing was proposed, when nothing is

        def admit(cand: Candidate) -> None:
            full = len(picked) >= ctx.max_candidates
            if full and not failed:
                return
            if cand.id in ctx.tried:
                skipped.add(f"{_patch_text(cand.recipe_patch)}: already tried in this run")
                return
            error = patch_error(ctx.recipe, cand.recipe_patch, kernel=cand.kernel)
            if error:  # not a valid change of the current recipe, or already part of it
                skipped.add(f"{_patch_text(cand.recipe_patch)}: {error}")
                return
            effect = self._effect(ctx.recipe, cand.recipe_patch, cand.kernel)
            if effect in effects:
                return
            # Memory's veto is looked at before the candidate limit, so that every change it keeps out is named in
            # the trail (and the report), whether or not the limit would have left room for it.
            veto = failed_ids.get(cand.id) or failed.get(effect)
            effects.add(effect)
            if veto is not None:
                self._note(f"propose:{ctx.agent}", "memory", veto.why, candidate=cand.id,
                           recipe_patch=cand.recipe_patch)
                skipped.add(f"{_patch_text(cand.recipe_patch)}: failed on a similar deployment (memory)")
                return
            if not full:
                picked.append(cand)

        for v in verdicts.values():  # memory first, best hit first
            if v.passed and agent_name(v.candidate.get("agent", "")) == ctx.agent:
                original = str(v.candidate.get("reason") or "").strip()
                reason = f"memory: {v.why}" + (f"; originally: {original}" if original else "")
                admit(Candidate(ctx.agent, reason, dict(v.candidate.get("recipe_patch") or {}), _kernel(v.candidate),
                                "memory", v.speedup))

        view = CostView.from_context(ctx.deployment, ctx.profile)
        if view is not None:
            gaps = ctx.gaps or (ctx.profile or {}).get("gaps") or []
            options = self.catalog(ctx.agent, recipe, view, gaps, skipped)
            # First one option per recipe field, in rank order; then the rest. The integrator combines winners that
            # change different fields, so k = 3 and min_ngram = 2 in one round can both be kept, where k = 3 and
            # k = 5 compete for one field: the second value of a field is measured after every other lever.
            fields: set[str] = set()
            for option in options:
                changed = set(changes(ctx.recipe, merge_patch(ctx.recipe, option.patch)))
                if changed & fields:
                    continue
                before = len(picked)
                admit(Candidate(ctx.agent, option.reason, option.patch, None, self.name))
                if len(picked) > before:
                    fields |= changed
            for option in options:
                admit(Candidate(ctx.agent, option.reason, option.patch, None, self.name))
        else:
            skipped.add("the profile has no cost-model deployment or calibrated ceilings: no catalog entry can be "
                        "priced")
        if not picked:
            self._note(f"propose:{ctx.agent}", "policy", nothing_why(skipped))
        return picked

    def _note(self, step: str, source: str, why: str, **extra) -> None:
        with self._lock:
            self.trail.append({"step": step, "source": source, "why": why, **extra})

    @staticmethod
    def catalog(agent: str, recipe: Recipe, view: CostView, gaps: list[dict], skipped: Skips | None = None) \
            -> list[Option]:
        """The agent's options, best first; why each other entry was left out goes to `skipped`."""
        if agent == "algorithm":
            return algorithm_options(recipe, view, skipped)
        if agent == "scheduler":
            return scheduler_options(recipe, view, gaps, skipped)
        if agent == "kernel_writer":
            return kernel_writer_options(recipe, view, gaps, skipped)
        raise ValueError(f"unknown agent {agent!r} (agents: {', '.join(AGENTS)})")

    @staticmethod
    def _effect(recipe: dict, patch: dict, kernel: KernelSource | None) -> str | None:
        try:
            return recipe_effect(apply_patch(recipe, checkable_patch(patch, kernel)), kernel)
        except RecipeError:
            return None


WHY_SHOWN = 8  # reasons named when an agent proposes nothing; the rest are counted


def nothing_why(skipped: list[str]) -> str:
    """The reason an agent that proposes nothing gives: why each catalog entry was left out."""
    if not skipped:
        return "nothing to propose: every catalog entry is part of the current recipe already"
    more = f"; and {len(skipped) - WHY_SHOWN} more" if len(skipped) > WHY_SHOWN else ""
    return "nothing to propose: " + "; ".join(skipped[:WHY_SHOWN]) + more


def _patch_text(patch: dict) -> str:
    return json.dumps(patch, sort_keys=True, separators=(",", ":"))


def _kernel(candidate: dict) -> KernelSource | None:
    k = candidate.get("kernel")
    if isinstance(k, dict) and isinstance(k.get("slot"), str) and isinstance(k.get("source"), str):
        return KernelSource(k["slot"], k["source"])
    return None
