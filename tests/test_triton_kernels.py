"""The Triton built-ins of the rmsnorm, attention and accept slots, run on CPU by Triton's interpreter: each equals its
torch reference on fp32 inputs, and the engine with all three decodes exactly the default kernels' greedy tokens.

TRITON_INTERPRET must be set before the first kernel module is imported (triton.jit reads it when it decorates), so
it is set here before anything imports them; the kernel modules are imported only by this file.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from specpilot import kernels  # noqa: E402
from specpilot.engine.decode import _finish_step  # noqa: E402
from specpilot.engine.engine import Engine  # noqa: E402
from specpilot.engine.loader import load  # noqa: E402
from specpilot.engine.model import Block  # noqa: E402
from specpilot.engine.recipe import parse  # noqa: E402
from specpilot.engine.drafters import NgramDrafter  # noqa: E402
from specpilot.kernels import (triton_accept, triton_attention, triton_fused_layer, triton_linear,  # noqa: E402
                               triton_ngram, triton_rmsnorm)
from specpilot.kernels.builtin import accept_torch, attention_math, rmsnorm_torch  # noqa: E402

# Triton 3.6's interpreter converts 1-element arrays to scalars the way numpy deprecates: noise, not our code.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TRITON_KERNELS = {"rmsnorm": "builtin:triton", "attention": "builtin:triton", "accept": "builtin:triton"}


def test_kernels_run_in_the_interpreter():
    # Compiled kernels cannot run without a GPU: this fails if a kernel module was imported before the env var was set.
    for kernel in (triton_rmsnorm._rmsnorm_kernel, triton_attention._attention_kernel,
                   triton_attention._combine_kernel, triton_accept._accept_kernel, triton_linear._gemv_kernel,
                   triton_fused_layer._norm_pair_gemv, triton_fused_layer._qk_norm_rope,
                   triton_fused_layer._decode_attention, triton_fused_layer._gemv,
                   triton_ngram._ngram_kernel):
        assert isinstance(kernel, InterpretedFunction)


def test_registered_as_lazy_builtins():
    assert kernels.implementation("rmsnorm", "builtin:triton") is triton_rmsnorm.rmsnorm
    assert kernels.implementation("attention", "builtin:triton") is triton_attention.attention
    assert kernels.implementation("accept", "builtin:triton") is triton_accept.accept
    assert kernels.implementation("linear", "builtin:triton") is triton_linear.linear
    recipe_kernels = parse({"kernels": TRITON_KERNELS}).kernels
    assert {slot: recipe_kernels[slot] for slot in TRITON_KERNELS} == TRITON_KERNELS


def test_benchmarks_refuse_to_run_without_a_gpu():
    for module in (triton_rmsnorm, triton_attention, triton_accept, triton_linear):
        with pytest.raises(RuntimeError, match="GPU"):
            module.benchmark()
    with pytest.raises(RuntimeError, match="GPU"):
        triton_fused_layer.benchmark(model=None, modular=Block.forward)
    with pytest.raises(RuntimeError, match="GPU"):
        triton_ngram.benchmark(NgramDrafter()._search)


@pytest.mark.parametrize("max_ngram,min_ngram,k", [(4, 2, 4), (3, 1, 1), (3, 1, 8), (2, 2, 4), (5, 1, 3)])
def test_ngram_search_proposes_what_the_drafter_proposes(max_ngram, min_ngram, k):
    """The one-kernel n-gram search (what the drafter runs on CUDA) gives the drafter's torch search's tokens and
    valid counts, filler included, on ragged random histories full of repeats, a row without any and a row of one
    token; n-gram ranges of the recipes' kinds."""
    assert triton_ngram.check(NgramDrafter(max_ngram, min_ngram)._search, k, max_ngram, min_ngram) == 11
    with pytest.raises(ValueError, match="max_ngram"):
        triton_ngram.ngram_search(torch.zeros(1, 8, dtype=torch.long), torch.tensor([8]), 2, 9, 1)


# -- linear (GEMV) ------------------------------------------------------------------------------------------------
def test_gemv_matches_torch_on_every_tile_shape():
    # check() covers K below, at and above one 1024-wide tile, N not a multiple of BLOCK_N, with and without bias.
    assert triton_linear.check() < 1e-5
    for n, k in triton_linear.SMOLLM2_SHAPES:
        cfg = triton_linear.gemv_config(n, k)
        assert cfg["BLOCK_N"] * cfg["BLOCK_K"] <= 4096 and cfg["BLOCK_K"] >= min(k, 1024)


def test_gemv_rejects_more_than_one_row_and_linear_falls_back_off_gpu():
    w, x = torch.randn(8, 16), torch.randn(2, 16)
    with pytest.raises(ValueError, match="one row"):
        triton_linear.gemv(x, w)
    torch.testing.assert_close(triton_linear.linear(x, w), torch.nn.functional.linear(x, w))


# -- rmsnorm ------------------------------------------------------------------------------------------------------
def test_rmsnorm_matches_torch():
    triton_rmsnorm.check()


def test_rmsnorm_strided_heads_and_odd_width():
    """Per-head q/k norm input: a head view sliced out of a fused projection (rows do not merge), and a width that is
    not a power of two."""
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(2, 3, 5 * 24, generator=g)
    heads = fused[..., : 4 * 24].view(2, 3, 4, 24)  # like q out of qkv.split(...)
    w = 1 + 0.1 * torch.randn(24, generator=g)
    torch.testing.assert_close(triton_rmsnorm.rmsnorm(heads, w, 1e-6), rmsnorm_torch(heads, w, 1e-6),
                               rtol=1e-5, atol=1e-5)


# -- attention ----------------------------------------------------------------------------------------------------
def test_attention_matches_torch_unsplit_and_split():
    """GQA (rep > 1) and MHA, decode and verify steps, ragged rows, caches not a multiple of the key block, more
    queries than one query block, a sliding window; each unsplit and with the cache split in 2, 3 and 7."""
    triton_attention.check(n_splits=(1, 2, 3, 7))


