"""The fused 12-bit linear kernel (kernels/lossless12_linear.py) under the Triton interpreter, its torch decode, and
the engine with `weights.format = "lossless12"`: same tokens as native bf16, and a pass through the token-forcing
gate on SmolLM2-135M (CPU)."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from specpilot.engine.errors import SpecPilotError
from specpilot.engine.recipe import RecipeError, load_recipe, parse
from specpilot.kernels import lossless12_linear as L  # TRITON_INTERPRET=1 was set by conftest on a CPU machine
from specpilot.kernels.lossless12_format import decode_linear_weight, to_linear_planes

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


def test_fused_on_real_smollm2_weight(smollm2):
    """One real SmolLM2 matrix (layer 0's down projection, 576 x 1536, in bf16) through the GEMV and a 5-row GEMM."""
    loaded, _ = smollm2
    w = loaded.model.layers[0].w2.detach().to(torch.bfloat16)
    p = to_linear_planes(w)
    g = torch.Generator().manual_seed(2)
    for m in (1, 5):
        x = torch.randn(m, w.shape[1], generator=g)
        torch.testing.assert_close(L.linear_fused(x, p).double(), _reference(x, w), rtol=1e-4, atol=1e-4)


def test_config_covers_gpu():
    """The GEMV launch splits small matrices finely enough to occupy many SMs and keeps big ones at wide tiles."""
    assert L.gemv_config(576, 576)["BLOCK_N"] <= 2 and L.gemv_config(128256, 4096)["BLOCK_N"] == 16


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
    from specpilot.tools.gate import check

    recipe = tmp_path / "lossless12.json"
    recipe.write_text(_lossless12_recipe().to_json())
    rep = check("smollm2-135m", str(recipe), "code", 1, 16, "cpu", "bf16", tmp_path / "out", salt="12bit12bit12bit1",
                cache_dir=tmp_path / "cache", timeout_s=600)
    assert rep.passed, rep.reason
    assert rep.tokens_checked >= 16
