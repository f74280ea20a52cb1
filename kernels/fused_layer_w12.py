"""The 12-bit half of the fused layer's FMA-path GEMVs (`weights.format: lossless12`): the @triton.jit helpers with
which `_norm_pair_gemv` and `_gemv` (triton_fused_layer.py) read a Packed12Linear's words, decode them in registers
slot by slot, multiply them with activations made at each slot's columns and add each row's escapes after the dense
sum. What a launch passes them (`_w12`, `_cfg12`, ESCAPES_AHEAD, FMA_TILES_12) stays with the launches in
triton_fused_layer.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fused_layer_common import _normed, _rounded, _store_resid
from .lossless12_linear import HALF as W12_HALF
from .lossless12_linear import _f32, _t67

# -- 12-bit weights (`weights.format: lossless12`) ----------------------------------------------------------------
# A matrix in kernels/lossless12_format.Packed12Linear's layout: per row the words W0 of its K8 = K / 8 groups, then
# W1, then W2; group j holds the weights of columns t * K8 + j, t = 0..7 (a "slot"), at their fp32 bit positions.
# A program decodes each slot of its tile with shifts and masks (lossless12_linear's decode) and multiplies it with
# that slot's activations, which it makes from x (and delta and the norm) at those columns: the same values the
# bf16 path multiplies, read from 1.5 bytes a weight instead of 2. Escapes decode to +0 and are added after the dense
# sum from the matrix's CSR list, as `_escapes12` does. Only the FMA path (a program a token) reads 12-bit weights.


@triton.jit
def _act(x_ptr, delta_ptr, norm_ptr, inv_rms, tokens, token_ok, cols, col_ok, K, NORM: tl.constexpr):
    """What a GEMV multiplies at `cols` (any 1-D set of columns), [tokens, cols] fp32: the normed residual (NORM,
    as `_normed`) or x as it is."""
    if NORM:
        nw = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        return _normed(x_ptr, delta_ptr, nw, inv_rms, tokens, cols, col_ok, token_ok, K)
    else:
        return tl.load(x_ptr + tokens[:, None] * K + cols[None, :], mask=token_ok[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)


@triton.jit
def _words12(q_ptr, rows, row_ok, j, j_ok, K8):
    """W0, W1, W2 of `rows` x groups `j`, [rows, groups] int32."""
    at = q_ptr + rows[:, None] * (3 * K8) + j[None, :]
    ok = row_ok[:, None] & j_ok[None, :]
    return tl.load(at, mask=ok, other=0), tl.load(at + K8, mask=ok, other=0), tl.load(at + 2 * K8, mask=ok, other=0)


@triton.jit
def _slot12(w0, w1, w2, t: tl.constexpr):
    """Slot t's f patterns as fp32: each weight divided by 2^(base - 1), exactly (lossless12_linear._gemv_tile)."""
    if t == 0:
        bits = w0 & W12_HALF
    elif t == 1:
        bits = (w0 << 16) & W12_HALF
    elif t == 2:
        bits = w1 & W12_HALF
    elif t == 3:
        bits = (w1 << 16) & W12_HALF
    elif t == 4:
        bits = w2 & W12_HALF
    elif t == 5:
        bits = (w2 << 16) & W12_HALF
    elif t == 6:
        bits = _t67(w0, w1, w2) & W12_HALF
    else:
        bits = _t67(w0, w1, w2) << 16
    return _f32(bits)


@triton.jit
def _tile12(acc_a, acc_b, a0, a1, a2, b0, b1, b2, j, j_ok, K8, x_ptr, delta_ptr, norm_ptr, inv_rms, tokens,
            token_ok, K, x_scale, NORM: tl.constexpr, TWO: tl.constexpr):
    """acc[rows, groups] += each slot's f patterns times its activations times x_scale (one token: BLOCK_M = 1), for
    one row set or two (they share the activations)."""
    for t in tl.static_range(8):
        cols = t * K8 + j
        h = _act(x_ptr, delta_ptr, norm_ptr, inv_rms, tokens, token_ok, cols, j_ok & (cols < K), K, NORM) * x_scale
        acc_a += _slot12(a0, a1, a2, t) * h
        if TWO:
            acc_b += _slot12(b0, b1, b2, t) * h
    return acc_a, acc_b