def test_attention_ignores_stale_slots():
    """Slots past each row's position hold huge stale keys and values (rejected drafts): masked, they change nothing."""
    g = torch.Generator().manual_seed(2)
    B, H, rep, T, S, D = 2, 2, 2, 3, 150, 32
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (rep * T, S, S))
    lengths = torch.tensor([70, 20])
    positions = lengths[:, None] - 1 + torch.arange(T)[None]
    for b in range(B):
        k[b, :, positions[b, -1] + 1:] = 1e4
        v[b, :, positions[b, -1] + 1:] = -1e4
    mask = triton_attention.engine_mask(positions, rep, S)
    want = attention_math(q, k, v, mask)
    assert want.abs().max() < 10
    for splits in (1, 4):
        torch.testing.assert_close(triton_attention.attention_with_splits(q, k, v, mask, splits), want,
                                   rtol=1e-5, atol=1e-5)


def test_attention_picks_no_split_off_gpu():
    assert triton_attention.choose_splits(1, 4096, torch.device("cpu")) == 1


# -- accept -------------------------------------------------------------------------------------------------------
def assert_accept_matches(drafts, valid, logits):
    want, got = accept_torch(drafts, valid, logits), triton_accept.accept(drafts, valid, logits)
    assert torch.equal(got[0], want[0]), (got[0].tolist(), want[0].tolist())
    assert torch.equal(got[1], want[1]), (got[1].tolist(), want[1].tolist())
    assert got[0].dtype == got[1].dtype == torch.int64
    return got


def test_accept_matches_torch():
    """AR steps (k = 0), vocabularies over several blocks and not a multiple of one, tie-heavy logits."""
    triton_accept.check()


@pytest.mark.parametrize("vocab", (300, 5000))
def test_accept_all_none_and_limited_by_valid(vocab):
    g = torch.Generator().manual_seed(3)
    k = 4
    # row 0: every draft right and valid; row 1: the first draft wrong; row 2: all right but only 2 valid;
    # row 3: wrong at position 2; row 4: all right, none valid
    wrong_at = torch.tensor([k, 0, k, 2, k])
    valid = torch.tensor([k, k, 2, k, 0])
    drafts, valid, logits = triton_accept.make_case(5, k, vocab, g, n_valid=valid, wrong_at=wrong_at)
    n_accepted, _ = assert_accept_matches(drafts, valid, logits)
    assert n_accepted.tolist() == [4, 0, 2, 2, 0]


def test_accept_ties_nan_and_all_minus_inf():
    """Ties within a block, across blocks and in the same lane of two blocks go to the lowest index; the first NaN
    wins over everything, +inf included; a row of -inf gives 0, as does a row of one repeated value."""
    g = torch.Generator().manual_seed(4)
    k, vocab = 4, 9000  # two blocks of the kernel's 8192 logits, the second one partial
    block = triton_accept.MAX_BLOCK_V
    assert block < vocab
    logits = torch.randn(2, k + 1, vocab, generator=g)
    logits[0, 0, [8300, 100]] = 50.0  # across blocks
    logits[0, 1, [17 + block, 17]] = 60.0  # the same lane of both blocks
    logits[0, 2, [3001, 3000]] = 70.0  # within a block
    logits[0, 3, [block + 5, 9]] = float("nan")
    logits[0, 3, 5] = float("inf")
    logits[0, 4] = float("-inf")
    logits[1, 0] = 7.0
    logits[1, 1, vocab - 1] = float("inf")  # the last id of the partial block
    drafts = torch.tensor([[100, 17, 3000, 9], [0, vocab - 1, 1, 2]])
    _, tokens = assert_accept_matches(drafts, torch.tensor([k, k]), logits)
    assert tokens[0].tolist() == [100, 17, 3000, 9, 0] and tokens[1, :2].tolist() == [0, vocab - 1]


def test_accept_strided_drafts():
    """The engine's drafts are a slice of its inputs [last, d_1..d_k]."""
    g = torch.Generator().manual_seed(5)
    drafts, valid, logits = triton_accept.make_case(3, 4, 700, g, ties=True)
    inputs = torch.cat([torch.zeros(3, 1, dtype=torch.long), drafts], 1)
    assert_accept_matches(inputs[:, 1:], valid, logits)


# -- the engine end to end ----------------------------------------------------------------------------------------
def test_engine_with_triton_kernels_decodes_the_same_tokens(tiny_model_dir):
    """Qwen3 family (per-head q/k norm, GQA): AR and n-gram speculative decoding of a ragged batch, the Triton
    kernels against the default ones, token for token; on CPU the recipe's compile flag must not compile."""
    # one layer: every layer calls the same slots, and each interpreted kernel call costs time (the same model as
    # test_fused_layer_matches_the_modular_layer[qwen3]'s)
    loaded = load(str(tiny_model_dir("qwen3", num_hidden_layers=1)), "fp32", "cpu")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() * reps for n, reps in ((7, 3), (5, 1))]
    for recipe in ({}, {"drafter": {"kind": "ngram"}, "k": 4}):
        triton_engine = Engine(loaded, parse({**recipe, "compile": True, "kernels": TRITON_KERNELS}))
        decoder = triton_engine.decoder
        assert decoder.layer_fn is Block.forward and decoder._finish is _finish_step
        assert decoder.ops.attention is triton_attention.attention and decoder.ops.accept is triton_accept.accept
        want = Engine(loaded, parse(recipe)).generate(prompts, 8, ignore_eos=True)
        got = triton_engine.generate(prompts, 8, ignore_eos=True)
        assert [r.tokens for r in got] == [r.tokens for r in want], recipe
        assert [r.accepted for r in got] == [r.accepted for r in want], recipe


# -- the fused layer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "llama3rope", "mistral", "qwen2", "qwen3"])
def test_fused_layer_matches_the_modular_layer(tiny_model_dir, family):
    """A layer of each tiny family (GQA; q/k/v biases; llama3 rope scaling; a sliding window shorter than the
    positions; Qwen3's per-head q/k norm), at one token, one row of five (a verification step) and a ragged batch of
    three rows of two: outputs and cache writes equal the modular layer's to fp32 rounding."""
    # One layer: check() tests each layer apart on fresh inputs and caches, and a family's layers differ only in
    # their weights, while every interpreted layer costs seconds (qwen3's four took 32 s, one 8 s)
    loaded = load(str(tiny_model_dir(family, num_hidden_layers=1)), "fp32", "cpu")
    assert triton_fused_layer.check(loaded.model, Block.forward) < 2e-5


