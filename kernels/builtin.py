"""Built-in implementations of each kernel slot, in plain PyTorch.

A slot is a named point where the engine calls a kernel. The shapes each slot sees:
- `linear(x [..., in], w [out, in], b [out] | None) -> [..., out]`
- `rmsnorm(x [..., d], w [d], eps) -> [..., d]`: HF numerics (normalize in fp32, cast, then scale)
- `attention(q [B, Hkv, rep*T, D], k [B, Hkv, S, D], v [B, Hkv, S, D], mask bool [B, 1, rep*T, S]) -> like q`:
  the `rep` query heads sharing a kv head are stacked along the query axis (grouped-query attention without
  copying K/V); `mask` is True where a query may attend
- `accept(drafts [B, k], valid [B], logits [B, k+1, V]) -> (n_accepted [B], tokens [B, k+1])`: greedy
  verification; the row emits tokens[:, : n_accepted + 1]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def rmsnorm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def attention_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_math(q, k, v, mask):
    """Scores, fp32 softmax, weighted sum: three kernels that torch.compile can fuse around; no backend choice."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return probs.to(q.dtype) @ v


def accept_torch(drafts: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor):
    target = logits.argmax(-1)  # [B, k+1]
    k = drafts.shape[1]
    match = (drafts == target[:, :k]) & (torch.arange(k, device=drafts.device)[None] < valid[:, None])
    return match.long().cumprod(1).sum(1), target


# Decode and verify steps attend with few queries over a short cache: on the H200 the math version's graph step
# took 1.07 ms against SDPA's 1.27 ms (cuDNN's flash kernel spends ~10 us a layer on one query); docs/BENCHMARKS.md.
DEFAULTS = {"linear": "builtin:torch", "rmsnorm": "builtin:torch", "attention": "builtin:math",
            "accept": "builtin:torch"}
