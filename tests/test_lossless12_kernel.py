"""The fused 12-bit linear kernel (kernels/lossless12_linear.py) under the Triton interpreter, its layout and arithmetic
decode (kernels/lossless12_format.py: `to_linear_planes`, `decode_linear_weight`), and the engine with
`weights.format = "lossless12"`: same tokens as native bf16, and a pass through the token-forcing gate on
SmolLM2-135M (CPU)."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from specpilot.engine.errors import SpecPilotError
from specpilot.engine.recipe import RecipeError, load_recipe, parse
from specpilot.kernels import lossless12_linear as L  # TRITON_INTERPRET=1 was set by conftest on a CPU machine
from specpilot.kernels.lossless12_format import decode, decode_linear_weight, encode, linear_bits, to_linear_planes

from test_lossless12 import SPECIAL_BITS, _bf16


def _weight(n: int, k: int, seed: int, escapes_every: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    if escapes_every:  # cycle through 100 large exponents, each too rare to enter the 15-entry table
        flat = w.view(-1)[::escapes_every]
        exps = torch.arange(flat.numel()) % 100 + 140
        flat.copy_((2.0 ** (exps - 127).double() * torch.where(exps % 2 == 0, 1.5, -1.25)).to(torch.bfloat16))
    return w


def _reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("m,n,k,every,bias", [
    (1, 40, 64, 0, False),      # GEMV, no escapes
    (1, 37, 96, 5, True),       # GEMV, N not a multiple of BLOCK_N, many escapes a row (> one chunk), bias
    (3, 50, 128, 7, False),     # small-M GEMM (verification), dense escapes
    (20, 64, 64, 29, True),     # M over one BLOCK_M of 16
])
def test_fused_matches_torch_on_decoded_weights(m, n, k, every, bias):
    w = _weight(n, k, seed=m * 1000 + n, escapes_every=every)
    p = to_linear_planes(w)
    assert p.exc_row.numel() >= 0.8 * (n * k // every if every else 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, m, k, generator=g)  # a leading batch dimension is flattened
    b = torch.randn(n, generator=g) if bias else None
    got = L.linear_fused(x, p, b)
    ref = _reference(x, w, b)
    assert got.shape == (2, m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)  # fp32 sums over values up to 2^112


def test_gemv_reads_bf16_x_as_pairs():
    """A bf16 x takes the GEMV's int32-pair path (what the engine runs on the GPU); output in bf16."""
    w = _weight(37, 96, seed=9, escapes_every=5)
    p = to_linear_planes(w)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = L.linear_fused(x, p)
    assert got.dtype == torch.bfloat16
    ref = _reference(x, w)
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_fused_with_special_values():
    """±0, subnormals, ±inf: the escape path carries them exactly (NaN would poison any comparison)."""
    specials = [b for b in SPECIAL_BITS if (b & 0x7F80) != 0x7F80 or (b & 0x7F) == 0]  # drop NaNs, keep ±inf
    w = _weight(8, 64, seed=3)
    flat = w.view(-1)
    flat[: len(specials)] = _bf16(specials)
    p = to_linear_planes(w)
    x = torch.rand(1, 64) + 0.5
    got = L.linear_fused(x, p)
    ref = F.linear(x, w.float())
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-5, atol=1e-6)


def test_torch_decode_is_bit_exact_with_nans():
    w = _weight(16, 32, seed=4, escapes_every=11)
    w.view(-1)[: len(SPECIAL_BITS)] = _bf16(SPECIAL_BITS)
    got = decode_linear_weight(to_linear_planes(w))
    assert torch.equal(got.view(torch.int16), w.view(torch.int16))