def test_fused_layer_with_widths_that_are_not_powers_of_two(tiny_model_dir):
    """Hidden 48 and intermediate 96 (as SmolLM2's 576 and 1536): tiles padded to powers of two, masked, agree with
    the modular layer."""
    # one layer: check() tests each layer apart, and the widths are every layer's (two layers took twice as long)
    loaded = load(str(tiny_model_dir("llama", hidden_size=48, intermediate_size=96, num_attention_heads=3,
                                     num_key_value_heads=1, num_hidden_layers=1)), "fp32", "cpu")
    assert triton_fused_layer.check(loaded.model, Block.forward) < 2e-5


def test_fused_layer_on_a_cache_that_is_not_a_power_of_two(tiny_model_dir):
    """A 640-slot cache (engine/decode.cache_length's steps between powers of two): three splits of 256 in the
    interpreter, the last one short, merged with a power-of-two stride; rows at positions in every split agree with
    the modular layer."""
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    assert triton_fused_layer.attention_splits(640, 1, torch.device("cpu")) == (3, 256)
    assert triton_fused_layer.check(loaded.model, Block.forward, batch_tokens=((4, 1), (2, 3)), seed=1,
                                    n_slots=640) < 2e-5



def _fused_attention_outputs(model, cache, positions):
    """The fused layer's and the modular layer's outputs (x, delta) for one token a row at `positions` over `cache`
    (copied: each layer writes its token's slot)."""
    cfg, B = model.cfg, positions.shape[0]
    g = torch.Generator().manual_seed(5)
    x, delta = (torch.randn(B, 1, cfg.hidden_size, generator=g) for _ in range(2))
    n_slots = cache.shape[3]
    model._ensure_rope(n_slots)
    cos, sin = (t[positions].unsqueeze(2) for t in model._rope)
    rows = torch.arange(B)[:, None].contiguous()
    masks = triton_fused_layer.attention_masks(cfg, positions, n_slots)
    block = model.layers[0]
    fused = triton_fused_layer.fused_layer(block, x, delta, cos, sin, cache.clone(), rows, positions, masks,
                                           model.default_ops)
    modular = Block.forward(block, x, delta, cos, sin, cache.clone(), rows, positions, masks, model.default_ops)
    return fused, modular


def test_fused_attention_merges_a_few_splits_at_a_time(tiny_model_dir, monkeypatch):
    """The merge of a token's attention splits, two at a time (ATTENTION_MERGE_SPLITS = 2; the GPU's 16): in a
    1,280-slot cache (five splits of 256 in the interpreter, partials at a stride of 8) tokens in the first, third
    and fifth split merge in one, two and three rounds and agree with the modular layer; and a token within the first
    two splits gets bit for bit its output in a 512-slot cache (two splits, merged at once), whatever the slots past
    them hold: the merge follows the position, not the cache's length."""
    monkeypatch.setattr(triton_fused_layer, "ATTENTION_MERGE_SPLITS", 2)
    assert triton_fused_layer.attention_splits(1280, 1, torch.device("cpu")) == (5, 256)
    assert triton_fused_layer.merge_width(8) == 2 and triton_fused_layer.merge_width(1) == 1
    model = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu").model
    cfg = model.cfg
    g = torch.Generator().manual_seed(4)
    long = torch.randn(2, 3, cfg.n_kv_heads, 1280, cfg.head_dim, generator=g)
    fused, modular = _fused_attention_outputs(model, long, torch.tensor([[100], [700], [1200]]))
    for got, want in zip(fused, modular):
        assert float((got - want).abs().max() / want.abs().max()) < 2e-5
    positions = torch.tensor([[3], [300], [511]])
    in_long, _ = _fused_attention_outputs(model, long, positions)
    in_short, _ = _fused_attention_outputs(model, long[:, :, :, :512].contiguous(), positions)
    for a, b in zip(in_long, in_short):
        assert torch.equal(a, b)

def test_fused_attention_grid_padded_past_the_cache_gives_the_same_output(tiny_model_dir, monkeypatch):
    """A grid of more splits than the cache has (benchmarks/experiments/cache_length.py `--pad-splits`: whether the
    grid's size is what a longer cache changes): the splits that start past the cache return at once, and every
    token's output is bit for bit the shipped grid's."""
    model = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu").model
    cfg = model.cfg
    kv = torch.randn(2, 3, cfg.n_kv_heads, 512, cfg.head_dim, generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[3], [300], [511]])
    shipped, _ = _fused_attention_outputs(model, kv, positions)
    splits = triton_fused_layer.attention_splits
    assert splits(512, 1, torch.device("cpu")) == (2, 256)
    monkeypatch.setattr(triton_fused_layer, "attention_splits", lambda n, t, d: (max(splits(n, t, d)[0], 4), 256))
    padded, _ = _fused_attention_outputs(model, kv, positions)
    for a, b in zip(padded, shipped):
        assert torch.equal(a, b)


def test_attention_splits_cover_the_cache_and_no_more():
    """The fused layer's attention grid on the GPU: splits of the setting's keys (a multiple of them past
    MAX_SPLITS) whose last one starts inside the cache, for the cache lengths decode.cache_length gives."""
    from specpilot.engine.decode import cache_length

    cuda = torch.device("cuda")
    for n_slots in sorted({cache_length(p, 128, k, True) for p in range(1, 8000, 7) for k in (0, 4)}):
        for tokens in (1, 64):
            splits, per = triton_fused_layer.attention_splits(n_slots, tokens, cuda)
            base = triton_fused_layer.attention_setting(tokens)["keys_per_split"]
            assert per % base == 0 and splits <= triton_fused_layer.MAX_SPLITS, (n_slots, tokens, splits, per)
            assert (splits - 1) * per < n_slots <= splits * per, (n_slots, tokens, splits, per)
    # powers of two keep the splits they had (the same sums as before)
    assert triton_fused_layer.attention_splits(512, 1, cuda) == (16, 32)
    assert triton_fused_layer.attention_splits(2048, 1, cuda) == (32, 64)
    assert triton_fused_layer.attention_splits(1024, 64, cuda) == (16, 64)


