"""Fused 12-bit-weight linear layer: y = x @ W^T + b with W stored in the lossless 12-bit format.

Format (kernels/lossless12_format.py, docs/LOSSLESS12.md): 12 bits a weight, sign + 7-bit mantissa + a 4-bit code
into a contiguous window of 15 exponents [base, base + 14]; code 15 is a signed zero or an escape, whose exact value
is in a CSR exception list and added back as a sparse correction. Reading 1.5 bytes a weight instead of bf16's 2, a
kernel that only streams its weights (M = 1, decode) has a ceiling of 2 / 1.5 = 1.33x over a bf16 GEMV.

Why the kernel looks the way it does
- A bandwidth-bound GEMV on an H200 must retire ~2.7e12 weights/s (4 TB/s of 1.5-byte weights). The integer pipe
  runs 16 lanes/clock/SM-quarter, so at ~2 GHz and 132 SMs that is ~6 integer operations a weight with nothing to
  spare; the first kernel's compiled loop took ~16 instructions a weight (a table load per pair, shared-memory
  layout conversions) and ran at 1.0-1.7 TB/s. So the decode is arithmetic
  (no table) and the layout (`Packed12Linear`, see lossless12_format.py) stores each weight's 12 bits at their fp32
  positions: 8 weights are 3 int32 words, and 19 integer operations (shifts and masks) give the fp32 patterns
  f = sign << 31 | c << 23 | mantissa << 16 of all 8, c = code + 1 (0 for zeros and escapes).
  f * 2^(base - 1) is the weight exactly (a power-of-two scale of a normal float, or a signed zero): one FMUL on the
  FP pipe, which has twice the integer pipe's width, instead of an add + compare + select. The GEMV multiplies x
  by the scale instead (`Packed12Linear.x_scales`: each x value a thread loads serves two rows, so half the
  multiplies), and each output's sum by what is left of it.
- The 8 weights of a group are K8 = K/8 columns apart, so x is read as 8 contiguous slices and every load is a wide
  contiguous vector (16 bytes a thread for the weight words). In the GEMV, K and K8 are compile-time constants, so
  the 8 slices and the 3 word rows are immediate offsets from one address (a compile per distinct K: a model has
  two or three).
- M = 1 (decode): each program owns BLOCK_N rows and walks its K range BLOCK_K8 groups (8 * BLOCK_K8 weights of a
  row) at a time into a [BLOCK_N, BLOCK_K8] fp32 accumulator reduced once at the end (no cross-lane reductions in
  the loop). The first tile's words are requested before the loop; PREFETCH also loads each next tile's words
  before decoding the current one (loads in flight while the integer pipe works). With the scale on x and K
  constant the loop is ~5.3 instructions a weight (6.2 before), which took 14336 x 4096 from 24.4-25.0 to
  23.5-23.6 us on the H200 (docs/BENCHMARKS.md, eighth lease): the loop is partly issue-bound, not only
  bandwidth-bound. SPLIT_K > 1 splits K over a second grid dimension when N / BLOCK_N programs cannot fill the
  GPU; partial sums go to an fp32 buffer, and the last of a row block's splits to finish (told by an atomic counter)
  adds them in split order (deterministic, unlike atomic adds: the same logits every run), adds the bias and casts:
  no second kernel, whose launch would cost a few µs of a ~25 µs GEMV.
- 1 < M (verification, prefill): each program decodes a weight tile ONCE and multiplies it with all BLOCK_M
  (<= 64) rows of x on tensor cores: 8 tl.dot per tile, one a slot, in x's dtype (bf16: exact, the weights are bf16
  values). SWAP computes W x^T instead of x W^T (the weight tile becomes the wide M side of the MMA). Split-K as for
  the GEMV, but the partials are added by `_splitk_reduce`, a kernel of its own.
- Escapes: a program's rows are contiguous, so their exceptions are one range of the CSR list; each chunk is folded
  in through a one-hot matrix (an escape decodes to +0 in the dense part, so adding value * x is exact). The split
  with pid 0 does them.
- The interpreter has no bf16 arithmetic, so no path computes in bf16 where the interpreter runs it: a bf16 x is
  loaded as int16 bits and widened with a shift (exact), outputs are cast once at the store.

The torch fallback (`decode_linear_weight` + F.linear) decodes with torch ops and calls F.linear: CPU engines use it
(the interpreter is far too slow for a whole model), and it gives bit-identical weights, hence identical logits to
native bf16.

`python -m specpilot.kernels.lossless12_linear --out F.json` times torch bf16 against the default launch and a sweep
of variants on Llama-3-8B shapes (CUDA graphs of R calls between events: device time, not launch latency).
"""
from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .lossless12_format import (HALF_MASK, T67_MASKS, T67_SIGN_MASK, Packed12Linear, _s32, decode_linear_weight,
                                to_linear_planes)
from .timing import require_gpu_compiled

