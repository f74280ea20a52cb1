"""The policy provider: deterministic, no LLM, the offline default.

It proposes from a built-in mechanism catalog per agent and picks the parameters with the cost model
(tools/profile/costmodel.py) on the profile's own deployment: its calibrated ceilings, model shape, measured kernel counts and
measured acceptance per draft position. Memory comes first: a change that passed the gate and sped things up on a
similar deployment is proposed before the catalog; one that failed there is not proposed at all. Every candidate's
reason carries the numbers that justified it. docs/PROVIDERS.md describes the catalog.
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from pathlib import Path

from ....engine.eagle3 import RANDOM_HEAD, RANDOM_HEAD_VOCAB
from ....engine.loader import ALIASES
from ....engine.recipe import BUILTIN, Recipe, RecipeError, parse
from ....engine.replay import best_static_tree, expected_accepted
from ....engine.tree import DynamicTree, chains, tree_from_paths
from ....kernels import DEFAULTS as KERNEL_DEFAULTS, FUSED_LAYER_FMA_MAX_TOKENS, FUSED_LAYER_MAX_TOKENS, IMPLEMENTATIONS
from ....tools.profile.costmodel import Deployment, ModelShape, Prediction, expected_tokens, tree_draft_widths
from ...candidates import AGENTS, AgentContext, Candidate, KernelSource, RouteDecision, merge_patch
from ...proposals import changes
from ..base import Provider
from .catalog import MIN_GAIN, Option, Skips, _gap_text, _gaps_of
from .costview import CostView, _ceilings, _ngram_kernels, _phases, _scaled_kernels, break_even_rate, ms, positions
from .memory import MemoryVerdict, describe_deployment, memory_agents, memory_speedup, read_memory
from .recipes import (AGENT_FIELDS, DRAFTER_FIELDS, _describe_current, agent_name, apply_patch, checkable_patch,
                      patch_error, recipe_effect)

NGRAM_K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
NGRAM_MAX_CHOICES = (2, 3, 4)
# Layer-skip drafts with a quarter or a half of the target's layers, or just its first one.
LAYERSKIP_FRACTIONS = (0.25, 0.5)
# 12-bit weights: the lossless12 format reads 1.5 bytes a weight instead of bf16's 2 (docs/LOSSLESS12.md).
LOSSLESS12_BYTES_PER_PARAM = 1.5
# ... but not on the fused layer, which reads them itself in steps of up to FUSED_LAYER_FMA_MAX_TOKENS tokens and
# decodes them there arithmetic-bound: an AR step of synthetic Llama-3.1-8B, where the bytes would pay, ran 0.81x its
# bf16 step (H200, docs/benchmarks/2026-12-03-twenty-seventh-lease.md, D; the 12-bit modular layer 1.17x-1.21x bf16
# there). The cost model prices bytes only, so the policy proposes neither the one nor the other (the grid measures
# both).
FUSED_12BIT = ("its 12-bit steps are decode-bound (0.81x the bf16 fused AR step at Llama-3.1-8B's shapes, measured), "
               "which the bytes-only cost model does not price")
# An n-gram tree: this many branches of k drafts (the drafter's several matches, latest first), proposed when the
# cost model puts the wider verification at most TREE_MAX_STEP_COST above the chain's step (a launch-bound step).
TREE_BRANCHES = 3
TREE_MAX_STEP_COST = 0.15
# An EAGLE-3 head's chain as serving engines deploy it: 3 draft steps, top-1 (SGLang --speculative-num-steps 3
# --speculative-eagle-topk 1 --speculative-num-draft-tokens 4).
HEAD_K = 3
# The draft lengths and dynamic trees the algorithm agent tries once a recipe drafts with a head: k one shorter or
# one longer (1..HEAD_K_MAX), and an EAGLE-2 tree of the same depth, HEAD_TREE_TOPK children a node, as many tokens
# as keep a step on the fused layer's kernels (at most FUSED_LAYER_MAX_TOKENS a batch; HEAD_TREE_TOKENS a row).
HEAD_K_MAX = 6
HEAD_TREE_TOPK = 2
HEAD_TREE_TOKENS = 16
# Ragged verification is proposed only when at most this fraction of rows have drafts a step: above it few draft
# slots of a padded step are left empty, so there is little for packing to hand to other rows.
RAGGED_MAX_AVAILABILITY = 0.8
# With a replayed acceptance that places the target's token among the drafter's candidates (optimize --acceptance
# FILE with ranks), the best static trees of these many drafts for that profile (engine.replay.best_static_tree):
# at 8B, B = 1, at the packaged head's measured profile, the one of 31 drafts ran 1.93x our fastest AR, the chain of
# 4 1.52x (H200, docs/benchmarks/2026-12-04-twenty-eighth-lease.md, A and D).
REPLAY_TREE_DRAFTS = (15, 31)


# -------------------------------------------------------------------------------------------------------- algorithm

def _ngram_dep(view: CostView, k: int, max_ngram: int, min_ngram: int) -> Deployment:
    base = view.dep
    orders = max_ngram - min_ngram + 1
    draft_kernels = None
    if base.drafter_kind == "ngram":
        draft_kernels = _scaled_kernels(base.kernels_per_draft_forward, _ngram_kernels(base.ngram_orders),
                                        _ngram_kernels(orders))
    return replace(base, k=k, drafter_kind="ngram", drafter_model=None, drafter_layers=0, ngram_orders=orders,
                   kernels_per_draft_forward=draft_kernels)


def _layerskip_dep(view: CostView, k: int, layers: int) -> Deployment:
    base, shape = view.dep, view.dep.model
    per_forward = _scaled_kernels(base.kernels_per_target_forward, shape.estimate_kernels(),
                                  shape.estimate_kernels(layers))
    return replace(base, k=k, drafter_kind="layerskip", drafter_model=None, drafter_layers=layers,
                   kernels_per_draft_forward=per_forward)


def algorithm_options(recipe: Recipe, view: CostView, skipped: Skips | None = None) -> list[Option]:
    """Drafter and k ranked by the cost model's tokens/s: from the measured acceptance where the profiled drafter's
    acceptance applies, else by the acceptance each option needs to break even with the current recipe."""
    skipped = Skips() if skipped is None else skipped
    cur = view.current()
    cur_tps, dep = cur.tokens_per_s, view.dep
    now = _describe_current(recipe)
    measured_note = (f"the measured per-position acceptance {positions(view.per_position)} (tau {view.tau:.2f})")
    options: list[Option] = []

    if dep.drafter_kind != "none":
        gain = cur.ar_tokens_per_s / cur_tps - 1.0
        if gain >= MIN_GAIN:
            options.append(Option(
                {"drafter": {"kind": "none"}, "k": 0},
                f"turn speculation off (AR): the calibrated cost model predicts {cur.ar_tokens_per_s:.0f} tok/s "
                f"against {cur_tps:.0f} tok/s with {now} (+{gain:.0%}); at {measured_note} the draft "
                f"({ms(cur.draft.time_s)}) and the {dep.k + 1}-token verify ({ms(cur.verify.time_s)}) cost more than "
                f"the {cur.tokens_per_step - 1:.2f} extra tokens a step bring (AR step {ms(cur.ar_step_s)})",
                (1, -gain)))
        else:
            skipped.add(f"AR: the cost model predicts {gain:+.0%} tok/s against {now} (below {MIN_GAIN:.0%})")

    if view.synthetic:  # no drafter can predict random weights' text: drafts are replayed, or there are none
        skipped.add("drafters that predict the target's text (n-gram, layer-skip, EAGLE-3 heads, trees of their "
                    "matches): the target is synthetic, its weights random, so what they would find is noise"
                    + ("" if view.replay else "; `optimize --acceptance` replays a drafter's acceptance"))
        options += _replay_options(recipe, view, cur, now, skipped)
        return sorted(options, key=lambda o: o.rank)

    min_ngram = recipe.drafter.min_ngram if recipe.drafter.kind == "ngram" else 1
    stock = BUILTIN["stock-ngram"]
    best_ngram: tuple[float, str] | None = None  # the best n-gram option left out, for the reason
    unreachable = 0  # n-gram options that no acceptance rate below 1 makes pay
    fma = fused_fma_tokens(recipe, view)
    off_fma: list[int] = []  # draft lengths whose verify step would leave the fused layer's FMA path
    for k in NGRAM_K_CHOICES:
        for max_ngram in NGRAM_MAX_CHOICES:
            if min_ngram > max_ngram:
                continue
            same = recipe.drafter.kind == "ngram" and recipe.k == k and recipe.drafter.max_ngram == max_ngram
            if same:
                continue
            patch = {"drafter": {"kind": "ngram", "max_ngram": max_ngram, "min_ngram": min_ngram}, "k": k}
            ndep = _ngram_dep(view, k, max_ngram, min_ngram)
            name = f"n-gram drafter k={k}, max_ngram={max_ngram}"
            if fma and dep.drafter_kind == "ngram" and k != recipe.k:
                if (k + 1) * dep.batch > fma:
                    off_fma.append(k)
                    continue
                if max_ngram == recipe.drafter.max_ngram:
                    # The cost model prices a GEMM by its weights, read once whatever the tokens; the fused layer's
                    # FMA path runs a program per token, so its verify step grows with every draft. Prices of
                    # another k are not to be trusted there: the nearest lengths are measured, shorter first (on
                    # the H200 the fused layer's k = 2 beat its k = 4 on code and chat, 2026-12-02 grid).
                    options.append(_fma_length_option(patch, name, k, recipe.k,
                                                      view.predict(ndep, view.acceptance(k)), cur_tps,
                                                      measured_note))
                continue
            if dep.drafter_kind == "ngram":
                acc = view.acceptance(k)
                p = view.predict(ndep, acc)
                gain = p.tokens_per_s / cur_tps - 1.0
                if gain < MIN_GAIN:
                    best_ngram = max(best_ngram or (gain, name), (gain, name))
                    continue
                extra = (f", positions {len(view.per_position) + 1}-{k} taken at the worst measured "
                         f"{min(view.per_position, default=0.0):.2f}" if k > len(view.per_position) else "")
                ngram_note = ("" if max_ngram == recipe.drafter.max_ngram else
                              f"; acceptance as measured with max_ngram={recipe.drafter.max_ngram} (another "
                              f"max_ngram changes it: the evaluation measures it)")
                options.append(Option(patch, (
                    f"{name}: the calibrated cost model predicts {p.tokens_per_s:.0f} tok/s against {cur_tps:.0f} "
                    f"tok/s with {now} (+{gain:.0%}): {p.tokens_per_step:.2f} tokens a step from "
                    f"{measured_note}{extra}; {_phases(p)}{ngram_note}"), (1, -gain, k, max_ngram)))
            else:
                p = view.predict(ndep, 0.0)
                need = cur_tps * p.step_s / p.batch
                rate = break_even_rate(k, need)
                if rate is None or rate >= 1.0:
                    unreachable += 1
                    continue
                first = k == stock.k and max_ngram == stock.drafter.max_ngram and min_ngram == stock.drafter.min_ngram
                options.append(Option(patch, (
                    f"{name}{' (the built-in stock-ngram)' if first else ''}: no n-gram acceptance measured "
                    f"yet (the profile ran {now}); the calibrated cost model's {_phases(p)} against "
                    f"{ms(cur.step_s)} now, so it beats the current {cur_tps:.0f} tok/s once drafts are accepted "
                    f"at a per-token rate above {rate:.2f} (tau above {need:.2f})"),
                    (2, 0 if first else 1, rate, k, max_ngram)))

    if off_fma:
        skipped.add(f"n-gram k={', '.join(map(str, sorted(set(off_fma))))} on the fused layer: a verify step of more "
                    f"than {fma} tokens leaves its FMA path for the tensor cores' (on the H200 its k = 6 ran 0.72x and "
                    f"0.66x its k = 4 on code and chat, 2026-12-02 grid)")
    if best_ngram is not None:
        skipped.add(f"n-gram drafters: none is predicted to gain {MIN_GAIN:.0%} over {cur_tps:.0f} tok/s with {now} "
                    f"at {measured_note} (best: {best_ngram[1]}, {best_ngram[0]:+.0%})")
    if unreachable:
        skipped.add(f"{unreachable} n-gram option(s) would not beat {cur_tps:.0f} tok/s even with every draft accepted "
                    f"(the calibrated cost model's draft and verify cost more than the extra tokens bring)")
    options += _layerskip_options(recipe, view, cur, now, skipped)
    options += _head_options(recipe, view, cur, now, skipped)
    options += _head_tuning_options(recipe, view, cur, now, measured_note, skipped)
    if recipe.drafter.kind != "none" and not recipe.drafter.adaptive and view.per_position:
        # Not priced by the cost model (it verifies k drafts a step): after every option it predicts a gain for.
        options.append(Option({"drafter": {"adaptive": True}}, (
            f"adaptive draft length for {now}: at {measured_note} many drafts are verified only to be rejected; "
            f"with an adaptive length each row verifies 1..{recipe.k} drafts, two more after a fully accepted draft "
            f"and one fewer after a rejection, and the fused layer skips the slots past them (with the modular layer "
            f"only the acceptance changes); the cost model does not price this, the evaluation measures it"),
            (2, 1)))
    elif recipe.drafter.kind != "none" and not recipe.drafter.adaptive:
        skipped.add("adaptive draft length: no acceptance measured per position to justify it")
    d = recipe.drafter
    if d.kind == "ngram" and d.min_ngram == 1 and d.max_ngram >= 2 and view.per_position:
        # Not priced: acceptance by the order of the match is not in the profile.
        options.append(Option({"drafter": {"min_ngram": 2}}, (
            f"n-gram matches of at least 2 tokens for {now}: a 1-token match is the least specific context, and at "
            f"{measured_note} most drafts are rejected; with min_ngram=2 the drafter proposes nothing rather than a "
            f"1-token guess, so fewer steps verify drafts that miss (and with ar_after_miss such steps become AR "
            f"steps); the cost model does not price this, the evaluation measures it"), (2, 0)))
    if d.kind == "ngram" and not d.ar_after_miss and view.per_position:
        # Also not priced: how often the drafter finds nothing is not in the profile. The unpriced drafter options
        # are ranked by what each did across the H200's SmolLM2 grids (48 fused-layer recipes, code and chat,
        # 2026-12-03): ar_after_miss +3.4% / +3.7% (median over the 24 pairs that differ only in it), min_ngram 2
        # +2.0% / +1.1%, the adaptive length -2.0% / -1.2%.
        options.append(Option({"drafter": {"ar_after_miss": True}}, (
            f"AR steps after a miss for {now}: a step whose n-gram search found nothing still verifies a step of "
            f"{recipe.k + 1} tokens, whose dead slots still cost more than an AR step (docs/BENCHMARKS.md); with "
            f"ar_after_miss the host runs an AR step after each such step, the drafter still "
            f"searching; the cost model does not price this, the evaluation measures it"), (2, -1)))
    options += _tree_options(recipe, view, cur, now, measured_note, skipped)
    return sorted(options, key=lambda o: o.rank)


def fused_fma_tokens(recipe: Recipe, view: CostView) -> int | None:
    """The most tokens a step of the fused layer runs on its FMA path (a program per token), on CUDA; else None."""
    if recipe.layer != "fused" or not view.cuda:
        return None
    from ....kernels.triton_fused_layer import FMA_MAX_TOKENS  # (lazily: it imports Triton)

    return FMA_MAX_TOKENS


def _tree_options(recipe: Recipe, view: CostView, cur: Prediction, now: str, measured_note: str,
                  skipped: Skips) -> list[Option]:
    """An n-gram chain whose drafts miss: the same k over TREE_BRANCHES branches (the drafter's several matches), in
    one verification of TREE_BRANCHES x k + 1 tokens, where the cost model puts that step within TREE_MAX_STEP_COST
    of the chain's (a launch-bound step verifies a tree for about what a chain costs). A tree accepts at least what
    its first branch, the chain, does; how much more is not priced (the evaluation measures it)."""
    d = recipe.drafter
    if d.kind != "ngram" or recipe.verification != "chain" or not view.per_position:
        return []
    if d.adaptive or recipe.batch.controller != "none":
        skipped.add("n-gram tree: verifies the whole tree every step (no adaptive length, no batch controller)")
        return []
    shape = chains(TREE_BRANCHES, recipe.k)
    name = f"n-gram tree of {TREE_BRANCHES} branches of {recipe.k} drafts ({shape.nodes} tokens a row a step)"
    if recipe.layer == "fused":
        from ....kernels.triton_fused_layer import FMA_MAX_TOKENS  # (lazily: it imports Triton)

        chain_tokens, tree_tokens = (recipe.k + 1) * view.dep.batch, shape.nodes * view.dep.batch
        if chain_tokens <= FMA_MAX_TOKENS < tree_tokens:
            # The cost model prices the modular layer; on the fused one a step past its FMA path costs what the
            # modular layer's does: on the H200, 9- and 13-node trees' steps cost twice the chain's and lost 0.46x-
            # 0.93x our fastest AR at B = 1 (docs/benchmarks/2026-12-02-seventeenth-lease.md, C)
            skipped.add(f"{name}: {tree_tokens} tokens a step leave the fused layer's FMA path (at most "
                        f"{FMA_MAX_TOKENS}), where the chain's {chain_tokens} run; there a tree step cost twice the "
                        f"chain's on the H200")
            return []
    tree = view.predict(replace(view.dep, tree_nodes=shape.nodes), view.acceptance(recipe.k))
    cost = tree.step_s / cur.step_s - 1.0
    if cost > TREE_MAX_STEP_COST:
        skipped.add(f"{name}: the cost model puts its step {cost:+.0%} over the chain's ({ms(tree.step_s)} against "
                    f"{ms(cur.step_s)}), above {TREE_MAX_STEP_COST:.0%}")
        return []
    paths = [list(p) for p in shape.paths[1:]]
    return [Option({"verification": "tree", "tree": {"kind": "static", "paths": paths}}, (
        f"{name} for {now}: at {measured_note} most drafts are rejected; a tree verifies the drafter's next matches "
        f"as further branches in the same step, which the calibrated cost model puts at {ms(tree.step_s)} against "
        f"{ms(cur.step_s)} ({cost:+.0%}); it accepts at least what the chain does, and its gain is the evaluation's "
        f"to measure"), (2, 1))]


def conditional(cumulative) -> list[float]:
    """Per-position acceptance as the cost model takes it (draft i accepted once drafts 1..i-1 were) from the
    bench's and the replay drafter's form (a_i: the share of steps that accept at least i drafts)."""
    out, before = [], 1.0
    for a in cumulative:
        out.append(a / before if before > 0 else 0.0)
        before = a
    return out


def random_head_shape(target: ModelShape) -> ModelShape:
    """The replay drafter's cost head (engine.eagle3.random_head: the target's layer sizes, one layer, a draft
    vocabulary of RANDOM_HEAD_VOCAB ids) as the cost model's one-layer model."""
    return ModelShape(min(RANDOM_HEAD_VOCAB, target.vocab), target.hidden, target.intermediate, 1, target.heads,
                      target.kv_heads, target.head_dim, tied_embeddings=False)


