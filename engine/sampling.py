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

# splitmix64's constants (as signed int64: torch has no uint64 arithmetic; products wrap alike)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: every output bit depends on every input bit."""
    z = z + _GOLDEN
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    return z ^ _shift(z, 31)


class CounterRng:
    """Random draws as a function of (seed, the row's salt, the row's length, the draw's stream, its index): no
    generator state, only tensors read when the draw runs. So a sampled step captured in a CUDA graph draws anew at
    every replay (the rows' lengths have moved on), a request's draws never repeat (its length grows every step; each
    request its own salt), and the same seed gives the same tokens. One is made for each step (at capture: for the
    graph): streams count the step's draws in the order the code makes them, the same at every replay. `seed` [1],
    `salt` and `lengths` [rows], int64, on the device."""

    def __init__(self, seed: torch.Tensor, salt: torch.Tensor, lengths: torch.Tensor):
        self.seed, self.salt, self.lengths = seed, salt, lengths
        self.stream = 0

    def uniform(self, shape) -> torch.Tensor:
        """[rows, n] uniform in (0, 1), float32 (24 random bits, never 0 or 1); a new stream each call."""
        rows, n = shape
        self.stream += 1
        base = _mix(_mix(self.seed + self.salt[:rows] * _GOLDEN) + self.lengths[:rows])  # one per row and step
        # The draw's key: base ^ (stream << 40 | index). The stream goes into the row's int64 value, not the index:
        # compiled for the GPU, `arange(n) + (stream << 40)` became an int32 index plus a 41-bit constant, which
        # Triton refuses (H200, twenty-second lease: every replay recipe failed its warm-up).
        z = _mix((base ^ (self.stream << 40))[:, None] ^ torch.arange(n, device=base.device)[None, :])
        return (_shift(z, 40).float() + 0.5) * (1.0 / (1 << 24))


def uniform(shape, generator, device) -> torch.Tensor:
    """Uniform draws of `shape` [rows, n]: from a CounterRng, or torch.rand with a torch.Generator (or the default)."""
    if isinstance(generator, CounterRng):
        return generator.uniform(shape)
    return torch.rand(shape, generator=generator, device=device)


def categorical(weights: torch.Tensor, generator) -> torch.Tensor:
    """One index a row of `weights` [rows, V] (non-negative, not normalized), drawn with probability weight / sum:
    with a CounterRng as the race of exponential clocks, argmax w_i / E_i with E_i ~ Exp(1) (no host sync, no
    generator state: capturable); else torch.multinomial."""
    if isinstance(generator, CounterRng):
        clocks = -torch.log(generator.uniform(tuple(weights.shape)))
        return (weights / clocks).argmax(-1)
    return torch.multinomial(weights, 1, generator=generator).squeeze(1)


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
                   params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling. Returns (n_accepted [B], tokens [B, k+1]): the row emits tokens[:, : n_accepted + 1].
    `generator`: a CounterRng, a torch.Generator or None (torch's default)."""
    B, k = drafts.shape
    p = probabilities(logits, params)  # [B, k+1, V]
    ar = torch.arange(k, device=drafts.device)[None]
    if draft_probs is None:  # a deterministic drafter: q is one-hot at its proposal
        draft_probs = torch.zeros_like(p[:, :k]).scatter_(-1, drafts[..., None], 1.0)
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    u = uniform((B, k), generator, drafts.device)
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
    last = categorical(dist, generator)
    tokens = torch.cat([drafts, drafts[:, :1]], 1) if k else last[:, None].clone()
    tokens[rows, n_accepted] = last
    return n_accepted, tokens