HALF = tl.constexpr(_s32(HALF_MASK))                     # sign 31, code 23..26, mantissa 16..22
T67_C = tl.constexpr(T67_MASKS[0][1])                    # codes of weights 6, 7 (from W0 >> 4)
T67_MH = tl.constexpr(T67_MASKS[1][1])                   # their mantissas' top 4 bits (W1 >> 8)
T67_ML = tl.constexpr(T67_MASKS[2][1])                   # their mantissas' low 3 bits (W2 >> 11)
T67_S = tl.constexpr(_s32(T67_SIGN_MASK))                # their signs (W2 << 1)
EXC_BLOCK = 16


# -- decode ---------------------------------------------------------------------------------------------------------

@triton.jit
def _f(bits, scale_w):
    """fp32 weight values from f bit patterns: f * 2^(base - 1), exact."""
    return bits.to(tl.float32, bitcast=True) * scale_w


@triton.jit
def _f32(bits):
    """f bit patterns as fp32 values: the weights divided by 2^(base - 1), exactly (the GEMV scales x instead)."""
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _t67(w0, w1, w2):
    """The word holding weights 6 (top half) and 7 (bottom half) at fp32 positions, from the unused bits of W0..W2
    (shifts and masks as in lossless12_format.T67_MASKS). Arithmetic right shifts are fine: the masks drop the
    copied sign bits."""
    return ((w0 >> 4) & T67_C) | ((w1 >> 8) & T67_MH) | ((w2 >> 11) & T67_ML) | ((w2 << 1) & T67_S)


@triton.jit
def _load_words(p, K8, row_ok, j_ok, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, POLICY: tl.constexpr):
    """W0, W1, W2 of a [BLOCK_N, BLOCK_K8] tile (p: pointers to its W0 words); masks only where the tile can stick
    out, so that the common case compiles to plain 16-byte vector loads. POLICY is the loads' L2 eviction policy
    ("evict_first": weights are read once, x should stay)."""
    if EVEN_N and EVEN_K:
        w0 = tl.load(p, eviction_policy=POLICY)
        w1 = tl.load(p + K8, eviction_policy=POLICY)
        w2 = tl.load(p + 2 * K8, eviction_policy=POLICY)
    else:
        if EVEN_N:
            ok = j_ok[None, :]
        elif EVEN_K:
            ok = row_ok[:, None]
        else:
            ok = row_ok[:, None] & j_ok[None, :]
        w0 = tl.load(p, mask=ok, other=0, eviction_policy=POLICY)
        w1 = tl.load(p + K8, mask=ok, other=0, eviction_policy=POLICY)
        w2 = tl.load(p + 2 * K8, mask=ok, other=0, eviction_policy=POLICY)
    return w0, w1, w2


@triton.jit
def _next_words(q_row, j0, jj, k_hi, K8, row_ok, BLOCK_K8: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, POLICY: tl.constexpr):
    """The words of the tile after the one at j0 (register prefetch: in flight while the current tile is decoded).
    With EVEN_K the last iteration re-reads its own tile (cached) instead of masking every load."""
    if EVEN_K:
        jn = tl.minimum(j0 + BLOCK_K8, k_hi - BLOCK_K8) + jj
    else:
        jn = j0 + BLOCK_K8 + jj
    return _load_words(q_row + jn[None, :], K8, row_ok, jn < k_hi, EVEN_N, EVEN_K, POLICY)


@triton.jit
def _first_words(q_row, k_lo, jj, k_hi, K8, row_ok, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 POLICY: tl.constexpr, PREFETCH: tl.constexpr):
    """With PREFETCH the first tile's words, loaded before the loop. Without, zeros: the loop carries w0..w2 either
    way, so Triton needs them defined before it, and `_tile_words` then loads each tile in its own iteration."""
    if PREFETCH:
        j = k_lo + jj
        return _load_words(q_row + j[None, :], K8, row_ok, j < k_hi, EVEN_N, EVEN_K, POLICY)
    else:
        return 0, 0, 0


@triton.jit
def _tile_words(q_row, j0, jj, k_hi, K8, row_ok, w0, w1, w2, BLOCK_K8: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, POLICY: tl.constexpr, PREFETCH: tl.constexpr):
    """(the words of the tile at j0, what the next iteration gets as w0..w2). With PREFETCH the tile's words are
    w0..w2, loaded an iteration earlier, and the next tile's are loaded now, in flight while this one is decoded;
    without, the tile's words are loaded now."""
    if PREFETCH:
        n0, n1, n2 = _next_words(q_row, j0, jj, k_hi, K8, row_ok, BLOCK_K8, EVEN_N, EVEN_K, POLICY)
        return w0, w1, w2, n0, n1, n2
    else:
        j = j0 + jj
        c0, c1, c2 = _load_words(q_row + j[None, :], K8, row_ok, j < k_hi, EVEN_N, EVEN_K, POLICY)
        return c0, c1, c2, w0, w1, w2


