"""RMSNorm in Triton: the `rmsnorm` kernel slot, one program per row.

`rmsnorm(x [..., d], w [d], eps) -> [..., d]` must reproduce HF's numerics exactly (and so
`builtin.rmsnorm_torch`), because the engine promises the same greedy tokens as HF's model:

    xf = x.float()
    xf = xf * rsqrt(mean(xf ** 2) + eps)     # in fp32
    y  = w * xf.to(x.dtype)                  # cast first, then scale in the model dtype

The order of the two roundings matters in bf16: the normalized row is rounded to bf16 *before* the weight multiplies
it. The kernel keeps that order. The final product of two bf16 (or fp16) values is exact in fp32 (8 + 8, or 11 + 11,
significant bits fit in fp32's 24), so multiplying in fp32 and rounding once to the output dtype is exactly what
PyTorch's bf16 multiply does. Only the sum of squares is reduced in a different order than PyTorch's, a last-bit difference in fp32.

Design. The engine normalizes at most a few thousand rows of d = 576..8192 per call (B x T tokens, or B x T x heads
for Qwen3's per-head q/k norm with d = head_dim), so a row fits in one block of registers: one program loads its
row once, reduces it, and writes it once. That is the minimum traffic (read x and w, write y) and one launch, where
the PyTorch version launches several elementwise and reduction kernels and re-reads x from memory between them.

Inside the Triton interpreter (CPU, TRITON_INTERPRET=1) there is no bf16 arithmetic, so the kernel does all math in
fp32: it loads, widens to fp32, and narrows only where HF's numerics round (and on the final store).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import require_gpu_compiled


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, x_row_stride, y_row_stride, d, EPS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < d
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    # Padding lanes hold 0 and add nothing to the sum of squares; divide by the true width d.
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / d + EPS)
    # HF rounds the normalized row to the input dtype before scaling by w (a no-op for fp32 inputs).
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=in_row)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm of each row of x [..., d] scaled by w [d]; the output has torch's dtype for `w * x`."""
    d = x.shape[-1]
    # A view whenever the leading dims merge into one row stride (every contiguous activation); Qwen3's q/k heads,
    # sliced out of the fused qkv projection, do not merge and are copied once here.
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = w.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    block_d = triton.next_power_of_2(d)
    if rows.shape[0] > 0:
        # Warps as in Triton's layer-norm tutorial: one per 256 columns, 1..8 (a thread holds at most 32
        # values up to d = 8192).
        # eps is a compile-time constant (one per model), so it is an fp32 literal however the launch passes Python
        # floats (torch.compile passes them as fp64, which would turn the normalization into fp64).
        _rmsnorm_kernel[(rows.shape[0],)](rows, w, out, rows.stride(0), out.stride(0), d, EPS=eps, BLOCK_D=block_d,
                                          num_warps=min(max(block_d // 256, 1), 8))
    return out.view(x.shape)


# -- checking and timing -----------------------------------------------------------------------------------------
def check(shapes=((1, 1, 64), (3, 5, 96), (2, 4, 3, 16)), dtype=torch.float32, device: str = "cpu",
          eps: float = 1e-6) -> None:
    """Compare with builtin.rmsnorm_torch on random inputs; raises AssertionError on a mismatch. fp32 inputs on CPU
    (the interpreter) or any float dtype on a GPU."""
    from .builtin import rmsnorm_torch

    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        w = (1.0 + 0.1 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=dtype)
        want, got = rmsnorm_torch(x, w, eps), rmsnorm(x, w, eps)
        assert got.dtype == want.dtype and got.shape == want.shape, (shape, got.dtype, got.shape)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"rmsnorm {shape} {dtype}: {m}")


def benchmark(rows=(1, 8, 64, 512), d: int = 576, dtype=torch.bfloat16, eps: float = 1e-5) -> list[dict]:
    """Milliseconds per call of this kernel and of builtin.rmsnorm_torch on `rows` x d inputs (d defaults to
    SmolLM2-135M's hidden size), each captured in a CUDA graph and timed by triton.testing.do_bench_cudagraph with
    CUDA events (the engine replays its steps as CUDA graphs); GPU only."""
    from triton.testing import do_bench_cudagraph

    from .builtin import rmsnorm_torch

    require_gpu_compiled(_rmsnorm_kernel)
    check(dtype=dtype, device="cuda")
    results = []
    for n in rows:
        x = torch.randn(n, d, device="cuda", dtype=dtype)
        w = torch.randn(d, device="cuda", dtype=dtype)
        results.append({"rows": n, "d": d, "dtype": str(dtype).removeprefix("torch."),
                        "triton_ms": do_bench_cudagraph(lambda: rmsnorm(x, w, eps)),
                        "torch_ms": do_bench_cudagraph(lambda: rmsnorm_torch(x, w, eps))})
    return results


if __name__ == "__main__":
    for r in benchmark():
        print(r)