def _bits_to_bf16(b: torch.Tensor) -> torch.Tensor:
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def test_arithmetic_decode_is_exact_for_every_window():
    """What the kernel computes for a weight, (sign << 31 | c << 23 | mantissa << 16) as fp32 times 2^(base-1)
    (times the rest of the scale above base 128), is the bf16 value with exponent base + c - 1, for every window
    base 1..240, every code, sign and mantissa; c = 0 gives a signed zero."""
    base = torch.arange(1, 241).view(-1, 1, 1, 1)
    c = torch.arange(16).view(1, -1, 1, 1)
    s = torch.tensor([0, 1]).view(1, 1, -1, 1)
    m = torch.arange(128).view(1, 1, 1, -1)
    f = ((s << 31) | (c << 23) | (m << 16)).to(torch.int32)
    f = torch.where(c == 0, (s << 31).to(torch.int32), f).expand(240, 16, 2, 128)     # zeros: mantissa 0
    scale_w = (2.0 ** torch.clamp(base - 1, max=127)).float()
    scale_out = (2.0 ** (base - 1 - torch.clamp(base - 1, max=127))).float()
    got = f.view(torch.float32) * scale_w * scale_out
    e = torch.where(c == 0, 0, base + c - 1)
    want = torch.where(c == 0, s << 15, (s << 15) | (e << 7) | m).expand(240, 16, 2, 128)
    assert torch.equal(got.to(torch.bfloat16).view(torch.int16), _bits_to_bf16(want.to(torch.int32)).view(torch.int16))
    assert torch.equal((got.view(torch.int32) & 0xFFFF), torch.zeros_like(f))           # exactly bf16 values


@pytest.mark.parametrize("base", [1, 2, 40, 41, 42, 109, 110, 128, 167, 168, 169, 240])
def test_x_scales_split_the_window_scale(base):
    """The GEMV's (x_scale, sum_scale): powers of two multiplying to 2^(base - 1), each an fp32 normal number, x's
    share 2^min(base - 1, 40) unless the rest would not fit fp32."""
    p = to_linear_planes(torch.zeros(2, 8, dtype=torch.bfloat16))
    p.base = base
    x_scale, sum_scale = p.x_scales
    assert x_scale * sum_scale == 2.0 ** (base - 1) == p.scale_w * p.scale_out
    for v in (x_scale, sum_scale):
        assert 1.0 <= v <= 2.0 ** 127 and torch.frexp(torch.tensor(v, dtype=torch.float64)).mantissa == 0.5
    assert x_scale == 2.0 ** max(min(base - 1, 40), base - 1 - 127)


@pytest.mark.parametrize("window", [2.0 ** -8, 2.0 ** 60])
def test_gemv_single_products_are_exact_over_a_wide_range_of_x(window):
    """With the scale on x, each product f * (x * x_scale) * sum_scale must be w * x rounded once: x one-hot at
    +-2^e for e from -40 to 60 (and an escape's column) gives exactly w[:, col] * x, bit for bit, for a window of
    small weights (base 110: x_scale 2^40) and one of large weights (base > 128)."""
    w = (torch.randn(24, 200, generator=torch.Generator().manual_seed(5)) * window).to(torch.bfloat16)
    w[3, 17] = 2.0 ** 100 if window < 1 else 2.0 ** -100           # an escape, far outside the window
    p = to_linear_planes(w)
    assert 17 in p.exc_col.tolist()
    for col in (0, 17, 101, 199):
        for e in (-40, -7, 0, 13, 60):
            x = torch.zeros(1, 200)
            x[0, col] = -(2.0 ** e) if e % 2 else 2.0 ** e
            want = (w[:, col].double() * x[0, col].double()).float()     # exact: 8 significant bits times 2^e
            assert torch.equal(L.linear_fused(x, p)[0], want), (col, e)