@triton.jit
def _escape_chunk(e0, end, exc_row_ptr, exc_col_ptr, exc_val_ptr, EXC_BLOCK: tl.constexpr):
    """EXC_BLOCK escapes from e0 of the CSR list (masked past `end`): rows (-1 when masked), columns, exact values."""
    e = e0 + tl.arange(0, EXC_BLOCK)
    e_ok = e < end
    r = tl.load(exc_row_ptr + e, mask=e_ok, other=-1)
    col = tl.load(exc_col_ptr + e, mask=e_ok, other=0)
    val = tl.load(exc_val_ptr + e, mask=e_ok, other=0.0)
    return e_ok, r, col, val


@triton.jit
def _x_f32(v, X_BF16: tl.constexpr):
    """x values as fp32: bf16 arrives as its int16 bits and is widened with a shift (exact, no bf16 arithmetic)."""
    if X_BF16:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


# -- M = 1: GEMV on the FMA units -----------------------------------------------------------------------------------

@triton.jit
def _x_slot(x_ptr, t: tl.constexpr, j, j_ok, K8, K, x_scale, X_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 x at the columns of slot t of groups j (one contiguous slice), times x_scale (a power of two)."""
    k = t * K8 + j
    if EVEN_K:
        v = tl.load(x_ptr + k)
    else:
        v = tl.load(x_ptr + k, mask=j_ok & (k < K), other=0)
    return _x_f32(v, X_BF16) * x_scale


@triton.jit
def _gemv_tile(acc, w0, w1, w2, x_ptr, j, j_ok, K8, K, x_scale, X_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    """acc[BLOCK_N, BLOCK_K8] += the tile's 8 slots (f patterns, unscaled) times their scaled x slices (fp32 FMA;
    reduced after the loop)."""
    t67 = _t67(w0, w1, w2)
    acc += _f32(w0 & HALF) * _x_slot(x_ptr, 0, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    acc += _f32((w0 << 16) & HALF) * _x_slot(x_ptr, 1, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    acc += _f32(w1 & HALF) * _x_slot(x_ptr, 2, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    acc += _f32((w1 << 16) & HALF) * _x_slot(x_ptr, 3, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    acc += _f32(w2 & HALF) * _x_slot(x_ptr, 4, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    acc += _f32((w2 << 16) & HALF) * _x_slot(x_ptr, 5, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    acc += _f32(t67 & HALF) * _x_slot(x_ptr, 6, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    acc += _f32(t67 << 16) * _x_slot(x_ptr, 7, j, j_ok, K8, K, x_scale, X_BF16, EVEN_K)[None, :]
    return acc


@triton.jit
def _escape_sum(y, rows, exc_lo, exc_hi, exc_row_ptr, exc_col_ptr, exc_val_ptr, x_ptr, X_BF16: tl.constexpr,
                EXC_BLOCK: tl.constexpr):
    """y[BLOCK_N] + the escapes of exc_lo..exc_hi (CSR entries of the program's rows) times their x values."""
    for e0 in range(exc_lo, exc_hi, EXC_BLOCK):
        e_ok, r, col, val = _escape_chunk(e0, exc_hi, exc_row_ptr, exc_col_ptr, exc_val_ptr, EXC_BLOCK)
        xv = _x_f32(tl.load(x_ptr + col, mask=e_ok, other=0), X_BF16)
        y += tl.sum(tl.where(r[:, None] == rows[None, :], (val * xv)[:, None], 0.0), axis=0)
    return y


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, exc_row_ptr, exc_col_ptr, exc_val_ptr, row_ptr_ptr, b_ptr, out_ptr, part_ptr,
                 count_ptr, N, K: tl.constexpr, K8: tl.constexpr, k_chunk, n_split, x_scale, scale_out,
                 HAS_BIAS: tl.constexpr, X_BF16: tl.constexpr, EVEN_N: tl.constexpr,
                 EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                 EXC_BLOCK: tl.constexpr, POLICY: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    rows = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    exc_lo = tl.load(row_ptr_ptr + n0)                      # issued now, needed only after the main loop
    exc_hi = tl.load(row_ptr_ptr + tl.minimum(n0 + BLOCK_N, N))
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K8)
    q_row = q_ptr + rows[:, None] * (3 * K8)
    jj = tl.arange(0, BLOCK_K8)
    j = k_lo + jj
    w0, w1, w2 = _load_words(q_row + j[None, :], K8, row_ok, j < k_hi, EVEN_N, EVEN_K, POLICY)  # the first tile
    acc = tl.zeros((BLOCK_N, BLOCK_K8), dtype=tl.float32)
    if PREFETCH:
        for j0 in range(k_lo, k_hi, BLOCK_K8):
            j = j0 + jj
            next0, next1, next2 = _next_words(q_row, j0, jj, k_hi, K8, row_ok, BLOCK_K8, EVEN_N, EVEN_K, POLICY)
            acc = _gemv_tile(acc, w0, w1, w2, x_ptr, j, j < k_hi, K8, K, x_scale, X_BF16, EVEN_K)
            w0, w1, w2 = next0, next1, next2
    else:
        acc = _gemv_tile(acc, w0, w1, w2, x_ptr, j, j < k_hi, K8, K, x_scale, X_BF16, EVEN_K)
        for j0 in range(k_lo + BLOCK_K8, k_hi, BLOCK_K8):
            j = j0 + jj
            w0, w1, w2 = _load_words(q_row + j[None, :], K8, row_ok, j < k_hi, EVEN_N, EVEN_K, POLICY)
            acc = _gemv_tile(acc, w0, w1, w2, x_ptr, j, j < k_hi, K8, K, x_scale, X_BF16, EVEN_K)
    exc_hi = tl.where(pid_k == 0, exc_hi, exc_lo)           # split 0 adds the escapes
    y = _escape_sum(tl.sum(acc, axis=1) * scale_out, rows, exc_lo, exc_hi, exc_row_ptr, exc_col_ptr, exc_val_ptr,
                    x_ptr, X_BF16, EXC_BLOCK)
    last = n_split == 1  # (a tensor unless n_split is 1, which Triton specializes: typed as the branch's)
    if n_split > 1:  # a runtime branch, so split and unsplit launches share one compiled kernel
        tl.store(part_ptr + pid_k * N + rows, y, mask=row_ok)   # fp32 [n_split, N]
        # The barrier orders every thread's stores before the counter's (acq_rel, device-wide) increment, whose
        # acquire side makes the other splits' stores visible to the last one, which adds them up in split order.
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + pid_n, 1) == n_split - 1
        if last:
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(0, n_split):
                y += tl.load(part_ptr + s * N + rows, mask=row_ok, other=0.0)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call
    if last:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