def _replay_options(recipe: Recipe, view: CostView, cur: Prediction, now: str, skipped: Skips) -> list[Option]:
    """A synthetic target with a replayed acceptance (optimize --acceptance a_1..a_n): a chain of k = 1..n drafts
    at a_1..a_k, drafted at the cost of an EAGLE-3 head of the target's shape (engine/replay.py), each ranked by the
    tok/s the calibrated cost model predicts from that acceptance. Trees only where the profile has ranks (where the
    target's token is among the drafter's other candidates): without them a replayed tree accepts along its first
    chain, so its other nodes would add cost and no acceptance (`_replay_tree_options`)."""
    if not view.replay:
        return []
    shape, best_left, below = random_head_shape(view.dep.model), None, 0
    out = []
    for k in range(1, len(view.replay) + 1):
        profile = list(view.replay[:k])
        d = recipe.drafter
        if d.kind == "replay" and recipe.k == k and recipe.verification == "chain" and list(d.acceptance) == profile:
            continue
        rdep = replace(view.dep, k=k, drafter_kind="eagle3", drafter_model=shape, drafter_layers=0,
                       kernels_per_draft_forward=None, tree_nodes=None, draft_widths=None)
        p = view.predict(rdep, conditional(profile))
        gain = p.tokens_per_s / cur.tokens_per_s - 1.0
        if gain < MIN_GAIN:
            best_left, below = max(best_left or (gain, k), (gain, k)), below + 1
            continue
        patch = {"drafter": {"kind": "replay", "model": RANDOM_HEAD, "acceptance": profile, "ranks": [],
                             "adaptive": False, "ar_after_miss": False}, "k": k, "verification": "chain"}
        out.append(Option(patch, (
            f"a replayed chain of k={k} drafts at the given acceptance {positions(profile)} (tau "
            f"{p.tokens_per_step:.2f}), drafted at the cost of an EAGLE-3 head of the target's shape: the calibrated "
            f"cost model predicts {p.tokens_per_s:.0f} tok/s against {cur.tokens_per_s:.0f} with {now} (+{gain:.0%}); "
            f"{_phases(p)}"), (1, -gain, k)))
    if best_left is not None:
        skipped.add(f"replayed chains: {below} of k = 1-{len(view.replay)} predicted below "
                    f"{MIN_GAIN:.0%} over {cur.tokens_per_s:.0f} tok/s with {now} (best k={best_left[1]}, "
                    f"{best_left[0]:+.0%})")
    return out + _replay_tree_options(recipe, view, cur, now, skipped)