@pytest.mark.parametrize("shape", [(5, 13107), (13107, 5), (3, 21845), (1, 65535)])
def test_linear_layout_round_trips_every_bit_pattern(shape):
    """Every bf16 bit pattern but one, laid out for the kernel in several shapes (K a multiple of 8 or not: zero
    padding) and decoded with exactly the kernel's shifts, masks and scale: bit-exact, NaN payloads included."""
    w = _bf16(torch.randperm(65536, generator=torch.Generator().manual_seed(0))[:65535]).reshape(shape)
    p = to_linear_planes(w)
    assert p.q.dtype == torch.int32 and p.q.shape == (shape[0], 3 * -(-shape[1] // 8)) and not p.reencoded
    assert torch.equal(decode_linear_weight(p).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("scale", [2.0 ** 100, 2.0 ** -124, 0.02, 3.0])
def test_linear_layout_extreme_windows(scale):
    """Windows at both ends (base > 128 uses scale_out, base 1 sits next to the subnormals), with ±0, subnormals,
    ±inf and NaNs mixed in: the layout and the fused kernel agree with the weights."""
    g = torch.Generator().manual_seed(int(abs(torch.log2(torch.tensor(scale)))))
    w = (torch.randn(24, 50, generator=g) * scale).to(torch.bfloat16)
    flat = w.view(-1)
    flat[: len(SPECIAL_BITS)] = _bf16(SPECIAL_BITS)
    flat[200:230] = 0.0
    p = to_linear_planes(w)
    assert torch.equal(decode_linear_weight(p).view(torch.int16), w.view(torch.int16))
    if scale > 2.0 ** 64:
        assert p.base > 128 and p.scale_out > 1.0
    finite = w.clone()
    finite.view(-1)[: len(SPECIAL_BITS)] = 0.0                        # the kernel check: finite weights only
    pf = to_linear_planes(finite)
    x = torch.rand(3, 50, generator=g) + 0.5
    for xm in (x[:1], x):
        ref = _reference(xm, finite)
        torch.testing.assert_close(L.linear_fused(xm, pf).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_layout_words_hold_each_weight_at_fp32_positions():
    """linear_bits (the kernel's decode) gives sign << 31 | (code + 1) << 23 | mantissa << 16 for each of the 8 slots
    of a group, slot t of group j being column t * K8 + j; escapes and zeros have c = 0."""
    w = _weight(6, 40, seed=12, escapes_every=7)
    w.view(-1)[3] = -0.0
    p = to_linear_planes(w)
    packed = encode(w)
    k8 = p.k8
    assert k8 == 5 and p.base == packed.window_base
    f = linear_bits(p)                                                # [N, 8, K8]
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (bits >> 7) & 0xFF
    in_window = (exp >= p.base) & (exp <= p.base + 14)
    c = torch.where(in_window, exp - p.base + 1, 0)
    keep_sign = in_window | ((bits & 0x7FFF) == 0)
    s = torch.where(keep_sign, bits >> 15, 0)
    m = torch.where(in_window, bits & 0x7F, 0)
    want = ((s << 31) | (c << 23) | (m << 16)).to(torch.int32)        # [N, K]
    cols = (torch.arange(8).view(8, 1) * k8 + torch.arange(k8).view(1, k8))
    assert torch.equal(f, want[:, cols])
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16))


def test_top15_packed_is_reencoded_explicitly():
    """A Packed12 whose table is not a window cannot use the arithmetic decode: to_linear_planes decodes and
    re-encodes it with the window (and says so); a window Packed12 is used as it is."""
    w = _weight(20, 48, seed=13)
    w.view(-1)[::3] = 2.0 ** 30                                       # frequent outlier exponent: a gap in the top 15
    top = encode(w, "top15")
    assert top.window_base is None
    p = to_linear_planes(top)
    assert p.reencoded and torch.equal(decode_linear_weight(p).view(torch.int16), w.view(torch.int16))
    q = to_linear_planes(encode(w))
    assert not q.reencoded and torch.equal(q.q, p.q)


# (M, N, K, config): every mask combination (N and K multiples of the tile or not, K not a multiple of 8), the
# register prefetch on and off, split-K with an uneven last chunk, a K of one tile, both GEMM operand orders, one
# block of rows and several.
CONFIGS = [
    (1, 32, 512, dict(BLOCK_N=8, BLOCK_K8=16, SPLIT_K=1, PREFETCH=1, num_warps=4)),
    (1, 37, 512, dict(BLOCK_N=8, BLOCK_K8=16, SPLIT_K=3, PREFETCH=1, num_warps=4)),
    (1, 32, 300, dict(BLOCK_N=8, BLOCK_K8=16, SPLIT_K=1, PREFETCH=1, num_warps=4)),
    (1, 37, 300, dict(BLOCK_N=16, BLOCK_K8=16, SPLIT_K=2, PREFETCH=0, num_warps=4)),
    (1, 24, 1000, dict(BLOCK_N=4, BLOCK_K8=32, SPLIT_K=4, PREFETCH=0, num_warps=2)),
    (1, 40, 64, dict(BLOCK_N=16, BLOCK_K8=16, SPLIT_K=1, PREFETCH=0, num_warps=4)),       # one tile: no loop
    (1, 32, 2048, dict(BLOCK_N=16, BLOCK_K8=128, SPLIT_K=1, PREFETCH=0, num_warps=8)),    # the short-K default
    (3, 64, 512, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K8=16, SPLIT_K=1, SWAP=0, PREFETCH=1, num_warps=4)),
    (5, 40, 300, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K8=16, SPLIT_K=3, SWAP=1, PREFETCH=1, num_warps=4)),
    (20, 48, 256, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K8=16, SPLIT_K=2, SWAP=1, PREFETCH=0, num_warps=4)),
    (33, 32, 136, dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K8=16, SPLIT_K=1, SWAP=0, PREFETCH=0, num_warps=4)),
]


