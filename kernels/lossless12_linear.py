"""Fused 12-bit-weight linear layer: y = x @ W^T + b with W stored in the lossless 12-bit format.

Format (kernels/lossless12_format.py, docs/LOSSLESS12.md): per weight one byte `hi` = sign << 7 | mantissa and one 4-bit
exponent code, two codes a byte in `lo` (element 2j in the low nibble of byte j, 2j+1 in the high nibble); codes index
a 16-entry exponent table whose last entry (the escape) decodes to +0; escaped weights are listed with their exact
values and added back as a sparse correction. Decode reads 1.5 bytes a weight instead of bf16's 2: at M = 1, where a
GEMV only streams its weights, the ceiling is 2 / 1.5 = 1.33x over a bf16 GEMV.

Kernel design
- Weights are read in *pairs*: `hi` viewed as int16 gives the bytes of elements 2j and 2j+1 in one load, and byte j of
  `lo` holds both their codes, so no nibble interleaving is needed: the kernel keeps two accumulators' worth of
  products, one for even and one for odd input positions, and x is read as its even and odd halves.
- Decoding happens in registers, straight into fp32 bit patterns (bf16 is the top half of fp32, so this is exact):
      bits = (hi & 0x80) << 24 | table[code] | (hi & 0x7F) << 16,   table[c] = exponent_c << 23  (0 for the escape)
  No bf16 arithmetic is needed, which also keeps the kernel runnable by the Triton interpreter.
- M = 1 (decode): a GEMV; each program owns BLOCK_N output rows and walks K, multiplying in fp32 on the FMA units
  into a [BLOCK_N, BLOCK_K2] accumulator reduced once at the end (no per-iteration cross-lane reductions). A bf16 x
  is read as int32 pairs and split with shifts, like the weights: contiguous loads, no bf16 arithmetic.
- M > 1 (verification, prefill): the decoded tile is cast to x's dtype (exact: the weights are bf16 values) and fed to
  tensor cores with tl.dot, one dot for the even and one for the odd half.
- Escapes: the rows of a program are contiguous, so their exceptions are one contiguous range of the CSR list
  (row_ptr[n0] .. row_ptr[n0 + BLOCK_N]); each chunk of them is folded into the accumulator through a one-hot
  [chunk, BLOCK_N] matrix. An escape decodes to +0 in the main loop, so adding value * x back is exact.

The torch fallback (`decode_linear_weight` + F.linear) decodes with torch ops and calls F.linear: CPU engines use it (the interpreter
is far too slow for a whole model), and it gives bit-identical weights, hence identical logits to native bf16.
"""
from __future__ import annotations

import json
import os
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .lossless12_format import Packed12Linear, decode_linear_weight, to_linear_planes


