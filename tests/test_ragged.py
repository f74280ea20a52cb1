"""Ragged verification (issue #20 item 4c): a step packs each live row's last token and its allotted drafts, rows one
after another, so the target's forward sees B x (k' + 1) token slots however the batch's drafts are spread; the
packing against a brute-force reference, and greedy decoding that gives AR's tokens for rows of different live
lengths, on the modular layer and on the fused layer (Triton's interpreter)."""
from __future__ import annotations

import random

import pytest
import torch

from specpilot.engine.batch_controller import water_fill
from specpilot.engine.decode import _finish_packed, _pack
from specpilot.engine.engine import Engine
from specpilot.engine.model import packed, unpacked
from specpilot.engine.recipe import RecipeError, parse
from specpilot.kernels import triton_fused_layer
from test_decoding import TINY_NEW, tiny_prompts, tiny_reference  # noqa: F401 (a fixture)


def brute_force_pack(inputs, valid, active, budget, n_slots):
    """The packing spelled out with Python lists: alloc by water-filling, then each active row's tokens in order."""
    B, T = inputs.shape
    live = [b for b in range(B) if active[b]]
    alloc = [0] * B
    for b, n in zip(live, water_fill([int(valid[b]) for b in live], budget)):
        alloc[b] = n
    tokens, slots = [], []
    for b in live:
        for j in range(alloc[b] + 1):
            tokens.append(int(inputs[b, j]))
            slots.append(b * T + j)
    assert len(tokens) <= n_slots
    return alloc, tokens, slots


def test_water_fill():
    assert water_fill([0, 0, 4, 4], 4) == [0, 0, 2, 2]
    assert water_fill([1, 4, 4, 4], 4) == [1, 1, 1, 1]
    assert water_fill([1, 4, 4, 4], 6) == [1, 2, 2, 1]  # cap 1 (4 drafts), then one more each for the first two
    assert water_fill([3, 0, 2], 100) == [3, 0, 2]  # a budget past every draft verifies them all
    assert water_fill([], 3) == [] and water_fill([2, 2], 0) == [0, 0]


def test_step_tokens_is_water_fill_row_by_row():
    """The controller's plan of a ragged step (`planned_drafts`: rows grouped by drafts found) is water_fill's
    allocation counted, and its expected tokens the sum over it, row by row; padded, over min(found, k')."""
    from collections import Counter

    from specpilot.engine.batch_controller import expected_tokens, planned_drafts, step_tokens

    rng = random.Random(0)
    for _ in range(500):
        B, k = rng.choice((1, 2, 4, 8, 16)), rng.randint(1, 6)
        found = [rng.randint(0, k) for _ in range(rng.randint(0, B))]
        p, k_step = [rng.random() for _ in range(k)], rng.randint(1, k)
        ragged = sum(expected_tokens(p, n) for n in water_fill(found, k_step * B))
        assert +planned_drafts(found, k_step, True, B) == +Counter(water_fill(found, k_step * B))
        assert +planned_drafts(found, k_step, False, B) == +Counter(min(n, k_step) for n in found)
        assert step_tokens(found, p, k_step, True, B) == pytest.approx(ragged)
        assert step_tokens(found, p, k_step, False, B) == pytest.approx(sum(expected_tokens(p, min(n, k_step))
                                                                            for n in found))