def test_fused_layer_with_tiles_given_by_role(tiny_model_dir, monkeypatch):
    """FMA_TILES sets each GEMV role's tile (rows or pairs a program, the K tile, warps) in place of the TILE_VALUES
    rule, whatever the step's tokens: tiles of K in several chunks and of several rows (the pair kernels' chunked
    norm path) agree with the modular layer, as the rule's do."""
    tiles = {"qkv": {"rows": 2, "block_k": 16, "warps": 4}, "o": {"rows": 4, "block_k": 32, "warps": 8},
             "mlp": {"rows": 4, "block_k": 16, "warps": 4}, "down": {"rows": 1, "block_k": 64, "warps": 4}}
    monkeypatch.setattr(triton_fused_layer, "FMA_TILES", tiles)
    assert [triton_fused_layer.gemv_blocks(64, 64, t, role="o") for t in (1, 5)] == [
        dict(DOT=False, BLOCK_M=1, BLOCK_N=4, BLOCK_K=32, num_warps=8)] * 2
    assert triton_fused_layer.gemv_blocks(64, 16, 1, role="down")["BLOCK_K"] == 16  # never past K's power of two
    assert triton_fused_layer.gemv_blocks(64, 64, 1)["num_warps"] == 4  # no role: the rule
    # 12-bit weights take their own table (FMA_TILES_12), its rows halved until there are enough programs
    monkeypatch.setattr(triton_fused_layer, "FMA_TILES_12", {"qkv": {"rows": 4, "block_k": 1024, "warps": 4}})
    assert triton_fused_layer.gemv_blocks(3072, 4096, 1, 256, pairs=True, role="qkv", w12=True) == dict(
        DOT=False, BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, num_warps=4)  # Llama-3.1-8B's q/k/v: 768 programs
    assert triton_fused_layer.gemv_blocks(480, 576, 1, 256, pairs=True, role="qkv", w12=True)["BLOCK_N"] == 1
    assert triton_fused_layer.gemv_blocks(480, 576, 1, 256, pairs=True, role="qkv")["BLOCK_N"] == 2  # (bf16's)
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    assert loaded.model.cfg.hidden_size > 16  # (so that the K tiles of 16 take several chunks)
    # one token and five (the tiles are the role's either way; rows side by side are the rule's test's): the
    # interpreter runs these small tiles' many programs one by one (46 s with a third case of 3 x 2 tokens)
    assert triton_fused_layer.check(loaded.model, Block.forward, batch_tokens=((1, 1), (1, 5))) < 2e-5


def test_fused_layer_reads_12bit_weights(tiny_model_dir, monkeypatch):
    """`weights.format: lossless12` on the fused layer: its GEMVs read each matrix's Packed12Linear planes (weights
    that are bf16 values, escapes above and below the exponent window, a K of 100 that pads its last group, q/k/v
    biases) and agree with the modular layer on those values, in one tile of K and in chunks, and with a row whose
    escapes outnumber those loaded with its words; a flipped exponent bit or a dropped escape is caught, so the
    planes are what it reads."""
    import dataclasses

    from specpilot.kernels.lossless12_format import to_linear_planes

    model = load(str(tiny_model_dir("qwen2", hidden_size=64, intermediate_size=100, num_hidden_layers=1)), "fp32",
                 "cpu").model
    block, g = model.layers[0], torch.Generator().manual_seed(1)
    matrices = (block.wqkv, block.wo, block.w13, block.w2)
    with torch.no_grad():
        for w in matrices:  # bf16 values, with an outlier above the window and a tiny value below it
            w.copy_(w.to(torch.bfloat16).float())
            at = torch.randperm(w.numel(), generator=g)[:2]
            w.view(-1)[at] = torch.tensor([16.0, -2.5e-9])
            w[1, 3:8] = torch.tensor([8.0, -12.0, 20.0, -24.0, 40.0])  # five escapes (above the window) in one row
    planes = tuple(to_linear_planes(w.detach().to(torch.bfloat16)) for w in matrices)
    assert all(p.exc_val.numel() >= 7 for p in planes) and planes[3].k8 * 8 > 100
    assert triton_fused_layer.check(model, Block.forward, batch_tokens=((1, 1), (3, 2)), planes=lambda b: planes) < 2e-5
    # K in tiles of 32 (4 groups): each GEMV loops over its groups (the interpreter runs programs one by one, so
    # the tiles keep many rows a program)
    tiles = {role: {"rows": 16, "block_k": 32, "warps": 4} for role in triton_fused_layer.ROLES}
    monkeypatch.setattr(triton_fused_layer, "FMA_TILES_12", tiles)
    assert triton_fused_layer.check(model, Block.forward, batch_tokens=((1, 1),), planes=lambda b: planes) < 2e-5
    monkeypatch.setattr(triton_fused_layer, "ESCAPES_AHEAD", 2)  # the five: two with the words, then two and one
    assert triton_fused_layer.check(model, Block.forward, batch_tokens=((1, 1),), planes=lambda b: planes) < 2e-5

    q = planes[2].q.clone()
    q[1, 2] ^= 0x00800000  # an exponent bit of one gate weight
    flipped = (*planes[:2], dataclasses.replace(planes[2], q=q), planes[3])
    dropped = (dataclasses.replace(planes[0], exc_val=torch.zeros_like(planes[0].exc_val)), *planes[1:])
    for wrong in (flipped, dropped):
        with pytest.raises(AssertionError):
            triton_fused_layer.check(model, Block.forward, batch_tokens=((1, 1),), planes=lambda b: wrong)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_layer_tensor_core_path(tiny_model_dir, monkeypatch, family):
    """With FMA_MAX_TOKENS lowered to 1, steps of several tokens take the tensor-core path (W_tile @ H^T) instead of
    one program per token, with the same results (Qwen2: q/k/v biases; Qwen3: per-head q/k norm over heads of 16,
    which the q/k/v GEMV's tiles no longer need whole)."""
    monkeypatch.setattr(triton_fused_layer, "FMA_MAX_TOKENS", 1)
    assert triton_fused_layer.gemv_blocks(480, 576, 5)["DOT"] and not triton_fused_layer.gemv_blocks(480, 576, 1)["DOT"]
    loaded = load(str(tiny_model_dir(family, num_hidden_layers=1)), "fp32", "cpu")
    assert triton_fused_layer.check(loaded.model, Block.forward) < 2e-5