@triton.jit
def _decode_pair(h, c, table_ptr):
    """fp32 values of the even and odd weights of each pair, from their hi bytes (int16 h) and code byte c."""
    h = h.to(tl.int32) & 0xFFFF
    c = c.to(tl.int32)
    e_even = tl.load(table_ptr + (c & 15))
    e_odd = tl.load(table_ptr + (c >> 4))
    even = ((h & 0x80) << 24) | e_even | ((h & 0x7F) << 16)
    odd = ((h & 0x8000) << 16) | e_odd | ((h & 0x7F00) << 8)
    return even.to(tl.float32, bitcast=True), odd.to(tl.float32, bitcast=True)


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
def _gemv_kernel(x_ptr, hi_ptr, lo_ptr, table_ptr, exc_row_ptr, exc_col_ptr, exc_val_ptr, row_ptr_ptr, b_ptr, out_ptr,
                 N, K2, HAS_BIAS: tl.constexpr, X_PAIRS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K2: tl.constexpr, EXC_BLOCK: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rows = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_K2), dtype=tl.float32)
    for j0 in range(0, K2, BLOCK_K2):
        j = j0 + tl.arange(0, BLOCK_K2)
        col_ok = j < K2
        if X_PAIRS:  # bf16 x read as int32 pairs: one contiguous load, split exactly into two fp32 values
            xp = tl.load(x_ptr + j, mask=col_ok, other=0)
            x_even = (xp << 16).to(tl.float32, bitcast=True)
            x_odd = (xp & -65536).to(tl.float32, bitcast=True)
        else:
            x_even = tl.load(x_ptr + 2 * j, mask=col_ok, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + 2 * j + 1, mask=col_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * K2 + j[None, :]
        h = tl.load(hi_ptr + offs, mask=ok, other=0)
        c = tl.load(lo_ptr + offs, mask=ok, other=0)
        w_even, w_odd = _decode_pair(h, c, table_ptr)
        acc += w_even * x_even[None, :] + w_odd * x_odd[None, :]
    y = tl.sum(acc, axis=1)
    # escapes of this block's rows: one contiguous range of the CSR list
    start = tl.load(row_ptr_ptr + n0)
    end = tl.load(row_ptr_ptr + tl.minimum(n0 + BLOCK_N, N))
    for e0 in range(start, end, EXC_BLOCK):
        e_ok, r, col, val = _escape_chunk(e0, end, exc_row_ptr, exc_col_ptr, exc_val_ptr, EXC_BLOCK)
        if X_PAIRS:
            xp = tl.load(x_ptr + col // 2, mask=e_ok, other=0)
            xv = tl.where(col % 2 == 0, xp << 16, xp & -65536).to(tl.float32, bitcast=True)
        else:
            xv = tl.load(x_ptr + col, mask=e_ok, other=0.0).to(tl.float32)
        contrib = val * xv
        y += tl.sum(tl.where(r[:, None] == rows[None, :], contrib[:, None], 0.0), axis=0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemm_kernel(x_ptr, hi_ptr, lo_ptr, table_ptr, exc_row_ptr, exc_col_ptr, exc_val_ptr, row_ptr_ptr, b_ptr, out_ptr,
                 M, N, K2, stride_xm, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K2: tl.constexpr, EXC_BLOCK: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = n0 + tl.arange(0, BLOCK_N)
    m_ok, row_ok = m < M, rows < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, K2, BLOCK_K2):
        j = j0 + tl.arange(0, BLOCK_K2)
        col_ok = j < K2
        x_offs = m[:, None] * stride_xm + 2 * j[None, :]
        x_mask = m_ok[:, None] & col_ok[None, :]
        x_even = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + x_offs + 1, mask=x_mask, other=0.0)
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * K2 + j[None, :]
        h = tl.load(hi_ptr + offs, mask=ok, other=0)
        c = tl.load(lo_ptr + offs, mask=ok, other=0)
        w_even, w_odd = _decode_pair(h, c, table_ptr)
        # exact casts: every decoded weight is a bf16 value
        acc = tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)), acc)
        acc = tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)), acc)
    start = tl.load(row_ptr_ptr + n0)
    end = tl.load(row_ptr_ptr + tl.minimum(n0 + BLOCK_N, N))
    for e0 in range(start, end, EXC_BLOCK):
        e_ok, r, col, val = _escape_chunk(e0, end, exc_row_ptr, exc_col_ptr, exc_val_ptr, EXC_BLOCK)
        xv = tl.load(x_ptr + m[:, None] * stride_xm + col[None, :], mask=m_ok[:, None] & e_ok[None, :], other=0.0)
        contrib = xv.to(tl.float32) * val[None, :]                                  # [BLOCK_M, EXC_BLOCK]
        one_hot = (r[:, None] == rows[None, :]).to(tl.float32)                      # [EXC_BLOCK, BLOCK_N]
        acc = tl.dot(contrib, one_hot, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


EXC_BLOCK = 16


def gemv_config(n: int, k: int) -> dict:
    """Launch parameters for M = 1: enough programs to fill a GPU (~130 SMs, a few programs each) before wide tiles."""
    block_n = 16
    while block_n > 2 and triton.cdiv(n, block_n) < 512:
        block_n //= 2
    return dict(BLOCK_N=block_n, BLOCK_K2=min(256, triton.next_power_of_2(k // 2)), num_warps=4)


def gemm_config(m: int, n: int, k: int) -> dict:
    return dict(BLOCK_M=16 if m <= 16 else 32 if m <= 32 else 64, BLOCK_N=64, BLOCK_K2=32, num_warps=4)


def linear_fused(x: torch.Tensor, w: Packed12Linear, b: torch.Tensor | None = None, config: dict | None = None):
    """y = x @ W^T (+ b), decoding W's 12-bit planes in registers. x: [..., K] contiguous in its last dimension."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"lossless12 linear: x has {x.shape[-1]} features, the weight expects {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = (w.hi16, w.lo, w.table, w.exc_row, w.exc_col, w.exc_val, w.row_ptr, b if b is not None else w.exc_val)
    if m == 1:
        cfg = config or gemv_config(n, k)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
        pairs = x2.dtype == torch.bfloat16
        _gemv_kernel[grid](x2.view(torch.int32) if pairs else x2, *args, out, n, k // 2, HAS_BIAS=b is not None,
                           X_PAIRS=pairs, EXC_BLOCK=EXC_BLOCK, **cfg)
    else:
        cfg = config or gemm_config(m, n, k)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
        _gemm_kernel[grid](x2, *args, out, m, n, k // 2, x2.stride(0), out.stride(0), HAS_BIAS=b is not None,
                           EXC_BLOCK=EXC_BLOCK, **cfg)
    return out.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """The `linear` slot for 12-bit weights: the fused kernel on CUDA, a torch decode elsewhere (tests run the fused
    kernel on the CPU by calling linear_fused under the interpreter); a plain tensor weight goes to F.linear."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    if x.device.type == "cuda":
        return linear_fused(x, w, b)
    return F.linear(x, decode_linear_weight(w, x.dtype), b)


# -- check against torch and benchmark --------------------------------------------------------------------------

def check(shapes=((1, 96, 128), (5, 64, 256), (17, 40, 64)), device="cpu", dtype=torch.float32, seed=0) -> float:
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
        got = linear_fused(x, w, b).float()
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return worst


# Llama-3-8B's linear shapes as (N out, K in): q/o projections, gate/up, down, LM head
LLAMA3_8B_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
GEMV_SWEEP = tuple(dict(BLOCK_N=bn, BLOCK_K2=bk, num_warps=w) for bn in (4, 8, 16, 32) for bk in (128, 256, 512)
                   for w in (4, 8))
GEMM_SWEEP = tuple(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K2=bk, num_warps=w) for bm in (16, 64) for bn in (64, 128)
                   for bk in (32, 64) for w in (4, 8))


def benchmark(shapes=LLAMA3_8B_SHAPES, ms=(1, 4, 16, 64), reps=200, sweep=True) -> list[dict]:
    """Fused 12-bit linear vs torch bf16 matmul (cuBLAS) on [N, K] weights: CUDA events, median of `reps`, weights
    rotated over enough copies to defeat the 50 MB L2. With `sweep`, every launch configuration of GEMV_SWEEP /
    GEMM_SWEEP is timed and the fastest is reported beside the default heuristic's. Refuses to time on the CPU or
    under the interpreter."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("benchmark() times on a CUDA GPU only, never on the CPU or under the interpreter")

    def timed(fn, n_sets):
        for i in range(3):
            fn(i % n_sets)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            fn(i % n_sets)
            ends[i].record()
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2] * 1e-3

    rows = []
    for n, k in shapes:
        n_sets = max(2, int(2 * 50e6 // (n * k * 1.5)) + 1)
        wbs = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(n_sets)]
        packed = [to_linear_planes(wb, "cuda") for wb in wbs]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, wbs[0]).float()
            err = ((linear_fused(x, packed[0]).float() - ref).abs().max() / ref.abs().max()).item()
            t_torch = timed(lambda i: F.linear(x, wbs[i]), n_sets)
            default = gemv_config(n, k) if m == 1 else gemm_config(m, n, k)
            t_default = timed(lambda i: linear_fused(x, packed[i]), n_sets)
            best_t, best_cfg = t_default, default
            for cfg in ((GEMV_SWEEP if m == 1 else GEMM_SWEEP) if sweep else ()):
                try:
                    t = timed(lambda i: linear_fused(x, packed[i], config=cfg), n_sets)
                except Exception:  # e.g. out of shared memory for this tile: not a candidate
                    continue
                if t < best_t:
                    best_t, best_cfg = t, cfg
            ours_bytes = packed[0].nbytes + (x.numel() + m * n) * 2
            torch_bytes = (n * k + x.numel() + m * n) * 2
            row = dict(n=n, k=k, m=m, torch_us=t_torch * 1e6, default_us=t_default * 1e6, best_us=best_t * 1e6,
                       speedup_default=t_torch / t_default, speedup_best=t_torch / best_t,
                       torch_tbps=torch_bytes / t_torch / 1e12, best_tbps=ours_bytes / best_t / 1e12,
                       max_rel_err=err, default_config=default, best_config=best_cfg)
            print(json.dumps(row), flush=True)
            rows.append(row)
        wbs = packed = None
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Benchmark the fused 12-bit linear kernel against torch bf16 (CUDA).")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default launch configuration")
    args = ap.parse_args()
    result = benchmark(sweep=not args.no_sweep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": result}, f, indent=1)
