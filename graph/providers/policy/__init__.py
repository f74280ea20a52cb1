"""The policy provider: deterministic, no LLM, the offline default.

It proposes from a built-in mechanism catalog per agent and picks the parameters with the cost model
(tools/profile/costmodel.py) on the profile's own deployment: its calibrated ceilings, model shape, measured kernel counts and
measured acceptance per draft position. Memory comes first: a change that passed the gate and sped things up on a
similar deployment is proposed before the catalog; one that failed there is not proposed at all. Every candidate's
reason carries the numbers that justified it. docs/PROVIDERS.md describes the catalog.
"""
from __future__ import annotations

import json
import threading
from dataclasses import replace

from ....engine.recipe import Recipe, RecipeError, parse
from ....kernels import DEFAULTS as KERNEL_DEFAULTS, FUSED_LAYER_FMA_MAX_TOKENS, FUSED_LAYER_MAX_TOKENS, IMPLEMENTATIONS
from ...candidates import AGENTS, AgentContext, Candidate, KernelSource, RouteDecision, merge_patch
from ...proposals import changes
from ..base import Provider
from .algorithm import (HEAD_K, HEAD_K_MAX, HEAD_TREE_TOKENS, HEAD_TREE_TOPK, LAYERSKIP_FRACTIONS, NGRAM_K_CHOICES,
                        NGRAM_MAX_CHOICES, REPLAY_TREE_DRAFTS, TREE_BRANCHES, TREE_MAX_STEP_COST, _ngram_dep,
                        algorithm_options, conditional, fused_fma_tokens, head_shape, random_head_shape)
from .catalog import MIN_GAIN, Option, Skips, _gap_text, _gaps_of
from .costview import CostView, _ceilings, _phases, break_even_rate, ms, positions
from .memory import MemoryVerdict, describe_deployment, memory_agents, memory_speedup, read_memory
from .recipes import AGENT_FIELDS, DRAFTER_FIELDS, agent_name, apply_patch, checkable_patch, patch_error, recipe_effect
from .scheduler import BATCH_FRACTIONS, RAGGED_MAX_AVAILABILITY, _fraction_options, batching_options, scheduler_options

# 12-bit weights: the lossless12 format reads 1.5 bytes a weight instead of bf16's 2 (docs/LOSSLESS12.md).
LOSSLESS12_BYTES_PER_PARAM = 1.5
# ... but not on the fused layer, which reads them itself in steps of up to FUSED_LAYER_FMA_MAX_TOKENS tokens and
# decodes them there arithmetic-bound: an AR step of synthetic Llama-3.1-8B, where the bytes would pay, ran 0.81x its
# bf16 step (H200, docs/benchmarks/2026-12-03-twenty-seventh-lease.md, D; the 12-bit modular layer 1.17x-1.21x bf16
# there). The cost model prices bytes only, so the policy proposes neither the one nor the other (the grid measures
# both).
FUSED_12BIT = ("its 12-bit steps are decode-bound (0.81x the bf16 fused AR step at Llama-3.1-8B's shapes, measured), "
               "which the bytes-only cost model does not price")


# ---------------------------------------------------------------------------------------------------- kernel writer

def needs_triton(slot: str, impl: str) -> bool:
    """Built-ins registered as "module:function" are the lazily imported Triton kernels (kernels/__init__.py): they
    run on CUDA (or under the interpreter, far too slow for a model; lossless12's CPU fallback decodes every call)."""
    return isinstance(IMPLEMENTATIONS[slot][impl], str)


