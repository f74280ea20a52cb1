"""(Reverted after this call, docs/BENCHMARKS.md, seventh lease, D: neither variant was faster; the module
attributes TOKEN_MAJOR and MAX_REGISTERS it sets no longer exist.)
Issue #2, seventh lease: where a verification step with dead slots loses its time, and whether launching each
token's programs together (TOKEN_MAJOR) wins it back.

Calls B and C (fma_registers.py, spec_step_profile.py) found the adaptive min-2 n-gram's captured step with one live
token of five at 0.501-0.524 ms against the fused AR step's 0.437, with the step's own small kernels (n-gram search,
LM head on five rows, acceptance) only ~15 µs of that: the rest is the layers' dead programs. Per variant, in this one
process over the same model:
- µs a layer (all 30 layers in one CUDA graph, position 300): 1 token; 5 tokens with 1, 2, 3 and 5 live; 2 tokens;
- device ms of one captured step (fma_registers.step_times): the fused AR step and the n-gram step with 1, 2, 3 and 5
  live tokens.
Variants: base (tokens side by side per row block), token_major, token_major with the q/k/v and down programs capped
at 64 registers. Writes $OUT/grid_order.json.
"""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fma_registers import POSITION, run_variants  # noqa: E402

from specpilot.kernels import triton_fused_layer as F  # noqa: E402

VARIANTS = {"base": dict(TOKEN_MAJOR=False, MAX_REGISTERS={}),
            "token_major": dict(TOKEN_MAJOR=True, MAX_REGISTERS={}),
            "token_major_caps": dict(TOKEN_MAJOR=True, MAX_REGISTERS={"qkv": 64, "down": 64})}


def layer_us(model, T: int, n_live: int | None) -> float:
    """µs a layer: all layers, one row of T tokens at POSITION, the first n_live live (None: no live mask)."""
    cfg, dev, dt = model.cfg, model.device, model.dtype
    cache = model.new_cache(1, 512)
    positions = (POSITION + torch.arange(T, device=dev))[None]
    x = torch.randn(1, T, cfg.hidden_size, device=dev, dtype=dt)
    delta = torch.randn_like(x)
    cos, sin = (t[positions].unsqueeze(2) for t in model._rope)
    rows = torch.zeros(1, T, dtype=torch.long, device=dev)
    live = None if n_live is None else (torch.arange(T, device=dev) < n_live).int()

    def layers():
        a, d = x, delta
        for i, block in enumerate(model.layers):
            a, d = F.fused_layer(block, a, d, cos, sin, cache.kv[:, i], rows, positions, {}, None, live)

    layers()
    return do_bench_cudagraph(layers) * 1e3 / cfg.n_layers


def main() -> None:
    run_variants("grid_order", VARIANTS, lambda model: {
        f"layer_us_T{T}_live{n_live or T}": round(layer_us(model, T, n_live), 2)
        for T, n_live in ((1, None), (5, 1), (5, 2), (5, 3), (5, 5), (2, None))})


if __name__ == "__main__":
    main()