# -- 1 < M: tensor cores, one decode per weight tile for all rows of x ----------------------------------------------

@triton.jit
def _mma_slot(acc, bits, x_row, m_ok, t: tl.constexpr, j, j_ok, K8, K, scale_w, SWAP: tl.constexpr,
              DOT_PREC: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += x[:, slot t of groups j] @ W[rows, same]^T (or its transpose with SWAP)."""
    k = t * K8 + j
    if EVEN_K:
        ok = m_ok[:, None]
    else:
        ok = m_ok[:, None] & (j_ok & (k < K))[None, :]
    xt = tl.load(x_row + k[None, :], mask=ok, other=0.0)                   # [BLOCK_M, BLOCK_K8]
    wt = _f(bits, scale_w).to(xt.dtype)                                    # exact: bf16 values
    if SWAP:
        return tl.dot(wt, tl.trans(xt), acc, input_precision=DOT_PREC)     # [BLOCK_N, BLOCK_M]
    else:
        return tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PREC)     # [BLOCK_M, BLOCK_N]


@triton.jit
def _gemm_tile(acc, w0, w1, w2, x_row, m_ok, j, j_ok, K8, K, scale_w, SWAP: tl.constexpr, DOT_PREC: tl.constexpr,
               EVEN_K: tl.constexpr):
    t67 = _t67(w0, w1, w2)
    acc = _mma_slot(acc, w0 & HALF, x_row, m_ok, 0, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = _mma_slot(acc, (w0 << 16) & HALF, x_row, m_ok, 1, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = _mma_slot(acc, w1 & HALF, x_row, m_ok, 2, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = _mma_slot(acc, (w1 << 16) & HALF, x_row, m_ok, 3, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = _mma_slot(acc, w2 & HALF, x_row, m_ok, 4, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = _mma_slot(acc, (w2 << 16) & HALF, x_row, m_ok, 5, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = _mma_slot(acc, t67 & HALF, x_row, m_ok, 6, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = _mma_slot(acc, t67 << 16, x_row, m_ok, 7, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    return acc


@triton.jit(do_not_specialize=["M"])    # M only masks rows of x: one compiled kernel serves M = 2..BLOCK_M
def _gemm_kernel(x_ptr, q_ptr, exc_row_ptr, exc_col_ptr, exc_val_ptr, row_ptr_ptr, b_ptr, out_ptr, part_ptr,
                 M, N, K, K8, k_chunk, n_split, stride_xm, scale_w, scale_out,
                 HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 SWAP: tl.constexpr, PREFETCH: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, EXC_BLOCK: tl.constexpr, POLICY: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    rows = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    exc_lo = tl.load(row_ptr_ptr + n0)
    exc_hi = tl.load(row_ptr_ptr + tl.minimum(n0 + BLOCK_N, N))
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K8)
    q_row = q_ptr + rows[:, None] * (3 * K8)
    x_row = x_ptr + m[:, None] * stride_xm
    jj = tl.arange(0, BLOCK_K8)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w0, w1, w2 = _first_words(q_row, k_lo, jj, k_hi, K8, row_ok, EVEN_N, EVEN_K, POLICY, PREFETCH)
    for j0 in range(k_lo, k_hi, BLOCK_K8):
        j = j0 + jj
        j_ok = j < k_hi
        c0, c1, c2, w0, w1, w2 = _tile_words(q_row, j0, jj, k_hi, K8, row_ok, w0, w1, w2, BLOCK_K8, EVEN_N, EVEN_K,
                                             POLICY, PREFETCH)
        acc = _gemm_tile(acc, c0, c1, c2, x_row, m_ok, j, j_ok, K8, K, scale_w, SWAP, DOT_PREC, EVEN_K)
    acc = acc * scale_out
    exc_hi = tl.where(pid_k == 0, exc_hi, exc_lo)
    for e0 in range(exc_lo, exc_hi, EXC_BLOCK):
        e_ok, r, col, val = _escape_chunk(e0, exc_hi, exc_row_ptr, exc_col_ptr, exc_val_ptr, EXC_BLOCK)
        xv = tl.load(x_row + col[None, :], mask=m_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        contrib = xv * val[None, :]                                         # [BLOCK_M, EXC_BLOCK]
        one_hot = (r[:, None] == rows[None, :]).to(tl.float32)              # [EXC_BLOCK, BLOCK_N]
        if SWAP:
            acc = tl.dot(tl.trans(one_hot), tl.trans(contrib), acc, input_precision="ieee")
        else:
            acc = tl.dot(contrib, one_hot, acc, input_precision="ieee")
    if SWAP:
        offs = m[None, :] * N + rows[:, None]
        ok = m_ok[None, :] & row_ok[:, None]
    else:
        offs = m[:, None] * N + rows[None, :]
        ok = m_ok[:, None] & row_ok[None, :]
    if n_split > 1:
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=ok)
    else:
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            if SWAP:
                acc += bias[:, None]
            else:
                acc += bias[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _splitk_reduce(part_ptr, b_ptr, out_ptr, MN, N, n_split, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over splits of the fp32 partials, in split order (deterministic), + bias, cast once."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    y = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in range(1, n_split):
        y += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=ok)


# -- launch ---------------------------------------------------------------------------------------------------------
#
# Layout limits that the configurations respect (checked by compiling for sm_90 and reading the TTGIR/SASS):
# - GEMV: the x slices are 1-D loads; Triton keeps them in the accumulator's column layout (no shared-memory
#   conversion, no barrier in the loop) only while BLOCK_K8 < 32 * num_warps, so BLOCK_K8 <= 16 * num_warps.
# - A tile of at least 4 words a thread (BLOCK_N * BLOCK_K8 >= 128 * num_warps) keeps the loads 16 bytes wide.

N_SM = 132          # H200; it only shapes the heuristics, which the sweep checks
REDUCE_BLOCK = 1024


def gemv_config(n: int, k: int) -> dict:
    """Launch parameters for M = 1, from the H200 sweeps (docs/BENCHMARKS.md): 64 groups (512 weights) of a row a
    step with 4 warps and 16 rows a program, no register prefetch, were in the fastest configuration of the
    Llama-3-8B shapes in the third lease. Rows shrink only when they leave fewer programs than SMs (small models).
    When the rows leave fewer than ~4 programs an SM, K is split while each split keeps at least 4 tiles (4096 x
    14336: 4 splits) -- but a short K (8 to 15 tiles, 4096 x 4096) takes programs of 8 warps and 128 groups a step
    instead, unsplit: with the cheaper loop of the eighth lease that was 9.2 us against 10.6 split in two (the
    split's merge, a counter and the partials' round trip, is ~1 us of a 10 us kernel). The weights are loaded
    "evict_first" (read once; x stays in L2): faster than plain loads in the fourth and eighth leases' sweeps."""
    k8 = -(-k // 8)
    num_warps, block_k8 = (4, 64) if k8 > 32 else (2, 32)
    block_n = 16
    while block_n * block_k8 > 128 * num_warps and triton.cdiv(n, block_n) < N_SM:
        block_n //= 2
    split, tiles = 1, triton.cdiv(k8, block_k8)
    if triton.cdiv(n, block_n) < 4 * N_SM and block_n == 16 and 8 <= tiles < 16:
        num_warps, block_k8 = 8, 128
    else:
        while triton.cdiv(n, block_n) * split < 4 * N_SM and tiles >= 8 * split:
            split *= 2
    return dict(BLOCK_N=block_n, BLOCK_K8=block_k8, SPLIT_K=split, PREFETCH=0, POLICY="evict_first",
                num_warps=num_warps)


def gemm_config(m: int, n: int, k: int) -> dict:
    """Launch parameters for 1 < M: one BLOCK_M covers all of M up to 64 (weights read once); split K when N / BLOCK_N
    programs cannot fill the GPU."""
    k8 = -(-k // 8)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k8 = 64, (32 if k8 >= 32 else 16)
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split, tiles = 1, triton.cdiv(k8, block_k8)
    while programs * split < 2 * N_SM and tiles >= 8 * split:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K8=block_k8, SPLIT_K=split, SWAP=0, PREFETCH=1,
                num_warps=4)


def _split(k8: int, block_k8: int, split_k: int) -> tuple[int, int]:
    """(splits actually launched, groups a split): chunks are whole tiles and none is empty."""
    tiles = triton.cdiv(k8, block_k8)
    per = triton.cdiv(tiles, max(1, min(split_k, tiles)))
    return triton.cdiv(tiles, per), per * block_k8


_COUNTERS: dict = {}


def _split_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters, one per GEMV row block, that `_gemv_kernel` leaves zeroed: allocated once per device
    (before any CUDA-graph capture, since a shape runs eagerly first) and shared by every call. A larger set
    replaces a smaller one, which is kept alive: graphs captured with it still point at it."""
    have = _COUNTERS.get(device)
    if have is None or have[-1].numel() < n:
        fresh = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = have = (have or []) + [fresh]
    return have[-1]


def linear_fused(x: torch.Tensor, w: Packed12Linear, b: torch.Tensor | None = None, config: dict | None = None):
    """y = x @ W^T (+ b), decoding W's 12-bit words in registers. x: [..., K]. config: a gemv_config / gemm_config
    dict (what the benchmark sweeps); None picks the heuristic for the shape."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"lossless12 linear: x has {x.shape[-1]} features, the weight expects {k}")
    k8 = w.k8
    if n * 3 * k8 >= 2 ** 31:
        raise ValueError(f"lossless12 linear: {n} x {k} is too large for the kernel's int32 offsets")
    x2 = x.reshape(-1, k)
    if x2.dtype not in (torch.bfloat16, torch.float32):
        x2 = x2.float()                                  # fp16 cannot hold every bf16 weight: compute in fp32
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) % 8):
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = dict(config or (gemv_config(n, k) if m == 1 else gemm_config(m, n, k)))
    cfg.setdefault("POLICY", "")  # the weights' L2 eviction policy (the sweep tries "evict_first")
    split, k_chunk = _split(k8, cfg["BLOCK_K8"], cfg.pop("SPLIT_K", 1))
    even_n = n % cfg["BLOCK_N"] == 0
    even_k = k == 8 * k8 and k8 % cfg["BLOCK_K8"] == 0
    part = w.exc_val if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    planes = (w.q, w.exc_row, w.exc_col, w.exc_val, w.row_ptr, b if b is not None else w.exc_val, out, part)
    common = dict(HAS_BIAS=b is not None, EVEN_N=even_n, EVEN_K=even_k, EXC_BLOCK=EXC_BLOCK)
    if m == 1:
        bf16 = x2.dtype == torch.bfloat16
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
        _gemv_kernel[grid](x2.view(torch.int16) if bf16 else x2, *planes, _split_counters(grid[0], x.device), n, k,
                           k8, k_chunk, split, *w.x_scales, X_BF16=bf16, **common, **cfg)
    else:
        cfg.setdefault("BLOCK_M", 16 if m <= 16 else 32 if m <= 32 else 64)
        cfg.setdefault("SWAP", 0)
        cfg.setdefault("PREFETCH", 1)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
        prec = "ieee" if x2.dtype == torch.float32 else "tf32"   # fp32 x: no TF32 rounding; ignored for bf16
        _gemm_kernel[grid](x2, *planes, m, n, k, k8, k_chunk, split, x2.stride(0), w.scale_w, w.scale_out,
                           DOT_PREC=prec, **common, **cfg)
    if split > 1 and m > 1:  # (the GEMV's last split adds the partials itself)
        _splitk_reduce[(triton.cdiv(m * n, REDUCE_BLOCK),)](part, b if b is not None else part, out, m * n, n,
                                                            split, HAS_BIAS=b is not None,
                                                            BLOCK=REDUCE_BLOCK, num_warps=4)
    return out.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """The `linear` slot for 12-bit weights: the fused kernel on CUDA, a torch decode elsewhere (tests run the fused
    kernel on the CPU by calling linear_fused under the interpreter); a plain tensor weight goes to F.linear."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    if x.device.type == "cuda":
        return linear_fused(x, w, b)
    return F.linear(x, decode_linear_weight(w, x.dtype), b)


# -- check against torch, benchmark ---------------------------------------------------------------------------

def check(shapes=((1, 96, 128), (5, 64, 256), (17, 40, 64)), device="cpu", dtype=torch.float32, seed=0,
          config=None) -> float:
    """Max relative error of the fused kernel against F.linear on the decoded weights (random Llama-like weights
    with forced escapes). Under the interpreter use fp32 x."""
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for m, n, k in shapes:
        wb = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        wb.view(-1)[:: 97] = torch.tensor(3e4, dtype=torch.bfloat16)          # escapes in many rows
        w = to_linear_planes(wb, device)
        x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(n, generator=g).to(device=device, dtype=dtype)
        ref = F.linear(x.float(), wb.to(device).float(), b.float())
        got = linear_fused(x, w, b, config=config).float()
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return worst


# Llama-3-8B's linear shapes as (N out, K in): q/o projections, gate/up, down, LM head
LLAMA3_8B_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
L2_BYTES = 50e6

# The sweep: every GEMV tile respecting the layout limits above (num_warps, BLOCK_K8, BLOCK_N), with and without
# the register prefetch; SPLIT_K is a launch parameter (no recompile) tried where the rows give few programs.
GEMV_TILES = ((4, 64, 8), (4, 64, 16), (4, 64, 32), (4, 32, 16), (4, 32, 32), (8, 128, 8), (8, 128, 16),
              (8, 128, 32), (8, 64, 16), (8, 64, 32), (2, 32, 8), (2, 32, 16))
GEMV_SWEEP = tuple(dict(BLOCK_N=bn, BLOCK_K8=bk, PREFETCH=p, POLICY="", num_warps=w)
                   for p in (1, 0) for w, bk, bn in GEMV_TILES) + tuple(
    dict(BLOCK_N=bn, BLOCK_K8=bk, PREFETCH=p, POLICY="evict_first", num_warps=w)  # streaming weight loads
    for p in (0, 1) for w, bk, bn in ((4, 64, 16), (8, 128, 16), (4, 64, 32), (4, 32, 16), (4, 64, 8), (2, 32, 8),
                                      (2, 32, 16), (8, 64, 16), (8, 128, 32)))
# GEMM: BLOCK_M is fixed by M (one block of rows: weights read once); tile width, depth, operand order.
GEMM_SWEEP = tuple(dict(BLOCK_N=bn, BLOCK_K8=bk, SWAP=sw, PREFETCH=1, num_warps=8 if bn == 128 else 4)
                   for bn in (64, 128, 32) for bk in (32, 16) for sw in (0, 1)) + tuple(
    dict(BLOCK_N=64, BLOCK_K8=32, SWAP=sw, PREFETCH=0, num_warps=4) for sw in (0, 1))
SPLITS = (1, 2, 4, 8)


def _label(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _kernel_label(cfg: dict) -> str:
    """The compiled kernel a configuration uses (SPLIT_K is a launch parameter, not a recompile)."""
    return _label({k: v for k, v in cfg.items() if k != "SPLIT_K"})


def _sweep_configs(m: int, n: int, k: int) -> list[dict]:
    """Every configuration to time for (m, n, k), SPLIT_K included, most promising first."""
    k8 = -(-k // 8)
    out = []
    for base in (GEMV_SWEEP if m == 1 else GEMM_SWEEP):
        cfg = dict(base)
        if m > 1:
            cfg = dict(BLOCK_M=16 if m <= 16 else 32 if m <= 32 else 64, **cfg)
        programs = triton.cdiv(n, cfg["BLOCK_N"]) * (1 if m == 1 else triton.cdiv(m, cfg["BLOCK_M"]))
        for split in SPLITS:
            if split > 1 and (programs * split > 16 * N_SM or triton.cdiv(k8, cfg["BLOCK_K8"]) < 4 * split):
                continue
            out.append(dict(cfg, SPLIT_K=split))
    return out


def _graph_time(fn, n_sets: int, calls: int, replays: int = 5) -> float:
    """Device seconds per call: `calls` calls (rotating over n_sets weight copies) captured in one CUDA graph,
    replayed between CUDA events; the median replay / calls. Launch latency from the host is not in it (a graph
    launches its kernels back to back), which is what the engine sees under its own CUDA graphs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # warm-up off the capture stream (cuBLAS workspaces, JIT)
        for i in range(min(n_sets, 2)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, (read + write) bytes / s: the fastest of 7 eager copies timed with CUDA
    events, as tools/profile/calibrate.py measures it. (Captured in a CUDA graph, the same copy ran at 2.6-2.8 TB/s on the
    H200 in the eighth lease, below what the GEMVs read, so it is timed eagerly.)"""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / min(times)


def _why(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def benchmark(shapes=LLAMA3_8B_SHAPES, ms=(1, 4, 16, 64), sweep=True, budget_s: float = 200.0,
              out: str | None = None) -> dict:
    """Fused 12-bit linear vs torch bf16 F.linear (cuBLAS) on [N, K] weights: device time per call
    (`_graph_time`), weights rotated over enough copies to defeat the 50 MB L2.

    First every configuration is compiled once (one launch each on the first shape: all Llama shapes share the
    compiled kernels), so that compile time does not eat into one row's share of the budget. Then per (shape, M):
    torch, the default heuristic, and with `sweep` every configuration of `_sweep_configs`; one that fails to
    compile or launch, or gives a wrong result, is recorded in the row's `failed` and skipped, never fatal. The
    sweep stops early to keep the whole run within `budget_s` (spread evenly over the rows). TB/s counts the bytes
    each kernel moves: the 12-bit words, exception list and row offsets, x, the output and the split-K partials
    (written and read) for ours; the bf16 weight, x and the output for torch. With `out` the JSON is rewritten
    after every row, so a run cut short still leaves its rows. Refuses to time on the CPU or under the
    interpreter."""
    require_gpu_compiled(_gemv_kernel)
    t_start = time.time()
    copy_bps = copy_bandwidth()
    print(f"device copy bandwidth {copy_bps / 1e12:.2f} TB/s", flush=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  copy_tbps=copy_bps / 1e12, budget_s=budget_s, rows=[])
    rows, n_rows = result["rows"], len(shapes) * len(ms)
    broken: dict[str, str] = {}                       # kernel label -> why it failed to compile or launch
    for si, (n, k) in enumerate(shapes):
        n_sets = max(2, int(2 * L2_BYTES // (n * k * 1.5)) + 1)
        wbs = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(n_sets)]
        packed = [to_linear_planes(wb, "cuda") for wb in wbs]
        if si == 0 and sweep:                         # compile everything once, within 40% of the budget
            t_warm, seen = time.time(), set()
            for m in ms:
                xw = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for cfg in _sweep_configs(m, n, k):
                    kernel = _kernel_label(cfg)
                    if kernel in seen or time.time() - t_start > 0.4 * budget_s:
                        continue
                    seen.add(kernel)
                    try:
                        linear_fused(xw, packed[0], config=dict(cfg, SPLIT_K=1))
                        torch.cuda.synchronize()
                    except Exception as e:
                        broken[kernel] = _why(e)
            print(f"compiled the sweep in {time.time() - t_warm:.1f} s; {len(broken)} configurations failed",
                  flush=True)
        for m in ms:
            row_start = time.time()
            row_budget = (budget_s - (row_start - t_start)) / max(1, n_rows - len(rows))
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), wbs[0].float())
            ref_max = ref.abs().max().item()
            calls = max(16, min(256, int(2e-3 / (n * k * 1.5 / 3e12))))

            def ours(cfg):
                split = _split(-(-k // 8), cfg["BLOCK_K8"], cfg.get("SPLIT_K", 1))[0]
                got = linear_fused(x, packed[0], config=cfg).float()
                err = ((got - ref).abs().max() / ref_max).item()
                if not err < 2e-2:
                    raise ValueError(f"wrong result: max rel err {err:.2e}")
                t = _graph_time(lambda i: linear_fused(x, packed[i], config=cfg), n_sets, calls)
                nbytes = packed[0].nbytes + 2 * (x.numel() + m * n) + (8 * split * m * n if split > 1 else 0)
                return t, nbytes / t, err

            t_torch = _graph_time(lambda i: F.linear(x, wbs[i]), n_sets, calls)
            torch_bps = 2 * (n * k + x.numel() + m * n) / t_torch
            default = gemv_config(n, k) if m == 1 else gemm_config(m, n, k)
            timed, failed = {}, {}
            try:
                t_default, default_bps, err = ours(default)
                best = (t_default, default_bps, default)
            except Exception as e:
                failed["(default) " + _label(default)] = _why(e)
                t_default = default_bps = err = float("nan")
                best = (float("inf"), float("nan"), None)
            for cfg in (_sweep_configs(m, n, k) if sweep else ()):
                label = _label(cfg)
                if _kernel_label(cfg) in broken:
                    failed[label] = broken[_kernel_label(cfg)]
                    continue
                if time.time() - row_start > row_budget:
                    failed["(budget)"] = f"sweep stopped after {len(timed)} configurations"
                    break
                try:
                    t, bps, _ = ours(cfg)
                except Exception as e:  # out of resources, a compile error, a wrong result: not a candidate
                    failed[label] = _why(e)
                    continue
                timed[label] = round(t * 1e6, 2)
                if t < best[0]:
                    best = (t, bps, cfg)
            row = dict(n=n, k=k, m=m, torch_us=t_torch * 1e6, default_us=t_default * 1e6, best_us=best[0] * 1e6,
                       speedup_default=t_torch / t_default, speedup_best=t_torch / best[0],
                       torch_tbps=torch_bps / 1e12, default_tbps=default_bps / 1e12, best_tbps=best[1] / 1e12,
                       best_frac_of_copy=best[1] / copy_bps, max_rel_err=err,
                       default_config=default, best_config=best[2], best_variant="gemv" if m == 1 else "gemm",
                       n_timed=len(timed), sweep_us=dict(sorted(timed.items(), key=lambda kv: kv[1])),
                       failed=failed, row_s=round(time.time() - row_start, 1))
            print(json.dumps({key: v for key, v in row.items() if key not in ("sweep_us", "failed")}), flush=True)
            if failed:
                print(f"  {len(failed)} configurations failed or skipped, e.g. {next(iter(failed.items()))}",
                      flush=True)
            rows.append(row)
            result["total_s"] = round(time.time() - t_start, 1)
            if out:
                with open(out, "w") as f:
                    json.dump(result, f, indent=1)
        wbs = packed = None
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Benchmark the fused 12-bit linear kernel against torch bf16 (CUDA).")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default launch configuration")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run (sweeps stop early)")
    ap.add_argument("--ms", default="1,4,16,64", help="rows of x to time, comma-separated")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in LLAMA3_8B_SHAPES),
                    help="weight shapes NxK to time, comma-separated")
    args = ap.parse_args(argv)
    shapes = tuple(tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(","))
    result = benchmark(shapes=shapes, ms=tuple(int(v) for v in args.ms.split(",")), sweep=not args.no_sweep,
                       budget_s=args.budget, out=args.out)
    print(f"total {result.get('total_s')} s")


if __name__ == "__main__":
    main()
