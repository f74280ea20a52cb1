"""The small @triton.jit helpers that every part of the fused layer calls: its GEMV kernels
(triton_fused_layer.py), the 12-bit decode in registers (fused_layer_w12.py) and attention (fused_layer_attention.py).
They hold the modular layer's numerics where it stores a tensor: rounding to the model dtype, the residual add and
RMSNorm of a tile, the residual stream's store. A module of their own, below the three, so that those import it and
never one another in a circle.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rounded(x, like_ptr):
    """x (fp32) rounded to the element type of `like_ptr` and back: where the modular layer stores a tensor."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _normed(x_ptr, delta_ptr, nw, inv_rms, tokens, cols, col_ok, token_ok, K):
    """h = norm_w * round(round(x + delta) * inv_rms), rounded: the modular layer's add and RMSNorm, [tokens, cols]."""
    ok = token_ok[:, None] & col_ok[None, :]
    offs = tokens[:, None] * K + cols[None, :]
    r = _rounded(tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(delta_ptr + offs, mask=ok, other=0.0).to(tl.float32), x_ptr)
    return _rounded(nw[None, :] * _rounded(r * inv_rms[:, None], x_ptr), x_ptr)


@triton.jit
def _store_resid(resid_ptr, aux_ptr, aux_stride, r, tokens, cols, ok, K, AUX: tl.constexpr):
    """The first row block's store of r = x + delta at `cols`: the residual stream kernel 4 reads, and with AUX the
    same values at aux_ptr (row stride aux_stride), where the caller keeps this layer's input, the previous layer's
    output (an EAGLE-3 head's capture: a slice of one [tokens, 3 x hidden] tensor, with no add of its own)."""
    tl.store(resid_ptr + tokens[:, None] * K + cols[None, :], r.to(resid_ptr.dtype.element_ty), mask=ok)
    if AUX:
        tl.store(aux_ptr + tokens[:, None] * aux_stride + cols[None, :], r.to(aux_ptr.dtype.element_ty), mask=ok)