@pytest.mark.parametrize("m,n,k,cfg", CONFIGS)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_configs_match_torch(m, n, k, cfg, bias):
    w = _weight(n, k, seed=m + n + k, escapes_every=13)
    p = to_linear_planes(w)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = L.linear_fused(x, p, b, config=cfg)
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-4, atol=1e-5)


def test_split_gemv_is_deterministic_and_leaves_its_counters_at_zero():
    """Split K at M = 1: the last split to finish adds the partials in split order, whichever split it is; two calls
    give the same bits, and the per-row-block counters are back at zero after each (the next call relies on it)."""
    w = _weight(37, 1000, seed=3, escapes_every=11)
    p = to_linear_planes(w)
    x = torch.randn(1, 1000, generator=torch.Generator().manual_seed(4))
    cfg = dict(BLOCK_N=8, BLOCK_K8=16, SPLIT_K=4, PREFETCH=0, num_warps=4)
    first = L.linear_fused(x, p, config=cfg)
    assert not L._split_counters(1, x.device).any()
    assert torch.equal(L.linear_fused(x, p, config=cfg), first)
    assert not L._split_counters(1, x.device).any()
    torch.testing.assert_close(first.double(), _reference(x, w, None), rtol=1e-4, atol=1e-5)


def test_fused_on_real_smollm2_weight(smollm2):
    """One real SmolLM2 matrix (layer 0's down projection, 576 x 1536, in bf16) through the GEMV and a 5-row GEMM."""
    loaded, _ = smollm2
    w = loaded.model.layers[0].w2.detach().to(torch.bfloat16)
    p = to_linear_planes(w)
    g = torch.Generator().manual_seed(2)
    for m in (1, 5):
        x = torch.randn(m, w.shape[1], generator=g)
        torch.testing.assert_close(L.linear_fused(x, p).double(), _reference(x, w), rtol=1e-4, atol=1e-4)


def _layout_ok(cfg: dict) -> bool:
    """The GEMV layout limits of kernels/lossless12_linear.py: x slices stay in registers (no shared-memory
    conversion in the loop) and every thread loads at least one 16-byte vector of each word plane."""
    w = cfg["num_warps"]
    return cfg["BLOCK_K8"] <= 16 * w and cfg["BLOCK_N"] * cfg["BLOCK_K8"] >= 128 * w


