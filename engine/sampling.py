"""Token selection and acceptance rules: greedy, and standard speculative sampling.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x ~ q is accepted with probability
min(1, p(x)/q(x)); at the first rejection the token is drawn from norm(max(p - q, 0)); if all drafts are accepted a
bonus token is drawn from p. The emitted tokens are distributed exactly as sampling from p alone. Here p and q are
the *warped* distributions (temperature, top-k, top-p), so the target distribution is the one plain sampling with
the same parameters would use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped next-token distribution in fp32 over the last dimension."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def accept_sampled(drafts: torch.Tensor, valid: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                   params: SamplingParams, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling. Returns (n_accepted [B], tokens [B, k+1]): the row emits tokens[:, : n_accepted + 1]."""
    B, k = drafts.shape
    p = probabilities(logits, params)  # [B, k+1, V]
    ar = torch.arange(k, device=drafts.device)[None]
    if draft_probs is None:  # a deterministic drafter: q is one-hot at its proposal
        draft_probs = torch.zeros_like(p[:, :k]).scatter_(-1, drafts[..., None], 1.0)
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand((B, k), generator=generator, device=drafts.device)
    ok = (u * q_d < p_d) & (ar < valid[:, None])  # u < p/q without dividing by a zero q
    n_accepted = ok.long().cumprod(1).sum(1)
    rows = torch.arange(B, device=drafts.device)
    at = n_accepted.clamp(max=k - 1) if k else n_accepted
    residual = (p[:, :k] - draft_probs).clamp(min=0)[rows, at] if k else p[rows, n_accepted]
    rejected = n_accepted < valid  # the draft at `n_accepted` was proposed and refused
    dist = torch.where(rejected[:, None], residual, p[rows, n_accepted])
    # p == q at that token leaves no residual mass; the draft was then certain to be accepted, so this is unreachable
    # except through rounding: fall back to p.
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p[rows, n_accepted])
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    tokens = torch.cat([drafts, drafts[:, :1]], 1) if k else last[:, None].clone()
    tokens[rows, n_accepted] = last
    return n_accepted, tokens