@triton.jit
def _escape_list12(rows, row_ok, e0, row_ptr_ptr, exc_col_ptr, exc_val_ptr, norm_ptr, NORM: tl.constexpr,
                   EXC: tl.constexpr):
    """Escapes e0 .. e0 + EXC - 1 of each of `rows` (its range of the CSR list), as a tuple: each row's escape count
    [rows], which are real [rows, EXC], their columns, exact values, and the norm weight at those columns (NORM).
    With e0 = 0 a program loads them with its words, before the PDL wait: they are weights too."""
    lo = tl.load(row_ptr_ptr + rows, mask=row_ok, other=0)
    n = tl.load(row_ptr_ptr + rows + 1, mask=row_ok, other=0) - lo
    e = e0 + tl.arange(0, EXC)
    ok = e[None, :] < n[:, None]
    col = tl.load(exc_col_ptr + lo[:, None] + e[None, :], mask=ok, other=0)
    val = tl.load(exc_val_ptr + lo[:, None] + e[None, :], mask=ok, other=0.0)
    nw = val  # (read only with NORM)
    if NORM:
        nw = tl.load(norm_ptr + col, mask=ok, other=0.0).to(tl.float32)
    return n, ok, col, val, nw


@triton.jit
def _escape_inputs12(esc, x_ptr, delta_ptr, tokens, token_ok, K, NORM: tl.constexpr):
    """What the activations at the escapes' columns are made from, [tokens, rows, EXC]: r = x + delta rounded (NORM)
    or x. Loaded right after the PDL wait, so that the dense products hide the round trip."""
    ok, col = esc[1], esc[2]
    m = token_ok[:, None, None] & ok[None, :, :]
    offs = tokens[:, None, None] * K + col[None, :, :]
    r = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if NORM:
        r = _rounded(r + tl.load(delta_ptr + offs, mask=m, other=0.0).to(tl.float32), x_ptr)
    return r


@triton.jit
def _escape_sum12(y, esc, r, inv_rms, x_ptr, NORM: tl.constexpr):
    """y [tokens, rows] + each escape's exact value times its activation (`_normed`'s h, or x)."""
    h = r
    if NORM:
        h = _rounded(esc[4][None, :, :] * _rounded(r * inv_rms[:, None, None], x_ptr), x_ptr)
    return y + tl.sum(esc[3][None, :, :] * h, axis=2)


@triton.jit
def _escapes12(y, esc, r, rows, row_ok, row_ptr_ptr, exc_col_ptr, exc_val_ptr, x_ptr, delta_ptr, norm_ptr, inv_rms,
               tokens, token_ok, K, NORM: tl.constexpr, EXC: tl.constexpr):
    """y + the rows' escapes (the dense part decoded them as +0): the first EXC of each row from `esc` and `r`
    (loaded early), then, for a row with more, EXC at a time."""
    y = _escape_sum12(y, esc, r, inv_rms, x_ptr, NORM)
    for e0 in range(EXC, tl.max(esc[0], axis=0), EXC):
        more = _escape_list12(rows, row_ok, e0, row_ptr_ptr, exc_col_ptr, exc_val_ptr, norm_ptr, NORM, EXC)
        y = _escape_sum12(y, more, _escape_inputs12(more, x_ptr, delta_ptr, tokens, token_ok, K, NORM), inv_rms,
                          x_ptr, NORM)
    return y


@triton.jit
def _sums12(acc_a, acc_b, scales_ptr, esc_a, esc_b, r_a, r_b, rows_a, rows_b, row_ok, row_ptr_ptr, exc_col_ptr,
            exc_val_ptr, x_ptr, delta_ptr, norm_ptr, inv_rms, tokens, token_ok, K, NORM: tl.constexpr,
            TWO: tl.constexpr, EXC: tl.constexpr):
    """Each row set's [1, rows] output from its [rows, groups] accumulator: reduced, scaled, escapes added."""
    sum_scale = tl.load(scales_ptr + 1)
    ya = _escapes12((tl.sum(acc_a, axis=1) * sum_scale)[None, :], esc_a, r_a, rows_a, row_ok, row_ptr_ptr,
                    exc_col_ptr, exc_val_ptr, x_ptr, delta_ptr, norm_ptr, inv_rms, tokens, token_ok, K, NORM, EXC)
    yb = ya
    if TWO:
        yb = _escapes12((tl.sum(acc_b, axis=1) * sum_scale)[None, :], esc_b, r_b, rows_b, row_ok, row_ptr_ptr,
                        exc_col_ptr, exc_val_ptr, x_ptr, delta_ptr, norm_ptr, inv_rms, tokens, token_ok, K, NORM, EXC)
    return ya, yb