def _replay_tree_options(recipe: Recipe, view: CostView, cur: Prediction, now: str, skipped: Skips) -> list[Option]:
    """With ranks in the replayed profile: the best static tree of each REPLAY_TREE_DRAFTS drafts for it (Sequoia's
    construction, `best_static_tree`), its tokens a step the profile's expectation (`expected_accepted`), its step
    the cost model's for a tree of that many nodes, drafted by a head of the target's shape one level at a time."""
    if not view.replay_ranks:
        return []
    if recipe.batch.controller != "none":
        skipped.add("replayed trees: a tree verifies every node every step (no batch controller)")
        return []
    acceptance, ranks = list(view.replay), [list(r) for r in view.replay_ranks]
    shape, out, sizes = random_head_shape(view.dep.model), [], set()
    for most in REPLAY_TREE_DRAFTS:
        paths = best_static_tree(acceptance, ranks, most)  # (fewer where no further path can be accepted)
        drafts = len(paths)
        if drafts <= 1 or drafts in sizes:
            continue
        sizes.add(drafts)
        depth, tree = max(map(len, paths)), tree_from_paths(paths)
        tokens = 1 + expected_accepted(acceptance, ranks, paths)
        tdep = replace(view.dep, k=depth, drafter_kind="eagle3", drafter_model=shape, drafter_layers=0,
                       kernels_per_draft_forward=None, tree_nodes=drafts + 1,
                       draft_widths=tree_draft_widths(tree) if depth > 1 else None, controller="none", ragged=False)
        p = view.predict(tdep, conditional(acceptance[:depth]))
        tokens_per_s = p.batch * tokens / p.step_s
        gain = tokens_per_s / cur.tokens_per_s - 1.0
        name = f"the best static tree of {drafts} drafts for the replayed profile (depth {depth})"
        if gain < MIN_GAIN:
            skipped.add(f"{name}: predicted {gain:+.0%} over {cur.tokens_per_s:.0f} tok/s with {now}")
            continue
        patch = {"drafter": {"kind": "replay", "model": RANDOM_HEAD, "acceptance": acceptance[:depth],
                             "ranks": ranks[:depth], "adaptive": False, "ar_after_miss": False},
                 "k": depth, "verification": "tree", "tree": {"kind": "static", "paths": paths}}
        out.append(Option(patch, (
            f"{name}: tau {tokens:.2f} under the profile (its 2nd and later candidates' chances included), a step of "
            f"{drafts + 1} tokens a row drafted at the cost of an EAGLE-3 head of the target's shape: the calibrated "
            f"cost model predicts {tokens_per_s:.0f} tok/s against {cur.tokens_per_s:.0f} with {now} (+{gain:.0%}); "
            f"{_phases(p)}"), (1, -gain, drafts)))
    return out