def test_fused_layer_tensor_core_path_with_tiles_given_by_role(tiny_model_dir, monkeypatch):
    """DOT_TILES sets each GEMV role's tensor-core tile (rows a program, the K tile, warps, pipeline depth, K split
    over programs) where a step takes that path; a key left out keeps the rule's. K tiles of 16 (the norm's chunked
    passes, several iterations of the pipelined loop), 32 rows a program, all of K in one tile, and K in shares
    whose partials the last program adds, agree with the modular layer."""
    F = triton_fused_layer
    tiles = {"qkv": {"rows": 32, "block_k": 16, "warps": 2, "stages": 2}, "o": {"block_k": 1024, "warps": 8},
             "mlp": {"rows": 16, "block_k": 16, "stages": 1}, "down": {"rows": 16, "block_k": 32, "warps": 4}}
    monkeypatch.setattr(F, "DOT_TILES", tiles)
    monkeypatch.setattr(F, "FMA_MAX_TOKENS", 1)
    assert F.gemv_blocks(480, 576, 5, pairs=True, role="qkv") == dict(
        DOT=True, BLOCK_M=F.DOT_TOKENS, BLOCK_N=32, BLOCK_K=16, num_warps=2, num_stages=2)
    assert F.gemv_blocks(576, 576, 5, role="o") == dict(DOT=True, BLOCK_M=F.DOT_TOKENS, BLOCK_N=F.DOT_ROWS,
                                                         BLOCK_K=1024, num_warps=8)  # no stages: Triton's own
    assert F.gemv_blocks(576, 64, 5, role="o")["BLOCK_K"] == 64  # never past K's power of two
    assert F.gemv_blocks(576, 576, 1, role="o")["DOT"] is False  # one token: the FMA path, its own table
    assert F.gemv_blocks(576, 576, 5) == dict(DOT=True, BLOCK_M=F.DOT_TOKENS, BLOCK_N=F.DOT_ROWS, BLOCK_K=F.DOT_K,
                                              num_warps=4)  # no role (a head's LM head): the rule
    monkeypatch.setattr(F, "DOT_TILES", {})  # none given: the rule for every role
    assert F.gemv_blocks(480, 576, 5, pairs=True, role="qkv") == dict(
        DOT=True, BLOCK_M=F.DOT_TOKENS, BLOCK_N=F.DOT_ROWS, BLOCK_K=F.DOT_K // 2, num_warps=4)
    monkeypatch.setattr(F, "DOT_TILES", tiles)
    assert F._stages(F.gemv_blocks(480, 576, 5, pairs=True, role="qkv")) == {"num_stages": 2}
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    assert loaded.model.cfg.hidden_size > 16 and loaded.model.cfg.hidden_size <= 1024  # chunks, and one tile for o
    assert F.check(loaded.model, Block.forward, batch_tokens=((1, 5), (2, 3))) < 2e-5
    # split K: shares of whole K tiles, as many as K has tiles at most, in `_gemv` (o, down) and in the pair kernels
    # (q/k/v with RoPE and the cache write, gate/up with SwiGLU after the last program's sum)
    split = {"o": {"block_k": 16, "split": 3}, "down": {"block_k": 32, "split": 4},
             "qkv": {"block_k": 16, "split": 2}, "mlp": {"block_k": 16, "split": 4}}
    monkeypatch.setattr(F, "DOT_TILES", split)
    cpu = torch.device("cpu")
    assert F.gemv_blocks(64, 64, 5, role="o")["SPLIT"] == 3
    assert F.gemv_blocks(96, 64, 5, pairs=True, role="qkv")["SPLIT"] == 2
    grid, args = F._split_k(F.gemv_blocks(64, 64, 5, role="o"), 64, 64, 5, cpu)
    assert grid[2] == 2 and args["k_split"] == 32 and args["SPLIT"] == 2  # 64 columns in shares of 32: two
    assert "SPLIT" not in F._tile(F.gemv_blocks(64, 64, 5, role="o"))
    grid, args = F._split_k(F.gemv_blocks(64, 16, 5, role="o"), 16, 64, 5, cpu)
    assert len(grid) == 2 and args == {}  # one K tile: nothing to split
    grid, args = F._split_k(F.gemv_blocks(96, 64, 5, pairs=True, role="qkv"), 64, 96, 5, cpu, slots=2)
    assert args["partial_ptr"].numel() == grid[0] * grid[1] * 2 * 2 * F.DOT_TOKENS * F.DOT_ROWS  # two accumulators
    down, o = F.gemv_blocks(64, 128, 5, role="down"), F.gemv_blocks(64, 64, 5, role="o")
    assert F._single(down, 128, None, F._split_k(down, 128, 64, 5, cpu)[1])  # shares of one tile: loaded first
    assert not F._single(o, 64, None, F._split_k(o, 64, 64, 5, cpu)[1])  # shares of two tiles of 16: in the loop
    mlp = F.gemv_blocks(128, 64, 5, pairs=True, role="mlp")  # (a pair kernel's shares: one tile each, the norm's
    assert F._single(mlp, 64, None, F._split_k(mlp, 64, 128, 5, cpu, slots=2)[1])  # statistics still over all K)
    assert F.check(loaded.model, Block.forward, batch_tokens=((1, 5), (2, 3))) < 2e-5
    counters = F._COUNTERS[(torch.device("cpu"), "gemv")][-1]
    assert int(counters.abs().sum()) == 0  # each block's last program reset its counter


def test_fused_layer_runs_steps_past_sixteen_tokens_in_token_blocks(tiny_model_dir, monkeypatch):
    """With the limit raised (SPECPILOT_FUSED_MAX_TOKENS), steps of more than 16 tokens run the tensor-core path in
    blocks of 16 tokens side by side: one row of 20, and two rows of 9 (a tree of 9 nodes a row), agree with the
    modular layer."""
    monkeypatch.setattr(triton_fused_layer, "MAX_TOKENS", 64)
    assert triton_fused_layer.gemv_blocks(480, 576, 40)["BLOCK_M"] == triton_fused_layer.DOT_TOKENS
    # one layer: check() tests each layer apart, and the token blocks are every layer's (two took twice as long)
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    assert triton_fused_layer.check(loaded.model, Block.forward, batch_tokens=((1, 20), (2, 9))) < 2e-5


def test_fused_layer_runs_steps_past_sixteen_tokens_in_one_token_block(tiny_model_dir, monkeypatch):
    """With a tile's "tokens" (DOT_TILES), a step of more than 16 tokens runs in one block of up to that many tokens
    a program (each weight tile read once), its K tile shrunk in proportion; the layer still agrees with the modular
    one, for one row of 20 tokens and two rows of 9 in blocks of 32, and one row of 40 in a block of 64."""
    monkeypatch.setattr(triton_fused_layer, "MAX_TOKENS", 64)
    tiles = {role: {**tile, "tokens": 32} for role, tile in triton_fused_layer.DOT_TILES.items()}
    monkeypatch.setattr(triton_fused_layer, "DOT_TILES", tiles)
    F = triton_fused_layer
    assert F.gemv_blocks(480, 576, 12, role="o")["BLOCK_M"] == 16  # (16 tokens or fewer: one block of 16)
    wide = F.gemv_blocks(480, 576, 20, role="o")
    assert wide["BLOCK_M"] == 32 and wide["BLOCK_K"] == tiles["o"]["block_k"] // 2
    assert F.gemv_blocks(480, 576, 40, role="o")["BLOCK_M"] == 32  # (at most the tile's tokens: two blocks)
    assert F.gemv_blocks(480, 576, 20, role="down")["BLOCK_M"] == 32
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    assert F.check(loaded.model, Block.forward, batch_tokens=((1, 20), (2, 9))) < 2e-5
    # blocks of 64: 40 tokens in one (K tiles a quarter of the shipped ones)
    monkeypatch.setattr(F, "DOT_TILES", {role: {**tile, "tokens": 64} for role, tile in tiles.items()})
    assert F.gemv_blocks(480, 576, 40, role="down")["BLOCK_K"] == max(16, tiles["down"]["block_k"] // 4)
    assert F.check(loaded.model, Block.forward, batch_tokens=((1, 40),)) < 2e-5


def _five_token_step(model, first: int, seed: int):
    """A verification step's inputs for one layer of `model`: one row of five tokens at positions first..first + 4
    (their RoPE tables), random x and delta, and a random 64-slot cache."""
    cfg, g = model.cfg, torch.Generator().manual_seed(seed)
    model._ensure_rope(64)
    positions = (first + torch.arange(5))[None]
    cos, sin = (t[positions].unsqueeze(2) for t in model._rope)
    x, delta = torch.randn(2, 1, 5, cfg.hidden_size, generator=g)
    cache = torch.randn(2, 1, cfg.n_kv_heads, 64, cfg.head_dim, generator=g)
    return positions, cos, sin, x, delta, cache


@pytest.mark.parametrize("fma_max_tokens,family", [(8, "llama"), (1, "llama"), (8, "qwen3")])
def test_fused_layer_skips_dead_tokens(tiny_model_dir, monkeypatch, fma_max_tokens, family):
    """A verification step of five tokens with two live (`live`): the live tokens' outputs, cache writes and final
    norm are bit for bit those of the full step. On the FMA path every kernel skips the dead tokens, so their cache
    slots are left as they were; on the tensor-core path none does: the whole step is the full step's. (Qwen3: the
    q/k norm's kernel skips them too.)"""
    monkeypatch.setattr(triton_fused_layer, "FMA_MAX_TOKENS", fma_max_tokens)
    model = load(str(tiny_model_dir(family)), "fp32", "cpu").model
    cfg = model.cfg
    positions, cos, sin, x, delta, cache = _five_token_step(model, first=20, seed=3)
    live = torch.tensor([1, 1, 0, 0, 0], dtype=torch.int32)
    args = (x, delta, cos, sin)
    rest = (torch.zeros(1, 5, dtype=torch.long), positions, {}, model.default_ops)
    block = model.layers[0]
    full_cache, part_cache = cache.clone(), cache.clone()
    full = triton_fused_layer.fused_layer(block, *args, full_cache, *rest)
    part = triton_fused_layer.fused_layer(block, *args, part_cache, *rest, live=live)
    for a, b in zip(part, full):
        assert torch.equal(a[:, :2], b[:, :2])
    assert torch.equal(part_cache[..., 20:22, :], full_cache[..., 20:22, :])
    assert not torch.equal(full_cache[..., 22:25, :], cache[..., 22:25, :])  # the full step writes them
    norm_full = triton_fused_layer.final_norm(*full, model.norm, cfg.rms_eps)
    norm_part = triton_fused_layer.final_norm(*full, model.norm, cfg.rms_eps, live)
    assert torch.equal(norm_part[:, :2], norm_full[:, :2])
    if fma_max_tokens >= 5:  # FMA path: the dead tokens' cache slots untouched
        assert torch.equal(part_cache[..., 22:25, :], cache[..., 22:25, :])
    else:  # tensor cores: nothing skipped, everything computed
        assert torch.equal(part_cache, full_cache) and torch.equal(norm_part, norm_full)
        assert all(torch.equal(a, b) for a, b in zip(part, full))


class _PoisonedTorch:
    """torch, but every empty()/empty_like() is NaN-filled: what a CUDA graph's pool may hold where a kernel reads a
    buffer that nothing wrote."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))

    @staticmethod
    def empty_like(*args, **kwargs):
        return torch.empty_like(*args, **kwargs).fill_(float("nan"))


def test_fused_layer_dead_tokens_leave_nothing_unwritten_behind(tiny_model_dir, monkeypatch):
    """Issue #20's garbage tokens at B = 2-8 on the H200: on the tensor-core path the attention kernel skipped dead
    tokens while the GEMVs did not, so the GEMVs read the skipped tokens' never-written attention output, and the
    next layer wrote K/V computed from it (NaN) into the cache, where the modular layer's masked attention multiplied
    it by zero. With every fresh buffer NaN (a pool's leftovers), two layers of a five-token step with two live
    tokens, both paths: every value the step leaves, in the cache included, is finite."""
    monkeypatch.setattr(triton_fused_layer, "torch", _PoisonedTorch())
    model = load(str(tiny_model_dir("llama")), "fp32", "cpu").model
    positions, cos, sin, x, delta, cache = _five_token_step(model, first=20, seed=3)
    live = torch.tensor([1, 1, 0, 0, 0], dtype=torch.int32)
    rows = torch.zeros(1, 5, dtype=torch.long)
    for fma_max_tokens in (8, 1):
        monkeypatch.setattr(triton_fused_layer, "FMA_MAX_TOKENS", fma_max_tokens)
        kv = cache.clone()
        h, d = x, delta
        for block in model.layers[:2]:
            h, d = triton_fused_layer.fused_layer(block, h, d, cos, sin, kv, rows, positions, {}, model.default_ops,
                                                  live=live)
        assert torch.isfinite(kv).all(), fma_max_tokens
        assert torch.isfinite(h[:, :2]).all() and torch.isfinite(d[:, :2]).all()
        if fma_max_tokens == 1:  # tensor cores: nothing skipped, every output computed
            assert torch.isfinite(h).all() and torch.isfinite(d).all()


def test_fused_layer_step_computes_what_one_token_steps_compute(tiny_model_dir):
    """On the FMA path a step of five tokens runs each token through the program a one-token step runs, with the same
    tile (FMA_TILES_AS_ONE_TOKEN) and attention splits: its outputs and cache writes are bit for bit those of five
    one-token steps run in order (what AR decoding computes), so verification cannot change a token by rounding
    differently. (The interpreter sums a tile's rows in one order whatever the tile; on the GPU the tile fixes it.)
    Qwen2: q/k/v biases."""
    model = load(str(tiny_model_dir("qwen2")), "fp32", "cpu").model
    cfg = model.cfg
    positions, cos, sin, x, delta, cache = _five_token_step(model, first=30, seed=4)
    block, ops = model.layers[0], model.default_ops
    for rows, k in ((cfg.hidden_size, cfg.hidden_size), (cfg.intermediate_size, cfg.hidden_size)):
        for width in (1, 256):  # the interpreter's and the GPU's least number of programs
            assert (triton_fused_layer.gemv_blocks(rows, k, 5, width)
                    == triton_fused_layer.gemv_blocks(rows, k, 1, width)), (rows, k, width)
    step_cache, token_cache = cache.clone(), cache.clone()
    step = triton_fused_layer.fused_layer(block, x, delta, cos, sin, step_cache, torch.zeros(1, 5, dtype=torch.long),
                                          positions, {}, ops)
    for t in range(5):
        one = slice(t, t + 1)
        out = triton_fused_layer.fused_layer(block, x[:, one], delta[:, one], cos[:, one], sin[:, one], token_cache,
                                             torch.zeros(1, 1, dtype=torch.long), positions[:, one], {}, ops)
        for a, b in zip(out, step):
            assert torch.equal(a, b[:, one]), t
    assert torch.equal(token_cache, step_cache)


def test_fused_layer_refuses_what_it_does_not_run(tiny_model_dir):
    block = load(str(tiny_model_dir("llama")), "fp32", "cpu").model.layers[0]
    cpu = torch.device("cpu")
    limit = triton_fused_layer.MAX_TOKENS
    assert limit == 32 or os.environ.get("SPECPILOT_FUSED_MAX_TOKENS")  # (the default)
    assert triton_fused_layer.supports(block, limit, cpu) is None
    assert f"{limit + 1} tokens" in triton_fused_layer.supports(block, limit + 1, cpu)


def test_fused_layer_leaves_multi_token_steps_of_layers_past_the_l2(tiny_model_dir, monkeypatch):
    """A layer whose weights outgrow the GPU's L2 runs only one-token steps fused (its token programs would each read
    the weights from DRAM); one that fits runs them all. The device's L2 size is set, as a GPU would report it."""
    block = load(str(tiny_model_dir("llama")), "fp32", "cpu").model.layers[0]
    gpu = torch.device("cuda")
    weights = sum(w.numel() * w.element_size() for w in (block.wqkv, block.wo, block.w13, block.w2))
    monkeypatch.setitem(triton_fused_layer._L2_BYTES, gpu, weights - 1)
    assert triton_fused_layer.supports(block, 1, gpu) is None
    assert "L2" in triton_fused_layer.supports(block, 2, gpu)
    monkeypatch.setitem(triton_fused_layer._L2_BYTES, gpu, weights)
    assert triton_fused_layer.supports(block, 2, gpu) is None


def test_sampled_decoding_on_the_fused_layer_follows_its_seed(tiny_model_dir):
    """Sampled steps on the fused layer (on the CPU without a graph), as train-drafter's answers run on CUDA: every step
    takes the fused layer, the tokens are the seed's (twice the same), and another seed draws others."""
    from specpilot.engine.sampling import SamplingParams

    # one layer: the sampling is after the last layer, and each interpreted layer call costs seconds
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    engine = Engine(loaded, parse({"layer": "fused", "compile": False}))
    rows = [[5, 6, 7, 8, 9], [3, 4]]
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    calls = []
    real = triton_fused_layer.fused_layer
    triton_fused_layer.fused_layer = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        first = [r.tokens for r in engine.generate(rows, 6, sampling, seed=3, ignore_eos=True)]
    finally:
        triton_fused_layer.fused_layer = real
    assert calls and all(len(t) == 6 for t in first)
    assert [r.tokens for r in engine.generate(rows, 6, sampling, seed=3, ignore_eos=True)] == first
    assert [r.tokens for r in engine.generate(rows, 6, sampling, seed=4, ignore_eos=True)] != first


def test_engine_with_the_fused_layer_decodes_the_same_tokens(tiny_model_dir):
    """Llama family: AR, and n-gram speculation at k = 4 for one row (5 tokens a step: FMA path, dead tokens skipped)
    and over a ragged batch of three (15 tokens: tensor cores), and at k = 12 (39 tokens: the modular fallback),
    token for token and acceptance for acceptance with the modular layer."""
    loaded = load(str(tiny_model_dir("llama")), "fp32", "cpu")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() * reps for n, reps in ((6, 3), (4, 1), (9, 2))]
    calls = []
    real = triton_fused_layer.fused_layer
    for recipe, rows in (({}, prompts[:1]), ({"drafter": {"kind": "ngram"}, "k": 4}, prompts[:1]),
                         ({"drafter": {"kind": "ngram"}, "k": 4}, prompts),
                         ({"drafter": {"kind": "ngram"}, "k": 12}, prompts)):
        fused = Engine(loaded, parse({**recipe, "layer": "fused"}))
        want = Engine(loaded, parse(recipe)).generate(rows, 6, ignore_eos=True)
        calls.clear()
        triton_fused_layer.fused_layer = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        try:
            got = fused.generate(rows, 6, ignore_eos=True)
        finally:
            triton_fused_layer.fused_layer = real
        assert [r.tokens for r in got] == [r.tokens for r in want], recipe
        assert [r.accepted for r in got] == [r.accepted for r in want], recipe
        assert bool(calls) == (recipe.get("k", 0) < 12), recipe  # fused steps ran, or the modular fallback did


def test_layer_outputs_a_head_reads_come_from_the_next_layers_first_kernel(tiny_model_dir, monkeypatch):
    """Transformer.forward(aux_layers) on the fused layer: the output of a named layer that another layer follows is
    stored by that layer's first kernel (`resid_out`, the input residual it stores anyway), so no add of its own runs;
    the last layer's, and a layer named twice, still get one. The states and logits are the modular layer's: one
    token, a step of several rows, and a prefill too long for the fused layer (its fallback adds into the slice)."""
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=3)), "fp32", "cpu")
    model = loaded.model
    fused = triton_fused_layer.layer_function(Block.forward)
    adds = []
    real_add = torch.add
    monkeypatch.setattr(torch, "add", lambda *a, **kw: adds.append(1) or real_add(*a, **kw))
    g = torch.Generator().manual_seed(2)
    too_long = kernels.FUSED_LAYER_MAX_TOKENS + 1
    for named, added in (((1, 0, 2), 1), ((1, 1, 0), 2)):  # (layer 2 is the last; layer 1 named twice)
        for B, T in ((1, 1), (3, 2), (1, too_long)):
            tokens = torch.randint(0, 256, (B, T), generator=g)
            positions = torch.arange(T)[None].expand(B, T) + 3
            runs = []
            for layer_fn in (None, fused):
                adds.clear()
                with torch.no_grad():
                    runs.append(model(tokens, positions, model.new_cache(B, 64), layer_fn=layer_fn,
                                      aux_layers=named))
                if layer_fn is fused and T < too_long:
                    assert len(adds) == added, (named, B, T, len(adds))
            (want_logits, want), (got_logits, got) = runs
            for mine, theirs in ((got, want), (got_logits, want_logits)):  # (check()'s bound: fp32 rounding)
                assert (mine - theirs).abs().max() <= 2e-5 * theirs.abs().max(), (named, B, T)