@triton.jit
def _gemv12(acc_a, acc_b, a0, a1, a2, b0, b1, b2, q_ptr, rows_a, rows_b, row_ok, K8, x_ptr, delta_ptr, norm_ptr,
            inv_rms, tokens, token_ok, K, scales_ptr, NORM: tl.constexpr, TWO: tl.constexpr, SINGLE: tl.constexpr,
            BLOCK_K8: tl.constexpr):
    """The dense part of the 12-bit GEMV of one token (or of two row sets'): the [rows, groups] accumulators. a0..b2
    are the words of the first tile of groups (all of them with SINGLE), loaded by the caller before its PDL wait;
    each later tile's words are loaded while the tile before it is multiplied (a DRAM round trip a tile otherwise:
    Llama-3.1-8B's down projection is 14 tiles a row in FMA_TILES_12's)."""
    x_scale = tl.load(scales_ptr)
    jj = tl.arange(0, BLOCK_K8)
    for j0 in range(0, K8, BLOCK_K8):
        j = j0 + jj
        c0, c1, c2, d0, d1, d2 = a0, a1, a2, b0, b1, b2
        if not SINGLE:
            a0, a1, a2 = _words12(q_ptr, rows_a, row_ok, j + BLOCK_K8, j + BLOCK_K8 < K8, K8)
            b0, b1, b2 = a0, a1, a2
            if TWO:
                b0, b1, b2 = _words12(q_ptr, rows_b, row_ok, j + BLOCK_K8, j + BLOCK_K8 < K8, K8)
        acc_a, acc_b = _tile12(acc_a, acc_b, c0, c1, c2, d0, d1, d2, j, j < K8, K8, x_ptr, delta_ptr, norm_ptr,
                               inv_rms, tokens, token_ok, K, x_scale, NORM, TWO)
    return acc_a, acc_b

@triton.jit
def _resid_slot(x_ptr, delta_ptr, resid_ptr, tokens, token_ok, j, j_ok, t: tl.constexpr, K8, K, pid, aux_ptr,
                aux_stride, AUX: tl.constexpr):
    """r = x + delta at slot t's columns, rounded as the modular layer's add; the first row block stores it."""
    cols = t * K8 + j
    ok = token_ok[:, None] & (j_ok & (cols < K))[None, :]
    offs = tokens[:, None] * K + cols[None, :]
    r = _rounded(tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(delta_ptr + offs, mask=ok, other=0.0).to(tl.float32), x_ptr)
    if pid == 0:
        _store_resid(resid_ptr, aux_ptr, aux_stride, r, tokens, cols, ok, K, AUX)
    return r


@triton.jit
def _mac12(acc_a, acc_b, a0, a1, a2, b0, b1, b2, r, t: tl.constexpr, j, j_ok, K8, K, norm_ptr, inv_rms, x_ptr,
           x_scale, TWO: tl.constexpr):
    """acc += slot t's f patterns times h = the norm of r (slot t's residual slice), as `_normed` makes it."""
    cols = t * K8 + j
    nw = tl.load(norm_ptr + cols, mask=j_ok & (cols < K), other=0.0).to(tl.float32)
    h = _rounded(nw[None, :] * _rounded(r * inv_rms[:, None], x_ptr), x_ptr) * x_scale
    acc_a += _slot12(a0, a1, a2, t) * h
    if TWO:
        acc_b += _slot12(b0, b1, b2, t) * h
    return acc_a, acc_b


@triton.jit
def _gemv12_normed(acc_a, acc_b, a0, a1, a2, b0, b1, b2, K8, x_ptr, delta_ptr, resid_ptr, norm_ptr, eps, tokens,
                   token_ok, K, pid, scales_ptr, aux_ptr, aux_stride, TWO: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K8: tl.constexpr, AUX: tl.constexpr):
    """`_gemv12` for a normed input with all of K's groups in the words a0..b2 (loaded before the PDL wait): each
    slot's slice of x + delta read once and held in registers for the norm's statistics and the products (the
    general path reads the activations twice: 40 KB of L2 reads a program of two rows at Llama-3.1-8B's K, against
    12 KB of 12-bit weights). Returns the accumulators and each token's 1 / rms."""
    j = tl.arange(0, BLOCK_K8)
    j_ok = j < K8
    rs = ()  # the eight slots' residual slices (a tuple, unrolled: the norm needs all of them before any product)
    sq = tl.zeros((BLOCK_M,), tl.float32)
    for t in tl.static_range(8):
        r = _resid_slot(x_ptr, delta_ptr, resid_ptr, tokens, token_ok, j, j_ok, t, K8, K, pid, aux_ptr, aux_stride,
                        AUX)
        sq += tl.sum(r * r, axis=1)
        rs = rs + (r,)
    inv_rms = 1.0 / tl.sqrt(sq / K + eps)
    x_scale = tl.load(scales_ptr)
    for t in tl.static_range(8):
        acc_a, acc_b = _mac12(acc_a, acc_b, a0, a1, a2, b0, b1, b2, rs[t], t, j, j_ok, K8, K, norm_ptr, inv_rms, x_ptr,
                              x_scale, TWO)
    return acc_a, acc_b, inv_rms