def kernel_writer_options(recipe: Recipe, view: CostView, gaps: list[dict], skipped: Skips | None = None) \
        -> list[Option]:
    """Alternative built-ins per slot: where the cost model distinguishes them (attention math vs fused, 12-bit
    weights) ranked by its predicted gain; the others by the measured gap they address."""
    skipped = Skips() if skipped is None else skipped
    out: list[Option] = []
    dep, acc = view.dep, list(view.per_position)
    cur = view.current()
    verify = _gaps_of(gaps, "verify")
    book = _gaps_of(gaps, "bookkeeping")
    verify_gain = max((g.get("gain", 0.0) for g in verify), default=0.0)
    shape = dep.model
    tokens = view.batch * (dep.k + 1)
    cuda_only: list[str] = []  # what exists but runs only on CUDA (Triton), named once in the reason
    only_choice: list[str] = []  # slots whose implementation in use is the only one that runs here
    if recipe.layer != "modular":
        skipped.add(f"layer already {recipe.layer}")
    elif not view.cuda:
        cuda_only.append("layer fused")
    elif recipe.weights.format != "native":
        skipped.add(f"layer fused with {recipe.weights.format} weights: {FUSED_12BIT}")
    elif tokens > FUSED_LAYER_MAX_TOKENS:
        skipped.add(f"layer fused: up to {FUSED_LAYER_MAX_TOKENS} tokens a step, this step has {tokens}")
    elif verify_gain < MIN_GAIN:
        skipped.add(f"layer fused: the verify gap is {verify_gain:.1%} (below {MIN_GAIN:.0%})")
    else:
        out.append(Option({"layer": "fused"}, (
            f"layer fused: each layer of the {tokens}-token step in five Triton kernels (norms, RoPE, cache "
            f"write, attention merge and SwiGLU folded into the GEMVs) instead of ~13; "
            + "; ".join(_gap_text(g) for g in verify)), (0, -verify_gain)))
    # The fused layer runs every decode step of up to FUSED_LAYER_MAX_TOKENS tokens in its own kernels, so the
    # attention, linear and rmsnorm slots serve prefill only there: a candidate changing them changes no step (on the
    # H200 two such candidates took a round's budget, 2026-12-02). The accept slot works outside the layer.
    layer_slots_idle = recipe.layer == "fused" and view.cuda and tokens <= FUSED_LAYER_MAX_TOKENS
    if layer_slots_idle:
        skipped.add(f"attention, linear and rmsnorm kernels: the fused layer runs each {tokens}-token step in its own "
                    f"kernels (those slots serve prefill only)")
    if layer_slots_idle and tokens <= FUSED_LAYER_FMA_MAX_TOKENS:
        skipped.add(f"12-bit weights on the fused layer: {FUSED_12BIT}")
    for slot in ("attention", "linear", "rmsnorm", "accept"):
        if layer_slots_idle and slot != "accept":
            continue
        now = recipe.kernels.get(slot, KERNEL_DEFAULTS[slot])
        runnable = [i for i in IMPLEMENTATIONS[slot] if view.cuda or not needs_triton(slot, i)]
        if runnable == [now]:
            only_choice.append(f"{slot} {now}")
        for impl in IMPLEMENTATIONS[slot]:
            if impl == now:
                continue
            if needs_triton(slot, impl) and not view.cuda:
                cuda_only.append(f"{slot} {impl}")
                continue
            patch: dict = {"kernels": {slot: impl}}
            if slot == "attention":
                fused = impl != "builtin:math"
                p = view.predict(replace(dep, attention="sdpa" if fused else "math"), acc)
                gain = p.tokens_per_s / cur.tokens_per_s - 1.0
                if gain < MIN_GAIN:
                    skipped.add(f"attention {impl}: the cost model predicts {gain:+.1%} tok/s against {now} "
                                f"(below {MIN_GAIN:.0%})")
                    continue
                how = "one fused kernel per layer" if fused else "scores, softmax, weighted sum (3 kernels)"
                model = " (modelled like sdpa)" if impl == "builtin:triton" else ""
                out.append(Option(patch, (
                    f"attention {impl}: {how}{model}; the calibrated cost model's {_phases(p)} against "
                    f"{ms(cur.step_s)} with {now} (+{gain:.0%} tok/s)"), (0, -gain)))
            elif slot == "linear":
                if impl == "builtin:lossless12":
                    if view.dtype != "bf16":
                        skipped.add(f"linear {impl}: re-encodes bf16 weights only (this deployment is {view.dtype})")
                        continue
                    patch = {"kernels": {slot: impl}, "weights": {"format": "lossless12"}}
                    p = view.predict(replace(dep, bytes_per_param=LOSSLESS12_BYTES_PER_PARAM), acc)
                    gain = p.tokens_per_s / cur.tokens_per_s - 1.0
                    if gain < MIN_GAIN:
                        skipped.add(f"linear {impl}: the cost model predicts {gain:+.1%} tok/s (below {MIN_GAIN:.0%})")
                        continue
                    out.append(Option(patch, (
                        f"12-bit lossless weights (linear {impl}, weights.format lossless12): "
                        f"{LOSSLESS12_BYTES_PER_PARAM} instead of {dep.bytes_per_param:g} bytes a weight; the "
                        f"calibrated cost model's memory floor {ms(cur.memory_floor_s)} -> {ms(p.memory_floor_s)}, "
                        f"{_phases(p)} against {ms(cur.step_s)} (+{gain:.0%} tok/s)"), (0, -gain)))
                elif recipe.weights.format == "native":
                    continue  # builtin:torch is what a native-weight recipe already reads its weights with
                else:
                    patch = {"kernels": {slot: impl}, "weights": {"format": "native"}}
                    p = view.predict(replace(dep, bytes_per_param=2.0), acc)
                    gain = p.tokens_per_s / cur.tokens_per_s - 1.0
                    if gain < MIN_GAIN:
                        skipped.add(f"native weights (linear {impl}): the cost model predicts {gain:+.1%} tok/s "
                                    f"(below {MIN_GAIN:.0%})")
                        continue
                    out.append(Option(patch, (
                        f"native bf16 weights (linear {impl}): the calibrated cost model's {_phases(p)} against "
                        f"{ms(cur.step_s)} with 12-bit weights (+{gain:.0%} tok/s)"), (0, -gain)))
            elif impl == "builtin:torch":
                continue  # back to torch from a fused kernel is no speed mechanism
            elif slot == "rmsnorm":
                if verify_gain < MIN_GAIN:
                    skipped.add(f"rmsnorm {impl}: the verify gap is {verify_gain:.1%} (below {MIN_GAIN:.0%})")
                    continue
                norms = 2 * shape.layers + 1 + (2 * shape.layers if shape.qk_norm else 0)
                out.append(Option(patch, (
                    f"rmsnorm {impl}: one kernel per RMSNorm instead of torch's chain of elementwise ops, {norms} "
                    f"norms a forward; " + "; ".join(_gap_text(g) for g in verify)), (1, -verify_gain)))
            elif slot == "accept":
                gain = max((g.get("gain", 0.0) for g in book), default=0.0)
                if not dep.k:
                    skipped.add(f"accept {impl}: no drafts to accept (k = 0)")
                    continue
                if gain < MIN_GAIN:
                    skipped.add(f"accept {impl}: the bookkeeping gap is {gain:.1%} (below {MIN_GAIN:.0%})")
                    continue
                out.append(Option(patch, (
                    f"accept {impl}: argmax over the {dep.k + 1}x{shape.vocab} verify logits, prefix match and "
                    f"count in one kernel; " + "; ".join(_gap_text(g) for g in book)), (1, -gain)))
    if only_choice:
        skipped.add(f"already at the only implementation that runs on {view.device}: {', '.join(only_choice)}")
    if cuda_only:
        skipped.add(f"Triton kernels need CUDA (this deployment runs on {view.device}): {', '.join(cuda_only)}")
    return sorted(out, key=lambda o: o.rank)


# --------------------------------------------------------------------------------------------------------- provider

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
