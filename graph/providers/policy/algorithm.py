"""The algorithm agent's catalog (drafter, k, verification, tree): n-gram drafters and trees of their matches,
layer-skip drafters, EAGLE-3 heads with their draft lengths and trees, replayed chains and trees on a synthetic target,
and AR; priced by the cost model on the profile's deployment where it can be, and where it cannot, ranked after the
priced ones for the evaluation to measure."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ....engine.eagle3 import RANDOM_HEAD, RANDOM_HEAD_VOCAB
from ....engine.loader import ALIASES
from ....engine.recipe import BUILTIN, LOOKUP_MAX_NGRAM, Recipe
from ....engine.replay import best_static_tree, expected_accepted
from ....engine.tree import DynamicTree, chains, tree_from_paths
from ....kernels import FUSED_LAYER_MAX_TOKENS
from ....tools.profile.costmodel import Deployment, ModelShape, Prediction, tree_draft_widths
from .catalog import MIN_GAIN, Option, Skips, short_of_min_gain
from .costview import CostView, _ngram_kernels, _phases, _scaled_kernels, break_even_rate, ms, positions
from .recipes import _describe_current

NGRAM_K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
NGRAM_MAX_CHOICES = (2, 3, 4)
# Layer-skip drafts with a quarter or a half of the target's layers, or just its first one.
LAYERSKIP_FRACTIONS = (0.25, 0.5)
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
# Prompt lookup beside a head's chain (drafter.lookup): copy after the context's last 3-6 tokens where they occurred
# before (on SmolLM2's answers 3-token tails were right 61-78% of the time, about the head's 47-78% there; 6-token
# ones 84-94% against 63-79%: benchmarks/run.py head_vocab, forty-ninth session)
HEAD_LOOKUP = 3
# ... and its copied chain deeper than the head's (drafter.head_k the head's k): up to this many drafts where lookup
# matched. Teacher-forced on SmolLM2's answers, copying up to 5 beside the head's 3 had τ 3.87 / 3.32 / 2.44 on code,
# rag, summarize against 3.10 / 2.69 / 2.09 copying 3 (`head_vocab --lookup-k 5`, fiftieth session); 5 keeps a step
# of one row on the fused layer's FMA path (6 tokens). Timed (H100, fiftieth lease, L): +2-3% at B = 8 over copying
# 3, -2% to -5% at B = 1 (its steps of 5 drafts cost a fifth more in the loop than replayed, not yet known why).
LOOKUP_DEEP_K = 5
# With a replayed acceptance that places the target's token among the drafter's candidates (optimize --acceptance
# FILE with ranks), the best static trees of these many drafts for that profile (engine.replay.best_static_tree):
# at 8B, B = 1, at the packaged head's first version's measured profile, the one of 31 drafts ran 1.93x our fastest
# AR, the chain of 4 1.52x (H200, docs/benchmarks/2026-12-04-twenty-eighth-lease.md, A and D).
REPLAY_TREE_DRAFTS = (15, 31)


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


def _head_lookup_option(view: CostView, cur: Prediction, now: str, dep: Deployment) -> Option:
    """Prompt lookup beside a head's chain (drafter.lookup HEAD_LOOKUP): rows whose context's tail occurred before
    copy what followed. Its price is one search a step, which the cost model has; what it adds is acceptance where
    the text repeats its context, which only the evaluation measures."""
    ldep = replace(dep, lookup_orders=LOOKUP_MAX_NGRAM - HEAD_LOOKUP + 1)
    p = view.predict(ldep, view.acceptance(dep.k))
    cost = p.step_s / cur.step_s - 1.0
    return Option({"drafter": {"lookup": HEAD_LOOKUP}}, (
        f"prompt lookup beside the head (drafter.lookup {HEAD_LOOKUP}) for {now}: a row whose last "
        f"{HEAD_LOOKUP}-{LOOKUP_MAX_NGRAM} tokens occurred before drafts what followed them instead of the head's "
        f"chain, where the answer copies its context (code, retrieved passages, summaries: on SmolLM2-135M a 6-token "
        f"match was right 84-94% of the time against the head's 63-79% there); the calibrated cost model puts the "
        f"step at {ms(p.step_s)} against {ms(cur.step_s)} ({cost:+.0%}), and the acceptance it adds is the "
        f"evaluation's to measure"), (2, 1))


def _lookup_depth_option(recipe: Recipe, view: CostView, cur: Prediction, now: str, dep: Deployment,
                         fma: int | None) -> Option | None:
    """Prompt lookup beside a head's chain, its copied chain up to LOOKUP_DEEP_K drafts and the head's k as it is
    (drafter.head_k): the head's forwards stay, a verify step grows by the copied drafts. Proposed where a step of
    LOOKUP_DEEP_K a row stays on the fused layer's FMA path (or the layer is not fused); what it adds is acceptance
    where the answer copies its context, which only the evaluation measures."""
    if recipe.k >= LOOKUP_DEEP_K or recipe.drafter.head_k or fma and (LOOKUP_DEEP_K + 1) * dep.batch > fma:
        return None
    ddep = replace(dep, k=LOOKUP_DEEP_K, head_k=recipe.k,
                   lookup_orders=dep.lookup_orders or LOOKUP_MAX_NGRAM - recipe.drafter.lookup + 1)
    p = view.predict(ddep, view.acceptance(LOOKUP_DEEP_K))
    cost = p.step_s / cur.step_s - 1.0
    return Option({"k": LOOKUP_DEEP_K, "drafter": {"head_k": recipe.k}}, (
        f"prompt lookup's copied chain up to {LOOKUP_DEEP_K} drafts, the head's still {recipe.k} (drafter.head_k) "
        f"for {now}: a copied draft costs no head forward, only its place in the verify step, which the calibrated "
        f"cost model puts at {ms(p.step_s)} against {ms(cur.step_s)} ({cost:+.0%}) if every row verified "
        f"{LOOKUP_DEEP_K}; where the answer copies its context (code, retrieved passages) the longer chains are "
        f"accepted, which the evaluation measures"), (2, 1))


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
        if not 1 <= k <= HEAD_K_MAX or k < recipe.drafter.head_k:
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
        if short_of_min_gain(skipped, gain, f"{name}: the cost model predicts {gain:+.0%} tok/s against {now}"):
            continue
        out.append(Option(patch, (
            f"{name}: the calibrated cost model predicts {p.tokens_per_s:.0f} tok/s against {cur.tokens_per_s:.0f} "
            f"with {now} (+{gain:.0%}): {p.tokens_per_step:.2f} tokens a step from {measured_note}; {_phases(p)}"),
            (1, -gain, k)))
    if recipe.verification != "chain":
        return out
    if not recipe.drafter.lookup:
        out.append(_head_lookup_option(view, cur, now, dep))
    else:
        deeper = _lookup_depth_option(recipe, view, cur, now, dep, fma)
        if deeper is not None:
            out.append(deeper)
        skipped.add("an EAGLE-2 dynamic tree of the head: prompt lookup (drafter.lookup) replaces a chain's drafts")
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
