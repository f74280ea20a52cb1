"""GEMV in Triton: the `linear` kernel slot for one row of activations (M = 1, AR decoding).

`linear(x [..., K], w [N, K], b [N] | None) -> [..., N]`, y = x @ w.T + b, accumulated in fp32.

Why a GEMV of our own. A decoding step of a small model is a chain of small GEMVs: SmolLM2-135M's are 0.7-3.5 MB
each, 0.2-0.9 µs of weight traffic at 4 TB/s, yet cuBLAS takes about 3.8 µs for each of them on the H200
(docs/BENCHMARKS.md, third lease): it tiles N by 64 output rows, so its 960-row q/k/v projection runs as 15 thread
blocks on a 132-SM GPU and each block walks the whole of K alone. The step is latency-bound, and latency falls with
parallelism: here each program owns only BLOCK_N rows (chosen so that a few hundred programs run at once) and takes
all of K in one or two wide tiles, so every SM issues its loads at the start and the kernel ends one DRAM round trip
later.

Design
- Each program loads a [BLOCK_N, BLOCK_K] tile of w and the matching BLOCK_K values of x, multiplies on the FMA units
  in fp32 into a [BLOCK_N, BLOCK_K] accumulator, and reduces it across K once after the loop (no per-iteration
  cross-lane reductions).
- BLOCK_K is K rounded up to a power of two, at most 1024: SmolLM2's K = 576 and 1536 take one and two iterations.
- M > 1 (verification, prefill) goes to F.linear: those GEMMs are tensor-core work that cuBLAS does well.
- Off the GPU `linear` is F.linear as well (the interpreter is far too slow for a whole model); tests call
  `gemv` directly under the interpreter, in fp32 (the interpreter has no bf16 arithmetic).

Numerics: fp32 accumulation like cuBLAS, in a different order, so bf16 outputs can differ from F.linear in the last
bit; the token-forcing gate tells such near-ties from real divergences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .timing import require_gpu_compiled


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv_config(n: int, k: int) -> dict:
    """BLOCK_K: all of K up to 1024 per iteration. BLOCK_N: the widest tile that still gives at least 256 programs,
    about two per SM, so that every SM has loads in flight, and whose BLOCK_N x BLOCK_K tile is at most 4096 values:
    32 a thread with 4 warps, in registers for the accumulator and as many for the loaded weights."""
    block_k = min(triton.next_power_of_2(k), 1024)
    block_n = max(1, min(16, 4096 // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < 256:
        block_n //= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """y = x @ w.T (+ b) for x with one row ([K] or [1, ..., 1, K]); w [N, K] with unit stride along K."""
    n, k = w.shape
    if x.numel() != k:
        raise ValueError(f"triton gemv: x has {x.numel()} values, one row of {k} expected")
    if w.stride(1) != 1:
        w = w.contiguous()
    xv = x.reshape(k)
    if xv.stride(0) != 1:
        xv = xv.contiguous()
    out = torch.empty(n, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    cfg = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](xv, w, b if b is not None else w, out, n, k, w.stride(0),
                                                    HAS_BIAS=b is not None, **cfg)
    return out.view(*x.shape[:-1], n)


# Above this many weights cuBLAS streams well and wins: on the H200 SmolLM2's 49152 x 576 LM head took 15.8 µs with
# cuBLAS and 24.6 µs here, while the layers' GEMVs (0.3-1.8 M weights) were 1.13-1.76x faster here
# (docs/BENCHMARKS.md, third lease).
GEMV_MAX_WEIGHTS = 4 << 20


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The `linear` slot: this GEMV for one row and a small weight on a GPU, F.linear otherwise."""
    if x.device.type == "cuda" and x.numel() == x.shape[-1] and w.numel() <= GEMV_MAX_WEIGHTS:
        return gemv(x, w, b)
    return F.linear(x, w, b)


# -- checking and timing -----------------------------------------------------------------------------------------
def check(shapes=((96, 64), (37, 576), (130, 1536), (5, 2100)), dtype=torch.float32, device: str = "cpu") -> float:
    """Max relative error of `gemv` against F.linear in float64 on random inputs (with and without bias); fp32 on the
    CPU (the interpreter) or any float dtype on a GPU. Raises AssertionError beyond the dtype's tolerance."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for n, k in shapes:
        w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype)
        x = torch.randn(1, k, generator=g).to(device=device, dtype=dtype)
        for b in (None, torch.randn(n, generator=g).to(device=device, dtype=dtype)):
            want = F.linear(x.double(), w.double(), None if b is None else b.double())
            got = gemv(x, w, b)
            assert got.shape == (1, n) and got.dtype == dtype, (got.shape, got.dtype)
            err = float((got.double() - want).abs().max() / want.abs().max())
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert err <= tol, f"triton gemv [{n}, {k}] {dtype}: relative error {err:.2e} > {tol}"
            worst = max(worst, err)
    return worst


# SmolLM2-135M's linear shapes as (N out, K in): q/k/v fused, o, gate/up fused, down, LM head
SMOLLM2_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def benchmark(shapes=SMOLLM2_SHAPES, dtype=torch.bfloat16) -> list[dict]:
    """Microseconds per call of `gemv` and of F.linear (cuBLAS) at M = 1, each captured in a CUDA graph of calls on
    weight copies cycled beyond the 50 MB L2 (triton.testing.do_bench_cudagraph); GPU only, never the interpreter."""
    from triton.testing import do_bench_cudagraph

    require_gpu_compiled(_gemv_kernel)
    check(dtype=dtype, device="cuda")
    rows = []
    for n, k in shapes:
        copies = max(1, int(4 * 50e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=dtype)

        def each(fn):
            return lambda: [fn(x, w) for w in ws]

        ours = do_bench_cudagraph(each(gemv)) * 1e3 / copies
        theirs = do_bench_cudagraph(each(F.linear)) * 1e3 / copies
        rows.append(dict(n=n, k=k, triton_us=ours, torch_us=theirs, speedup=theirs / ours,
                         triton_tbps=n * k * 2 / ours / 1e6, config=gemv_config(n, k)))
    return rows


if __name__ == "__main__":
    for r in benchmark():
        print(r)
