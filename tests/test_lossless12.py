"""Lossless 12-bit bf16 format (kernels/lossless12_format.py): bit-exact round trips on every SmolLM2 tensor and on random
tensors with the awkward values (±0, subnormals, ±inf, NaN payloads, extreme exponents), the layout a GEMV kernel
relies on, and the measured escape rate / bits-per-weight bounds documented in docs/LOSSLESS12.md."""
from __future__ import annotations

import pytest
import torch

from specpilot.kernels.lossless12_format import ESCAPE, Packed12, decode, encode, exponent_histogram

# Measured with `python -m specpilot.tools.weight_stats --target smollm2-135m` (docs/LOSSLESS12.md):
# overall escape rate 2.51e-04, worst tensor layers.0.wqkv 1.39e-03, overall 12.069 bits/weight, max 12.333.
SMOLLM2_ESCAPE_RATE_BOUND = 5e-4
SMOLLM2_TENSOR_ESCAPE_BOUND = 2e-3
BITS_BOUND = 12.5

SPECIAL_BITS = [
    0x0000, 0x8000,                          # +0, -0
    0x0001, 0x8001, 0x007F, 0x807F, 0x0040,  # subnormals (smallest, largest, middle), both signs
    0x0080, 0x8080,                          # smallest normal (exponent 1)
    0x7F7F, 0xFF7F,                          # largest finite (exponent 254)
    0x7F80, 0xFF80,                          # +inf, -inf
    0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD3,   # NaNs with different payloads and signs
    0x3F80, 0xBF80,                          # ±1.0
]


def _bf16(bits: list[int] | torch.Tensor) -> torch.Tensor:
    b = torch.as_tensor(bits, dtype=torch.int32)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def _assert_exact(w: torch.Tensor) -> Packed12:
    p = encode(w)
    out = decode(p)
    assert out.dtype == torch.bfloat16 and out.shape == w.shape
    assert torch.equal(out.view(torch.int16), w.contiguous().view(torch.int16)), "round trip is not bit-exact"
    return p


def _kernel_decode(p: Packed12) -> torch.Tensor:
    """What a GEMV kernel does in registers: shifts, masks and a 16-entry lookup, no exception list (int32 bits)."""
    lo = p.lo.to(torch.int32)
    code = torch.stack([lo & 0xF, lo >> 4], 1).flatten()[:p.numel]
    hi = p.hi.to(torch.int32)
    return ((hi & 0x80) << 8) | (p.exp_table.to(torch.int32)[code] << 7) | (hi & 0x7F)


def test_smollm2_every_tensor_round_trips_bit_exact(smollm2):
    loaded, _ = smollm2
    seen, n, escapes, nbytes, count = set(), 0, 0, 0, 0
    for name, p in loaded.model.named_parameters():
        if p.data_ptr() in seen:           # tied embedding / LM head once
            continue
        seen.add(p.data_ptr())
        w = p.detach().to(torch.bfloat16)  # exactly the engine's bf16 weights
        packed = _assert_exact(w)
        assert packed.escape_rate <= SMOLLM2_TENSOR_ESCAPE_BOUND, (name, packed.escape_rate)
        assert packed.bits_per_weight <= BITS_BOUND, (name, packed.bits_per_weight)
        n, escapes, nbytes, count = n + w.numel(), escapes + packed.n_escapes, nbytes + packed.nbytes, count + 1
    assert count > 100 and n > 130_000_000
    assert escapes / n <= SMOLLM2_ESCAPE_RATE_BOUND
    assert 8 * nbytes / n <= BITS_BOUND


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (23,), (64,), (3, 5), (33, 17), (16, 64), (2, 3, 5)])
def test_special_values_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    n = torch.Size(shape).numel()
    normal = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    specials = torch.tensor(SPECIAL_BITS)[torch.randint(len(SPECIAL_BITS), (n,), generator=g)]
    pick = torch.rand(n, generator=g) < 0.3
    w = _bf16(torch.where(pick, specials, normal)).reshape(shape)
    _assert_exact(w)