def test_configs_cover_gpu_and_respect_the_layout():
    """The GEMV heuristic keeps >= ~4 programs an SM where the rows allow it and splits K for few long rows; every
    GEMV configuration (heuristic or sweep) respects the layout limits; the GEMM covers all of M <= 64 with one
    block of rows and splits K when N / BLOCK_N programs are few."""
    for n, k in L.LLAMA3_8B_SHAPES + ((576, 576), (1536, 576), (576, 1536), (49152, 576), (64, 4096), (40, 64)):
        cfg = L.gemv_config(n, k)
        assert _layout_ok(cfg), (n, k, cfg)
        programs = -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
        assert programs >= min(2 * L.N_SM, -(-n // cfg["BLOCK_N"])), (n, k, cfg)
        for m in (2, 4, 16, 33, 64):
            g = L.gemm_config(m, n, k)
            assert g["BLOCK_M"] >= m and g["BLOCK_K8"] >= 16
    assert L.gemv_config(128256, 4096)["SPLIT_K"] == 1 and L.gemv_config(128256, 4096)["BLOCK_N"] == 16
    # few row blocks: a short K takes 8-warp programs unsplit (no merge), a long K splits (4096 x 14336: 4 splits)
    assert {k: L.gemv_config(4096, 4096)[k] for k in ("num_warps", "BLOCK_K8", "SPLIT_K")} == \
        dict(num_warps=8, BLOCK_K8=128, SPLIT_K=1)
    assert L.gemv_config(4096, 14336)["SPLIT_K"] == 4 and L.gemv_config(14336, 4096)["SPLIT_K"] == 1
    assert L.gemv_config(64, 4096)["SPLIT_K"] > 1 and L.gemm_config(16, 4096, 14336)["SPLIT_K"] > 1
    assert all(_layout_ok(c) for c in L.GEMV_SWEEP)
    assert all(_layout_ok(c) for c in L._sweep_configs(1, 4096, 14336))
    assert {c["SPLIT_K"] for c in L._sweep_configs(1, 4096, 14336)} >= {1, 2, 4}
    assert {c["SPLIT_K"] for c in L._sweep_configs(1, 128256, 4096)} == {1}
    assert {c["BLOCK_M"] for c in L._sweep_configs(4, 4096, 4096)} == {16}
    assert {c["BLOCK_M"] for c in L._sweep_configs(64, 4096, 4096)} == {64}


def test_benchmark_refuses_the_cpu():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        L.benchmark(shapes=((64, 64),), ms=(1,), sweep=False)


def _lossless12_recipe(base: str = "stock"):
    data = asdict(load_recipe(base))
    data.update(name=f"{base}-lossless12", weights={"format": "lossless12"},
                kernels={**data["kernels"], "linear": "builtin:lossless12"})
    return parse(data)


def test_recipe_needs_a_12bit_linear_kernel():
    data = asdict(load_recipe("stock"))
    data["weights"] = {"format": "lossless12"}
    with pytest.raises(RecipeError, match="kernels.linear"):
        parse(data)


def test_engine_rejects_non_bf16_target(tiny):
    from specpilot.engine.engine import Engine

    with pytest.raises(SpecPilotError, match="--dtype bf16"):
        Engine(tiny.loaded, _lossless12_recipe())


def test_engine_lossless12_tokens_equal_native(tiny_model_dir):
    """Ragged batch of 3, chain decoding with k = 4: 12-bit weights give exactly the native bf16 tokens."""
    from specpilot.engine import loader
    from specpilot.engine.engine import Engine

    target = loader.load(str(tiny_model_dir("llama", seed=5)), "bf16", "cpu")
    prompts = [[5, 9, 2, 7, 5, 9], [3, 3, 8], [1, 4, 1, 5, 9, 2, 6, 5, 3]]
    native = Engine(target, load_recipe("stock")).generate(prompts, 24, ignore_eos=True)
    packed = Engine(target, _lossless12_recipe()).generate(prompts, 24, ignore_eos=True)
    assert [r.tokens for r in packed] == [r.tokens for r in native]
    assert all(len(r.tokens) == 24 for r in packed)


def test_smollm2_lossless12_passes_the_gate(tmp_path):
    from specpilot.tools.gate.check import check

    recipe = tmp_path / "lossless12.json"
    recipe.write_text(_lossless12_recipe().to_json())
    rep = check("smollm2-135m", str(recipe), "code", 1, 16, "cpu", "bf16", tmp_path / "out", salt="12bit12bit12bit1",
                cache_dir=tmp_path / "cache", timeout_s=600)
    assert rep.passed, rep.reason
    assert rep.tokens_checked >= 16


def test_one_compiled_layer_serves_every_12bit_matrix(tiny_model_dir):
    """torch.compile sees the 12-bit linear as one opaque op (`specpilot::linear12`): the layer compiled once runs
    every layer's matrices and gives the uncompiled layers' logits. (Traced, the lookup by parameter specialized the
    layer per matrix: on the H200 SmolLM2's layers hit torch's limit of 64 recompilations, eighth lease, K.)"""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from specpilot.engine import loader
    from specpilot.engine.model import Block
    from specpilot.engine.weights import bind_weights, lossless12_weights
    from specpilot.kernels import resolve as resolve_kernels

    model = loader.load(str(tiny_model_dir("llama", seed=5, num_hidden_layers=4)), "bf16", "cpu").model
    ops = resolve_kernels({"linear": "builtin:lossless12"})
    ops = ops._replace(linear=bind_weights(ops.linear, lossless12_weights(model)))
    tokens, positions = torch.tensor([[5, 9, 2, 7, 1]]), torch.arange(5)[None]
    eager = model(tokens, positions, model.new_cache(1, 16), ops=ops)
    torch._dynamo.reset()
    counter = CompileCounter()
    layer_fn = torch.compile(Block.forward, backend=counter, dynamic=False, fullgraph=True)
    compiled = model(tokens, positions, model.new_cache(1, 16), ops=ops, layer_fn=layer_fn)
    assert len(model.layers) == 4 and counter.frame_count == 1
    assert torch.equal(compiled, eager)