@pytest.mark.parametrize("seed", range(20))
def test_pack_matches_brute_force(seed):
    rng = random.Random(seed)
    B, k = rng.choice((1, 2, 4, 8)), rng.randint(1, 6)
    k_step = rng.randint(1, k)
    budget, n_slots, cache_slots = k_step * B, B * (k_step + 1), 64
    inputs = torch.randint(1, 1000, (B, k + 1))
    positions = torch.randint(0, 40, (B, 1)) + torch.arange(k + 1)[None]
    valid = torch.tensor([rng.randint(0, k) for _ in range(B)])
    active = torch.tensor([rng.random() < 0.8 for _ in range(B)])
    alloc, tokens, at, rows, slots, live = _pack(inputs, positions, valid * active, active, budget, n_slots,
                                                 cache_slots)
    want_alloc, want_tokens, want_slots = brute_force_pack(inputs, valid, active, budget, n_slots)
    n = len(want_tokens)
    assert [int(a) for a, on in zip(alloc, active) if on] == [a for a, on in zip(want_alloc, active) if on]
    assert int(alloc.sum()) <= budget and live.tolist() == [1] * n + [0] * (n_slots - n)
    assert tokens[:n].tolist() == want_tokens and slots[:n].tolist() == want_slots
    assert rows[:n].tolist() == [s // (k + 1) for s in want_slots]
    assert at[:n].tolist() == [int(positions.view(-1)[s]) for s in want_slots]
    # unused slots: a trash padded slot, the cache's last position (never read), dead
    assert slots[n:].tolist() == [B * (k + 1)] * (n_slots - n) and at[n:].tolist() == [cache_slots - 1] * (n_slots - n)
    # packing and unpacking are inverses on the used slots
    x = torch.randn(n_slots, 3)
    back = packed(unpacked(x, slots, B, k + 1).reshape(B * (k + 1), 3), slots)
    assert torch.equal(back[:n], x[:n]) and torch.equal(back[n:], torch.zeros(n_slots - n, 3))


def test_finish_packed_accepts_like_accept_torch():
    """Two rows, one packed step: row 0 verified 2 drafts (both right), row 1 verified 1 of its 3 (wrong): the
    argmax at each packed slot goes back to its row; row 0 emits 3 tokens, row 1 one."""
    V, k = 10, 3
    drafts = torch.tensor([[4, 5, 6], [7, 8, 9]])
    alloc = torch.tensor([2, 1])
    slots = torch.tensor([0, 1, 2, 4, 5, 8])  # row 0 slots 0..2, row 1 slots 4..5 (k + 1 = 4 a row), one unused
    targets = [4, 5, 1, 3, 2, 9]
    logits = torch.full((6, V), -1.0)
    logits[torch.arange(6), torch.tensor(targets)] = 1.0
    history = torch.zeros(2, 16, dtype=torch.long)
    lengths, active = torch.tensor([3, 5]), torch.tensor([True, True])
    out = torch.zeros(2, k + 4, dtype=torch.long)
    n_acc = _finish_packed(history, lengths, active, out, drafts, alloc, logits, slots, torch.tensor([2, 3]))
    assert n_acc.tolist() == [2, 0] and lengths.tolist() == [6, 6]
    assert history[0, 3:6].tolist() == [4, 5, 1] and history[1, 5].item() == 3
    assert out[:, -2].tolist() == [2, 1] and out[:, -1].tolist() == [2, 3]


def ragged_engine(loaded, cycle, k=4, layer="modular"):
    eng = Engine(loaded, parse({"drafter": {"kind": "ngram"}, "k": k, "cuda_graphs": False, "layer": layer,
                                "batch": {"controller": "cost", "ragged": True}}))
    kinds = iter(cycle * 1000)
    eng.decoder.controller.choose = lambda prices: next(kinds)
    eng.decoder.prices = {b: {k: 1.0 for k in range(5)} for b in (1, 2, 3)}  # not measured: the test forces kinds
    return eng


def step_shapes(eng, rows, n):
    shapes = []
    hook = eng.decoder.model.register_forward_pre_hook(lambda mod, args: shapes.append(tuple(args[0].shape)))
    try:
        out = eng.generate(rows, n, ignore_eos=True)
    finally:
        hook.remove()
    return out, shapes[1:]  # after the prefill


def test_ragged_greedy_is_ar(tiny, tiny_reference):
    """Every kind of ragged step (k' = 4, 1, 0 (AR), 2, 3) after every other, over three rows of different lengths
    whose drafts come and go: the target sees 3 x (k' + 1) packed tokens a step (one row of them), and the tokens
    are AR's (HF's greedy) for every family."""
    eng = ragged_engine(tiny.loaded, [4, 1, 0, 2, 3])
    allocs = []
    real = eng.decoder._pack

    def pack(*a):
        out = real(*a)
        allocs.append((a[4], a[0].shape[0], out[0]))
        return out

    eng.decoder._pack = pack
    rows, shapes = step_shapes(eng, tiny_prompts(), TINY_NEW)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    kinds = eng.decoder.last_stats.draft_lengths
    assert shapes == [(3, 1) if k == 0 else (1, 3 * (k + 1)) for k in kinds]
    # a budget of one draft a row (3 a step) went to the rows that had drafts: some row verified two or more
    one_a_row = [alloc for budget, B, alloc in allocs if budget == B]
    assert one_a_row and all(int(a.sum()) <= 3 for a in one_a_row)
    assert any(int(a.max()) >= 2 for a in one_a_row)


def test_ragged_rows_that_finish_leave_their_slots(tiny_model_dir):
    """An EOS token that ends the rows at different steps: each finished row gets no slot from then on (its tokens
    come from AR's stops), and the rows still decoding get AR's tokens."""
    from specpilot.engine.decode import StopCondition
    from specpilot.engine.loader import load

    loaded = load(str(tiny_model_dir("llama")), "fp32", "cpu")
    prompts = tiny_prompts()
    ar = Engine(loaded, parse({})).decoder
    free = ar.generate(prompts, StopCondition(TINY_NEW, ()))
    eos = free[1].tokens[5]  # row 1 stops at its sixth token at the latest
    stop = StopCondition(TINY_NEW, (eos,))
    want = ar.generate(prompts, stop)
    eng = ragged_engine(loaded, [1, 2, 4])
    packs = []
    real = eng.decoder._pack

    def pack(*a):
        out = real(*a)
        packs.append((a[3].clone(), out))
        return out

    eng.decoder._pack = pack
    got = eng.decoder.generate(prompts, stop)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert len({len(r.tokens) for r in got}) > 1  # the rows did finish at different steps
    finished_then_packed = 0
    for active, (alloc, _, _, _, _, live) in packs:
        assert int(live.sum()) == int(((alloc + 1) * active).sum())  # slots for active rows only
        finished_then_packed += int((~active).sum())
    assert finished_then_packed > 0


def test_ragged_on_the_fused_layer(tiny_model_dir):
    """The fused layer takes packed tokens as they are (each token's cache row from `rows`): a ragged run at k' = 1
    (6 packed tokens: FMA path) and k' = 4 (15: tensor cores) decodes the modular layer's tokens, and the fused
    kernels ran."""
    from specpilot.engine.loader import load

    # One layer: the packed layout is the same at every layer, and each interpreted fused-layer call costs 1-6 s
    # (two layers took 88 s, one 44 s)
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    prompts = tiny_prompts()
    want = Engine(loaded, parse({})).generate(prompts, 12, ignore_eos=True)
    calls = []
    real = triton_fused_layer.fused_layer
    triton_fused_layer.fused_layer = lambda *a, **kw: calls.append(a[1].shape[1]) or real(*a, **kw)
    try:
        got = ragged_engine(loaded, [1, 4], layer="fused").generate(prompts, 12, ignore_eos=True)
    finally:
        triton_fused_layer.fused_layer = real
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert {6, 15} <= set(calls)


def test_recipe_key():
    r = parse({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "cost", "ragged": True}})
    assert r.batch.ragged and not parse({}).batch.ragged
    with pytest.raises(RecipeError, match="batch.ragged"):
        parse({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"ragged": True}})


@pytest.mark.parametrize("ragged,fractions", [(False, []), (True, []), (False, [0.25, 0.5])])
def test_shipped_batch_recipe_is_ar(tiny, tiny_reference, ragged, fractions):
    """The batched recipe the benchmarks ship: the adaptive min-2 n-gram with ar_after_miss and overlap, under the
    cost controller (padded, ragged, or padded with fractions of a draft a row) with prices where a draft slot costs
    a quarter of an AR step: its own choices every step, and AR's tokens for every family."""
    eng = Engine(tiny.loaded, parse({"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True,
                                                 "ar_after_miss": True}, "k": 4, "overlap": True, "cuda_graphs": False,
                                     "batch": {"controller": "cost", "ragged": ragged, "fractions": fractions}}))
    eng.decoder.prices = {3: {k: 1 + 0.25 * k for k in (0, *fractions, 1, 2, 3, 4)}}
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    assert all(len(r.found) == len(r.accepted) for r in rows)