def head_shape(directory: str) -> ModelShape | None:
    """An EAGLE-3 head's shape for the cost model (its one layer over the draft vocabulary), from the config.json of
    its directory or alias; None when there is none to read."""
    try:
        where = Path(directory)
        if not where.is_dir() and directory in ALIASES:  # a packaged head, by its alias
            where = ALIASES[directory]()
        raw = json.loads((where / "config.json").read_text())
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return ModelShape(int(raw.get("draft_vocab_size") or raw["vocab_size"]), hidden, int(raw["intermediate_size"]),
                          1, heads, int(raw.get("num_key_value_heads") or heads),
                          int(raw.get("head_dim") or hidden // heads), tied_embeddings=False)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _head_options(recipe: Recipe, view: CostView, cur: Prediction, now: str, skipped: Skips) -> list[Option]:
    """Each EAGLE-3 head the deployment has (optimize --head): a chain of HEAD_K drafts, the configuration serving
    engines deploy a head with, ranked by the per-token acceptance at which the cost model puts it level with the
    current recipe (a head's acceptance is measured only once it has drafted: the evaluation measures it)."""
    out = []
    for head in view.heads:
        if recipe.drafter.kind == "eagle3" and recipe.drafter.model == head:
            continue
        shape = head_shape(head)
        if shape is None:
            skipped.add(f"EAGLE-3 head {head}: no readable config.json")
            continue
        hdep = replace(view.dep, k=HEAD_K, drafter_kind="eagle3", drafter_model=shape, drafter_layers=0,
                       kernels_per_draft_forward=None, tree_nodes=None, draft_widths=None)
        p = view.predict(hdep, 0.0)
        need = cur.tokens_per_s * p.step_s / p.batch
        rate = break_even_rate(HEAD_K, need)
        if rate is None or rate >= 1.0:
            skipped.add(f"EAGLE-3 head {head}, k={HEAD_K}: would not beat {cur.tokens_per_s:.0f} tok/s even with every "
                        f"draft accepted ({_phases(p)})")
            continue
        patch = {"drafter": {"kind": "eagle3", "model": head, "adaptive": False, "ar_after_miss": False},
                 "k": HEAD_K, "verification": "chain"}
        out.append(Option(patch, (
            f"EAGLE-3 head {head}, a chain of k={HEAD_K} (SGLang's num_steps 3, topk 1): the drafter serving engines "
            f"deploy with a head; the calibrated cost model's {_phases(p)} against {ms(cur.step_s)} now, so it beats "
            f"the current {cur.tokens_per_s:.0f} tok/s with {now} once drafts are accepted at a per-token rate above "
            f"{rate:.2f} (tau above {need:.2f}); its acceptance is the evaluation's to measure"), (2, -2, rate)))
    return out


def _fma_length_option(patch: dict, name: str, k: int, now_k: int, p: Prediction, now_tps: float,
                       measured_note: str) -> Option:
    """Another draft length on the fused layer's FMA path, unpriced: the cost model reads a layer's weights once a
    step, the FMA path runs a program per token, so its verify step grows with every draft. The nearest lengths
    first, the shorter before the longer (the evaluation measures them)."""
    return Option(patch, (
        f"{name} on the fused layer: its FMA path runs a program per token, so a verify step of {k + 1} tokens costs "
        f"{'less' if k < now_k else 'more'} than the {now_k + 1} now, which the calibrated cost model (weights read "
        f"once: {p.tokens_per_s:.0f} against {now_tps:.0f} tok/s) does not price; at {measured_note} the evaluation "
        f"measures it"), (1, 0.0, abs(k - now_k), k > now_k))


def _head_tuning_options(recipe: Recipe, view: CostView, cur: Prediction, now: str, measured_note: str,
                         skipped: Skips) -> list[Option]:
    """A recipe that drafts with an EAGLE-3 head, tuned: its draft length one shorter and one longer, and (a chain)
    an EAGLE-2 dynamic tree of its depth. Lengths are priced with the head's measured acceptance, except on the
    fused layer's FMA path, whose verify step grows with every token where the cost model reads the weights once: there
    the nearer, shorter length comes first and the evaluation measures it (on the H200 the packaged SmolLM2 head's
    chain of 2 beat its chains of 3 and 4 on every workload, docs/benchmarks/2026-12-03-twenty-third-lease.md, C).
    A tree accepts at least what its chain does; it is proposed where the cost model puts its step within
    TREE_MAX_STEP_COST of the chain's and it keeps the step on the fused layer's kernels (at most
    FUSED_LAYER_MAX_TOKENS tokens a batch; its 32-token trees cost 4.7 AR steps a step there)."""
    if recipe.drafter.kind != "eagle3" or view.dep.drafter_kind != "eagle3":
        return []
    out, dep, fma = [], view.dep, fused_fma_tokens(recipe, view)
    head = recipe.drafter.model
    for k in (recipe.k - 1, recipe.k + 1):
        if not 1 <= k <= HEAD_K_MAX:
            continue
        patch = {"k": k}
        name = f"EAGLE-3 head {head}, k={k}"
        if recipe.verification == "tree":
            patch["tree"] = {"kind": "dynamic", "depth": k, "topk": recipe.tree.topk, "tokens": recipe.tree.tokens}
            if recipe.tree.kind != "dynamic" or recipe.tree.tokens <= k:
                continue
        hdep = replace(dep, k=k, draft_widths=None if dep.draft_widths is None else (dep.draft_widths[0],) * (k - 1))
        p = view.predict(hdep, view.acceptance(k))
        if fma and (k + 1) * dep.batch <= fma and recipe.verification == "chain":
            out.append(_fma_length_option(patch, name, k, recipe.k, p, cur.tokens_per_s, measured_note))
            continue
        gain = p.tokens_per_s / cur.tokens_per_s - 1.0
        if gain < MIN_GAIN:
            skipped.add(f"{name}: the cost model predicts {gain:+.0%} tok/s against {now} (below {MIN_GAIN:.0%})")
            continue
        out.append(Option(patch, (
            f"{name}: the calibrated cost model predicts {p.tokens_per_s:.0f} tok/s against {cur.tokens_per_s:.0f} "
            f"with {now} (+{gain:.0%}): {p.tokens_per_step:.2f} tokens a step from {measured_note}; {_phases(p)}"),
            (1, -gain, k)))
    if recipe.verification != "chain":
        return out
    tokens = min(HEAD_TREE_TOKENS, FUSED_LAYER_MAX_TOKENS // max(1, dep.batch),
                 1 + DynamicTree(recipe.k, HEAD_TREE_TOPK, 2).candidates)  # (the root and every draft it scores)
    if recipe.k < 2 or tokens <= recipe.k + 1:
        skipped.add(f"an EAGLE-3 tree of depth {recipe.k}: a step at B = {dep.batch} keeps at most {tokens} tokens a "
                    f"row on the fused layer's kernels, no more than the chain's {recipe.k + 1}")
        return out
    tree = {"kind": "dynamic", "depth": recipe.k, "topk": HEAD_TREE_TOPK, "tokens": tokens}
    name = f"an EAGLE-2 dynamic tree of the head (depth {recipe.k}, top-{HEAD_TREE_TOPK}, {tokens} tokens a row)"
    tdep = replace(dep, tree_nodes=tokens, draft_widths=(HEAD_TREE_TOPK,) * (recipe.k - 1))
    t = view.predict(tdep, view.acceptance(recipe.k))
    cost = t.step_s / cur.step_s - 1.0
    if cost > TREE_MAX_STEP_COST:
        skipped.add(f"{name}: the cost model puts its step {cost:+.0%} over the chain's ({ms(t.step_s)} against "
                    f"{ms(cur.step_s)}), above {TREE_MAX_STEP_COST:.0%}")
        return out
    out.append(Option({"verification": "tree", "tree": tree}, (
        f"{name} for {now}: at {measured_note} a tree verifies the head's next-best drafts as further branches in the "
        f"same step, which the calibrated cost model puts at {ms(t.step_s)} against {ms(cur.step_s)} ({cost:+.0%}); "
        f"it accepts at least what the chain does, and its gain is the evaluation's to measure"), (2, 1)))
    return out


def _layerskip_options(recipe: Recipe, view: CostView, cur: Prediction, now: str, skipped: Skips) -> list[Option]:
    """Layer-skip only where the profile shows it can pay: with the profiled layer-skip drafter's measured acceptance,
    or, for another drafter, when it breaks even at a per-token acceptance no higher than the current drafter's."""
    layers = view.dep.model.layers
    choices = sorted({max(1, int(layers * f)) for f in LAYERSKIP_FRACTIONS} | {1})
    choices = [n for n in choices if n < layers]
    current_rate = view.per_token_acceptance()
    out, left_out = [], 0
    for n in choices:
        for k in NGRAM_K_CHOICES:
            if recipe.drafter.kind == "layerskip" and recipe.drafter.layers == n and recipe.k == k:
                continue
            patch = {"drafter": {"kind": "layerskip", "layers": n}, "k": k}
            ldep = _layerskip_dep(view, k, n)
            name = f"layer-skip drafter ({n} of {layers} layers) k={k}"
            if view.dep.drafter_kind == "layerskip" and view.dep.drafter_layers == n:
                p = view.predict(ldep, view.acceptance(k))
                gain = p.tokens_per_s / cur.tokens_per_s - 1.0
                if gain >= MIN_GAIN:
                    out.append(Option(patch, (
                        f"{name}: the calibrated cost model predicts {p.tokens_per_s:.0f} tok/s against "
                        f"{cur.tokens_per_s:.0f} now (+{gain:.0%}) from the measured per-position acceptance "
                        f"{positions(view.per_position)}; {_phases(p)}"), (1, -gain, k, n)))
                else:
                    left_out += 1
                continue
            if view.dep.drafter_kind == "none":
                skipped.add("layer-skip drafters: no acceptance is measured yet (the profile ran without a drafter)")
                continue  # nothing measured says how often any drafter's tokens are accepted here
            p = view.predict(ldep, 0.0)
            need = cur.tokens_per_s * p.step_s / p.batch
            rate = break_even_rate(k, need)
            if rate is None or rate > current_rate:
                left_out += 1
                continue
            out.append(Option(patch, (
                f"{name}: the calibrated cost model's {_phases(p)} breaks even with the current "
                f"{cur.tokens_per_s:.0f} tok/s at a per-token acceptance of {rate:.2f}, no higher than the "
                f"{current_rate:.2f} the current {now} measured (tau {view.tau:.2f})"), (3, rate, k, n)))
    if left_out:
        skipped.add(f"{left_out} layer-skip option(s): predicted below {MIN_GAIN:.0%} over {cur.tokens_per_s:.0f} "
                    f"tok/s, or breaking even only above the per-token acceptance {current_rate:.2f} measured now")
    return out


# -------------------------------------------------------------------------------------------------------- scheduler

def scheduler_options(recipe: Recipe, view: CostView, gaps: list[dict], skipped: Skips | None = None) -> list[Option]:
    """CUDA graphs, compile (and its autotuning mode), overlap: CUDA-only switches, proposed only on CUDA; the batch
    size limit wherever the deployment's batch is split."""
    skipped = Skips() if skipped is None else skipped
    out: list[Option] = []
    dep = view.dep
    launch_gaps = [g for g in _gaps_of(gaps, "verify", "bookkeeping") if agent_name(g.get("agent", "")) == "scheduler"]
    launch_gain = max((g.get("gain", 0.0) for g in launch_gaps), default=0.0)
    if not view.cuda:
        skipped.add(f"CUDA graphs, torch.compile, autotuned GEMMs and overlap are proposed on CUDA only (this "
                    f"deployment runs on {view.device})")
    if view.cuda and not recipe.cuda_graphs:
        eager, graphed = view.predict(replace(dep, cuda_graphs=False), list(view.per_position)), \
            view.predict(replace(dep, cuda_graphs=True), list(view.per_position))
        gain = graphed.tokens_per_s / eager.tokens_per_s - 1.0
        kernels = eager.draft.kernels + eager.verify.kernels + eager.bookkeeping.kernels
        if gain >= MIN_GAIN:
            out.append(Option({"cuda_graphs": True}, (
                f"CUDA graphs: the calibrated cost model's step drops from {ms(eager.step_s)} eager to "
                f"{ms(graphed.step_s)} replayed (+{gain:.0%} tok/s): {kernels} kernels a step at "
                f"{view.dev.launch_s * 1e6:.1f} us launched against {view.dev.graph_node_s * 1e6:.1f} us as graph "
                f"nodes (calibrated)"), (-gain,)))
        else:
            skipped.add(f"CUDA graphs: the cost model predicts {gain:+.0%} tok/s (below {MIN_GAIN:.0%})")
    if view.cuda and not recipe.compile and launch_gain >= MIN_GAIN:
        out.append(Option({"compile": True}, (
            "torch.compile fuses each layer's elementwise kernels: the step is launch-bound, "
            + "; ".join(_gap_text(g) for g in launch_gaps)), (-launch_gain,)))
    elif view.cuda and not recipe.compile:
        skipped.add(f"torch.compile: no launch-bound gap of {MIN_GAIN:.0%} (largest {launch_gain:.1%})")
    if view.cuda and recipe.compile_mode == "default":
        # GEMMs below their memory or compute floor (the kernel-writer's gaps): what autotuned templates address
        gemm_gaps = [g for g in gaps or [] if agent_name(g.get("agent", "")) == "kernel_writer"
                     and (str(g.get("component", "")).startswith("kernel aten::") or g.get("component") == "verify")]
        gain = max((g.get("gain", 0.0) for g in gemm_gaps), default=0.0)
        if gain >= MIN_GAIN and launch_gain > gain:
            # A launch-bound step's small GEMMs take their launch's time, which no template shortens
            skipped.add(f"autotuned GEMMs: the step is launch-bound ({launch_gain:.0%} against the GEMMs' "
                        f"{gain:.0%}): a GEMM's time there is its launch")
        elif gain >= MIN_GAIN:
            out.append(Option({"compile": True, "compile_mode": "max-autotune-no-cudagraphs"}, (
                "autotuned GEMM templates (compile_mode max-autotune-no-cudagraphs) for the step's small GEMMs: "
                + "; ".join(_gap_text(g) for g in gemm_gaps[:3])), (1, -gain)))
            # (last of the scheduler's: its evaluation autotunes every GEMM shape first, 1 min 48 s of a 6.5-minute
            # budget on the H200 for SmolLM2's code run of 2026-12-02, where the other candidates took 45 s each)
        else:
            skipped.add(f"autotuned GEMMs: no GEMM gap of {MIN_GAIN:.0%} (largest {gain:.1%})")
    if view.cuda and not recipe.overlap:
        idle = _gaps_of(gaps, "idle", "host_sync")
        gain = max((g.get("gain", 0.0) for g in idle), default=0.0)
        if gain >= MIN_GAIN:
            out.append(Option({"overlap": True}, (
                "overlap: the host reads step i's tokens while the device runs step i+1, hiding "
                + "; ".join(_gap_text(g) for g in idle)), (-gain,)))
        else:
            skipped.add(f"overlap: idle and host-sync gaps below {MIN_GAIN:.0%} (largest {gain:.1%})")
    if view.cuda:
        on = [name for name, is_on in (("CUDA graphs", recipe.cuda_graphs), ("torch.compile", recipe.compile),
                                       ("overlap", recipe.overlap)) if is_on]
        if on:
            skipped.add(f"already on: {', '.join(on)}")
    if recipe.batch.max_batch_size < view.batch:
        n, b = recipe.batch.max_batch_size, view.batch
        split = view.predict(replace(dep, batch=n), list(view.per_position))
        whole = view.predict(replace(dep, batch=b), list(view.per_position))
        gain = whole.tokens_per_s / split.tokens_per_s - 1.0
        if gain >= MIN_GAIN:
            out.append(Option({"batch": {"max_batch_size": b}}, (
                f"batch.max_batch_size {n} splits the deployment's {b} requests into {math.ceil(b / n)} sequential "
                f"batches: the calibrated cost model predicts {whole.tokens_per_s:.0f} tok/s decoding all {b} "
                f"together against {split.tokens_per_s:.0f} tok/s at {n} (+{gain:.0%})"), (-gain,)))
        else:
            skipped.add(f"batch.max_batch_size: the cost model predicts {gain:+.0%} tok/s decoding all {b} requests "
                        f"together (below {MIN_GAIN:.0%})")
    else:
        skipped.add(f"batch.max_batch_size {recipe.batch.max_batch_size} already covers the deployment's batch of "
                    f"{view.batch}")
    out += batching_options(recipe, view, skipped)
    return sorted(out, key=lambda o: o.rank)


def _rates(p: Prediction) -> str:
    """The controller's predicted tokens/s per kind of step."""
    return ", ".join(f"k'={d}{' (AR)' if d == 0 else ''} {r:.0f}" for d, r in sorted(p.rates.items()))


# The batch controller's kinds below one draft a row that the scheduler proposes (batch.fractions)
BATCH_FRACTIONS = (0.25, 0.5)


def batching_options(recipe: Recipe, view: CostView, skipped: Skips) -> list[Option]:
    """The batch-level controller (batch.controller cost) and ragged verification (batch.ragged), priced by the cost
    model at the deployment's batch with the measured per-position acceptance (and, for ragged, the measured draft
    availability). Both concern a batch: at B = 1 the algorithm agent's k and AR options cover the one row. B is what
    the engine decodes together: the deployment's batch, or batch.max_batch_size where that splits it."""
    dep, b = view.dep, min(view.batch, recipe.batch.max_batch_size)
    if recipe.drafter.kind == "none" or dep.drafter_kind == "none":
        skipped.add("batch.controller and batch.ragged choose among draft lengths: the recipe has no drafter")
        return []
    if b <= 1:
        skipped.add("batch.controller and batch.ragged: the recipe decodes one request at a time (B = 1); the "
                    "algorithm agent's k and AR options cover a single row")
        return []
    if not view.per_position:
        skipped.add("batch.controller and batch.ragged: no acceptance measured per position to price them")
        return []
    acc = list(view.per_position)
    at_batch = replace(dep, batch=b)
    now_controller, now_ragged = recipe.batch.controller, recipe.batch.ragged
    cur = view.predict(replace(at_batch, controller=now_controller, ragged=now_ragged), acc)
    plain = view.predict(replace(at_batch, controller="none", ragged=False), acc)
    controlled = view.predict(replace(at_batch, controller="cost", ragged=False), acc)
    now = f"{_describe_current(recipe)} at B={b}"
    out: list[Option] = []

    if now_controller == "cost":
        skipped.add("batch.controller already cost")
    else:
        gain = controlled.tokens_per_s / cur.tokens_per_s - 1.0
        losing = plain.tokens_per_s < plain.ar_tokens_per_s
        if controlled.drafts == dep.k:
            skipped.add(f"batch.controller cost: at B={b} the cost model picks k'={dep.k}, the recipe's k, for every "
                        f"step ({_rates(controlled)} tok/s)")
        elif gain < MIN_GAIN:
            skipped.add(f"batch.controller cost: the cost model predicts {gain:+.1%} tok/s at B={b} (k'="
                        f"{controlled.drafts}; below {MIN_GAIN:.0%})")
        else:
            verdict = (f"speculation at k={dep.k} is predicted below AR here ({plain.tokens_per_s:.0f} against "
                       f"{plain.ar_tokens_per_s:.0f} tok/s)" if losing else
                       f"k={dep.k} is not the best draft length here")
            probe = (f"; after {recipe.batch.probe_every} AR steps in a row it probes k={dep.k}, to notice when "
                     f"acceptance comes back (less often while probes do not pay)" if controlled.drafts == 0 else "")
            out.append(Option({"batch": {"controller": "cost"}}, (
                f"batch.controller cost for {now}: {verdict}; with the measured per-position acceptance "
                f"{positions(acc)} the calibrated cost model's rate per kind of step is {_rates(controlled)} tok/s, "
                f"so the controller runs k'={controlled.drafts} ({controlled.tokens_per_s:.0f} against "
                f"{cur.tokens_per_s:.0f} tok/s now, +{gain:.0%}){probe}"), (-gain,)))

    if now_ragged:
        skipped.add("batch.ragged already on")
    elif view.availability is None:
        skipped.add(f"batch.ragged: the profile does not measure draft availability (acceptance.draft_availability); "
                    f"the first position's acceptance {acc[0]:.2f} only bounds it below")
    elif view.availability >= RAGGED_MAX_AVAILABILITY:
        skipped.add(f"batch.ragged: the measured draft availability {view.availability:.2f} (rows with at least one "
                    f"draft a step) is at least {RAGGED_MAX_AVAILABILITY}: few draft slots are left empty to hand on")
    else:
        ragged = view.predict(replace(at_batch, controller="cost", ragged=True), acc)
        gain = ragged.tokens_per_s / cur.tokens_per_s - 1.0
        if gain < MIN_GAIN:
            skipped.add(f"batch.ragged: the cost model predicts {gain:+.1%} tok/s at B={b} with a measured draft "
                        f"availability of {view.availability:.2f} (below {MIN_GAIN:.0%})")
        else:
            # the rows with drafts split the step's drafts: about k'/p each (p at least a_1, as the cost model takes it)
            share = min(dep.k, ragged.drafts / max(view.availability, acc[0]))
            out.append(Option({"batch": {"controller": "cost", "ragged": True}}, (
                f"batch.ragged with the cost controller for {now}: only {view.availability:.0%} of rows have a "
                f"draft a step (measured), so a padded step leaves the others' draft slots empty; packed, a step of "
                f"k'={ragged.drafts} gives its {ragged.drafts}x{b} drafts to those rows (about {share:.1f} each, up "
                f"to {dep.k}): {ragged.tokens_per_step:.2f} tokens a row-step from the measured per-position "
                f"acceptance {positions(acc)}, against {expected_tokens(ragged.drafts, acc):.2f} padded at the same "
                f"k'; the calibrated cost model predicts {ragged.tokens_per_s:.0f} tok/s "
                f"({_rates(ragged)}) against {controlled.tokens_per_s:.0f} with the controller alone and "
                f"{cur.tokens_per_s:.0f} now (+{gain:.0%})"), (-gain,)))
    return out + _fraction_options(recipe, view, b, now, skipped)


def _fraction_options(recipe: Recipe, view: CostView, b: int, now: str, skipped: Skips) -> list[Option]:
    """batch.fractions (the controller's kinds below one draft a row, packed), unpriced: where a step of one draft a
    row (2B tokens) crosses one of the fused layer's thresholds (its FMA path's FUSED_LAYER_FMA_MAX_TOKENS, its own
    FUSED_LAYER_MAX_TOKENS) and a fraction's B(1 + f) tokens stay below it. The cost model prices every width on one
    roofline, so the evaluation measures it."""
    if recipe.batch.fractions:
        skipped.add("batch.fractions already set")
        return []
    if recipe.verification != "chain":
        skipped.add("batch.fractions: they pack a chain's drafts; this recipe verifies a tree")
        return []
    if recipe.layer != "fused" or not view.cuda:
        skipped.add("batch.fractions: they keep a verifying step on the fused layer's cheaper path (CUDA), which "
                    "this recipe does not run")
        return []
    # (threshold, what a step past it runs, and what that cost, measured)
    thresholds = ((FUSED_LAYER_FMA_MAX_TOKENS, "the FMA path", "the tensor-core path (at B = 4, 8 tokens cost 1.6 AR "
                   "steps on the H200; thirty-fourth lease)"),
                  (FUSED_LAYER_MAX_TOKENS, "the fused layer", "the modular layer (at B = 16, 1.15-1.29 ms against "
                   "AR's 0.71 on the H200; thirty-ninth lease)"))
    for limit, kept, past in thresholds:
        fit = [f for f in BATCH_FRACTIONS if 1 <= round(f * b) and b < limit < 2 * b and b + round(f * b) <= limit]
        if fit:
            break
    else:
        skipped.add(f"batch.fractions: at B={b} a step of one draft a row ({2 * b} tokens) crosses none of the fused "
                    f"layer's thresholds ({FUSED_LAYER_FMA_MAX_TOKENS}, {FUSED_LAYER_MAX_TOKENS} tokens) that a "
                    f"fraction of a draft a row stays below")
        return []
    steps = ", ".join(f"{f} ({round(f * b)} draft{'s' if round(f * b) > 1 else ''}, {b + round(f * b)} tokens)"
                      for f in fit)
    return [Option({"batch": {"controller": "cost", "fractions": list(BATCH_FRACTIONS)}}, (
        f"batch.fractions {list(BATCH_FRACTIONS)} with the cost controller for {now}: a step verifying one draft a "
        f"row has {2 * b} tokens, past {kept}'s {limit}, so it runs {past}, where {steps} stay on {kept}; the "
        f"cost model prices every width on one roofline, so the evaluation measures it"), (1, 0.0, 0, False))]


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
