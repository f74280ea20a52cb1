"""Honest candidate: rmsnorm as a Triton kernel, one program per row (runs under TRITON_INTERPRET=1 on CPU).

HF numerics like the built-in: the row is normalized in fp32, cast to x's dtype, then scaled by w.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, d, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < d
    x = tl.load(x_ptr + row * d + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * d + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=inside)


def rmsnorm(x, w, eps):
    d = x.shape[-1]
    x2 = x.contiguous().view(-1, d)
    out = torch.empty_like(x2)
    rmsnorm_kernel[(x2.shape[0],)](x2, w.contiguous(), out, d, eps, BLOCK=triton.next_power_of_2(d))
    return out.view(x.shape)


def _launch_example():
    """One launch on small inputs, so that compile_triton can compile the kernel and read its resources."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(4, 64, device=device)
    return rmsnorm(x, torch.ones(64, device=device), 1e-5)