def test_engine_with_the_fused_layer_on_12bit_weights_decodes_the_ar_tokens(tiny_model_dir, monkeypatch):
    """`layer: fused` with `weights.format: lossless12` (a bf16 target): the engine hands the layer its 12-bit planes,
    its steps read them (AR, and n-gram verification of 5 tokens on the FMA path, dead tokens skipped), and the
    greedy tokens are the bf16 modular AR's; a step of 9 tokens runs the modular layer on the 12-bit linear slot."""
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1, intermediate_size=100)), "bf16", "cpu")
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 256, (6,), generator=g).tolist() * 3]
    want = Engine(loaded, parse({})).generate(rows, 5, ignore_eos=True)
    real, read = triton_fused_layer.fused_layer, []
    monkeypatch.setattr(triton_fused_layer, "fused_layer", lambda *a, **kw: read.append(kw["weights12"] is not None)
                        or real(*a, **kw))
    twelve = {"layer": "fused", "weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}}
    for recipe in ({}, {"drafter": {"kind": "ngram"}, "k": 4}, {"drafter": {"kind": "ngram"}, "k": 8}):
        read.clear()
        got = Engine(loaded, parse({**recipe, **twelve})).generate(rows, 5, ignore_eos=True)
        assert [r.tokens for r in got] == [r.tokens for r in want], recipe
        assert (read and all(read)) if recipe.get("k", 0) < 8 else not read, recipe
    # a separate draft model runs the same layer function on weights that have no 12-bit planes: read natively
    draft = str(tiny_model_dir("llama", seed=1234, num_hidden_layers=1))
    read.clear()
    got = Engine(loaded, parse({"drafter": {"kind": "model", "model": draft}, "k": 2, **twelve})).generate(
        rows, 5, ignore_eos=True)
    assert [r.tokens for r in got] == [r.tokens for r in want] and True in read and False in read


def test_fused_layer_benchmark_runs_steps_of_several_rows(tiny_model_dir, monkeypatch):
    """`benchmark(batch=2)` (fused_tokens --batch: issue #21's verify time against N at B > 1) builds a step of two
    rows of T tokens each, in their own cache rows, and runs both layers on it: here with the timer replaced by one
    call (the interpreter times nothing), one row a T."""
    import triton.testing

    monkeypatch.setattr(triton_fused_layer, "require_gpu_compiled", lambda fn: None)
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn: calls.append(fn()) or 1.0)
    model = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu").model
    rows = triton_fused_layer.benchmark(model, Block.forward, tokens=(1, 3), n_slots=64, filled=20, batch=2)
    assert [(r["batch"], r["tokens"]) for r in rows] == [(2, 1), (2, 3)]
    assert len(calls) == 2 + 2  # the modular layer and the fused layer once a T

    # each tile size its own fused timing, at that tile (gemv_blocks reads it), and the default put back
    seen = []
    monkeypatch.setattr(triton_fused_layer, "fused_layer", lambda *a, **k: (
        seen.append(triton_fused_layer.gemv_blocks(8, 64, 1, min_programs=1)["BLOCK_N"]), a[1:3])[1])
    rows = triton_fused_layer.benchmark(model, Block.forward, tokens=(1,), n_slots=64, filled=20,
                                        tile_values=(None, 256))
    assert [r["tile_values"] for r in rows] == [triton_fused_layer.TILE_VALUES, 256]
    assert seen[-1] == 4 and triton_fused_layer.TILE_VALUES == 4096  # 256 values of K = 64: 4 rows a program

    # each DOT_PDL setting its own timing, the layer called under it, the default put back
    shipped = triton_fused_layer.DOT_PDL
    monkeypatch.setattr(triton_fused_layer, "fused_layer", lambda *a, **k: (
        seen.append(triton_fused_layer.DOT_PDL), a[1:3])[1])
    seen.clear()
    rows = triton_fused_layer.benchmark(model, None, tokens=(8,), n_slots=64, filled=20, dot_pdl=(False, True))
    assert [r["dot_pdl"] for r in rows] == [False, True] and seen == [False, False, True, True]
    assert triton_fused_layer.DOT_PDL is shipped