def test_every_bit_pattern_round_trips():
    """All 65536 bf16 bit patterns: every exponent 0..255, so 241 of 256 exponents must escape. 1-D, odd length."""
    w = _bf16(torch.randperm(65536, generator=torch.Generator().manual_seed(0))[:65535])
    p = _assert_exact(w)
    assert p.n_escapes == 65535 - 15 * 256
    _assert_exact(w.reshape(5, 13107))
    _assert_exact(w[:-1].reshape(-1, 2).t())          # non-contiguous 2-D input


def test_all_nan_and_extreme_only_tensors():
    for bits in ([0x7FC1] * 9, [0xFFFF, 0x7F81, 0x7FC0], [0x0001] * 5 + [0x7F7F] * 4, [0x8000] * 3, [0x7F80]):
        _assert_exact(_bf16(bits))


def test_llama_like_random_tensor_bits_per_weight():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 4096, generator=g) * 0.02).to(torch.bfloat16)
    p = _assert_exact(w)
    assert p.bits_per_weight <= BITS_BOUND
    assert p.escape_rate < 3e-4                       # measured 1.54e-04


def test_layout_for_a_gemv_kernel():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 30, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16)[3, :16] = torch.arange(1, 17) << 7            # 32 singleton exponents in rows 3 and 40:
    w.view(torch.int16)[40, 14:] = (torch.arange(200, 216) << 7) - 0x8000    # negative; at most 15 fit the table
    p = encode(w)
    assert p.hi.dtype == p.lo.dtype == p.exp_table.dtype == torch.uint8
    assert p.exp_table.numel() == 16 and p.exp_table[ESCAPE] == 0 and p.lo.numel() == (w.numel() + 1) // 2
    assert p.exc_index.dtype == torch.int64 and p.exc_bits.dtype == torch.int16
    assert torch.equal(p.exc_index, p.exc_index.sort().values)
    # shift/mask decode gives the exact bits everywhere except escapes, which decode to +0 (additive correction)
    bits = _kernel_decode(p)
    flat = w.view(torch.int16).flatten().to(torch.int32) & 0xFFFF
    is_exc = torch.zeros(w.numel(), dtype=torch.bool)
    is_exc[p.exc_index] = True
    assert torch.equal(bits[~is_exc], flat[~is_exc]) and bool((bits[is_exc] == 0).all())
    assert torch.equal(p.exc_bits, w.view(torch.int16).flatten()[p.exc_index])
    # per-row CSR offsets find each row's exceptions without a search
    assert p.exc_row_ptr.numel() == 49 and p.exc_row_ptr[0] == 0 and p.exc_row_ptr[-1] == p.n_escapes
    assert p.n_escapes >= 17
    for r in range(48):
        idx = p.exc_index[p.exc_row_ptr[r]:p.exc_row_ptr[r + 1]]
        assert bool(((idx // 30) == r).all())
    assert p.exc_row_ptr[4] - p.exc_row_ptr[3] >= 1 and p.exc_row_ptr[41] - p.exc_row_ptr[40] >= 1
    assert p.nbytes == 16 + w.numel() + (w.numel() + 1) // 2 + 10 * p.n_escapes + 4 * 49
    assert p.bits_per_weight == pytest.approx(8 * p.nbytes / w.numel())


def test_exponent_histogram():
    w = _bf16([0x0000, 0x8001, 0x3F80, 0xBF80, 0x7F80, 0x7FC1, 0x4000])
    h = exponent_histogram(w)
    assert h.shape == (256,) and int(h.sum()) == 7
    assert h[0] == 2 and h[127] == 2 and h[128] == 1 and h[255] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16])
def test_encode_rejects_non_bf16(dtype):
    with pytest.raises(TypeError, match="bfloat16"):
        encode(torch.zeros(4, dtype=dtype))
    with pytest.raises(TypeError, match="bfloat16"):
        exponent_histogram(torch.zeros(4, dtype=dtype))
