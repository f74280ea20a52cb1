"""Sampling's counter-based random draws (engine/sampling.py `CounterRng`), which let a sampled step be captured in a
CUDA graph: uniform, independent across rows, steps and streams, reproducible from the seed, and `categorical`
draws each index with probability weight / sum. In decoding: the same seed gives the same tokens, and two
identical prompts in one call draw apart (each request its own salt)."""
from __future__ import annotations

import math

import torch

from specpilot.engine.engine import Engine
from specpilot.engine.recipe import parse
from specpilot.engine.sampling import CounterRng, SamplingParams, categorical, uniform


def rng(seed: int, rows: int = 4, lengths=None) -> CounterRng:
    lengths = torch.arange(rows) + 10 if lengths is None else lengths
    return CounterRng(torch.tensor([seed]), torch.arange(rows), lengths)


def test_uniform_draws_are_uniform_and_never_zero_or_one():
    u = rng(1, rows=64).uniform((64, 4096)).flatten()
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    # Kolmogorov-Smirnov against U(0, 1): 262,144 draws, D well under the 0.1% critical value 1.95 / sqrt(n)
    x = u.double().sort().values
    n = x.numel()
    d = max(float((torch.arange(1, n + 1) / n - x).max()), float((x - torch.arange(n) / n).max()))
    assert d < 1.95 / math.sqrt(n)
    assert abs(float(u.mean()) - 0.5) < 0.002 and abs(float(u.var()) - 1 / 12) < 0.001


def test_draws_differ_by_seed_row_length_and_stream_and_repeat_for_the_same_keys():
    a = rng(7).uniform((4, 256))
    assert torch.equal(a, rng(7).uniform((4, 256)))  # the same keys: the same draws
    assert not torch.equal(a, rng(8).uniform((4, 256)))  # another seed
    moved = rng(7, lengths=torch.arange(4) + 11).uniform((4, 256))  # the next step of each row
    r = rng(7)
    first, second = r.uniform((4, 256)), r.uniform((4, 256))  # two draws of one step: two streams
    for other in (moved, second):
        assert float((a == other).float().mean()) < 0.01
    assert torch.equal(first, a)
    # rows apart, and draws of one row independent of another's: correlation near 0 over many draws
    wide = rng(3, rows=2, lengths=torch.tensor([5, 5])).uniform((2, 100_000))
    assert abs(float(torch.corrcoef(wide)[0, 1])) < 0.02


def test_a_draws_key_is_its_rows_value_xor_its_stream_and_index():
    """Draw j of stream s on a row keyed b is mix(b ^ (s << 40 | j)): the stream is folded into the row's value (so a
    compiled step adds no 41-bit constant to an int32 index, which Triton refused on the H200), with the draws the
    index sum gave before."""
    from specpilot.engine import sampling

    r = rng(7)
    r.uniform((4, 8))
    got = r.uniform((4, 300))  # stream 2
    base = sampling._mix(sampling._mix(r.seed + r.salt * sampling._GOLDEN) + r.lengths)
    z = sampling._mix(base[:, None] ^ (torch.arange(300) + (2 << 40))[None, :])
    assert torch.equal(got, (sampling._shift(z, 40).float() + 0.5) * (1.0 / (1 << 24)))


def test_categorical_follows_the_weights():
    """The race of exponential clocks draws index i with probability w_i / sum(w), zero weights never."""
    weights = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.0, 4.0]).repeat(50_000, 1)
    picks = categorical(weights, CounterRng(torch.tensor([11]), torch.arange(50_000), torch.zeros(50_000,
                                                                                                   dtype=torch.long)))
    counts = torch.bincount(picks, minlength=6).double()
    expected = weights[0].double() / weights[0].sum() * picks.numel()
    assert counts[0] == 0 and counts[4] == 0
    chi2 = float((((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: the 0.04% critical value


def test_uniform_and_categorical_take_a_torch_generator_too():
    g = torch.Generator().manual_seed(0)
    assert uniform((2, 3), g, "cpu").shape == (2, 3)
    assert categorical(torch.tensor([[0.0, 1.0]]), g).tolist() == [1]


def test_sampled_decoding_follows_its_seed_and_gives_each_request_its_own_draws(tiny):
    """Two identical prompts in one call: each request its own salt, so they draw apart; the same call with the same
    seed again gives the same tokens, on the n-gram recipe's sampled verification too."""
    for spec in ({}, {"drafter": {"kind": "ngram"}, "k": 3}):
        eng = Engine(tiny.loaded, parse({"cuda_graphs": False, **spec}))
        prompts = [[5, 6, 7, 8, 5, 6, 7]] * 2
        sampling = SamplingParams(temperature=1.5)
        first = [r.tokens for r in eng.generate(prompts, 12, sampling, seed=3, ignore_eos=True)]
        again = [r.tokens for r in eng.generate(prompts, 12, sampling, seed=3, ignore_eos=True)]
        assert first == again, spec
        assert first[0] != first[1], spec
