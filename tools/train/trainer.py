"""EAGLE-3's training-time test, the optimizer loop, held-out acceptance and checkpoints.

Pairs as the engine drafts (engine/eagle3.py's module docstring): at index t the head reads the target's fused
state of token t with the embedding of token t + 1 and predicts token t + 2. Unrolled for `ttt_steps` steps as
SpecForge's OnlineEagle3Model does: step 0 reads the target's states; step j > 0 reads the head's own step j - 1
output at t with the true token t + 1 + j and predicts token t + 2 + j. Attention: step j at index t sees step 0's
entries of indices 0..t and its own chain's entries of steps 1..j at index t (SpecForge's cache of earlier steps,
visible on the diagonal only). Positions: step j sits at position t + j, where the engine's j-th draft step sits
(SpecForge keeps position t for every step; at decode time the head's cache has the draft at t + j, so this trains
the function the engine runs). The unroll runs engine/eagle3.py's own `midlayer` with a cache of one slot per
(step, index) and that visibility mask.

Loss (SpecForge): at each step, the cross-entropy of the head's draft-vocabulary distribution against the target's
distribution restricted to the draft vocabulary (softmax of the target's logits at those rows: forward KL up to
the target's entropy), averaged over answer tokens whose target argmax is in the draft vocabulary; steps weighted
0.8 ** j and summed. AdamW (betas 0.9, 0.95, no weight decay), linear warm-up over the first WARMUP of the steps
then cosine decay to 0, gradients clipped at norm 0.5 (SpecForge's max_grad_norm). Batches follow a seeded
permutation of the samples per epoch, so a run's batch at step s depends only on the seed and s: with the
optimizer's state in the checkpoint, a resumed run is the uninterrupted one.

Held-out acceptance: on held-out samples, the share of answer positions where the head's first draft (step 0, on
the target's states) is the target's greedy next token: what a chain's first draft would have had accepted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...engine.eagle3 import draft_logits, fuse, midlayer
from ...kernels import Kernels
from ...kernels.builtin import accept_torch, attention_sdpa, linear_torch, rmsnorm_torch
from .data import Sample
from .head import TrainableHead

OPS = Kernels(linear_torch, rmsnorm_torch, attention_sdpa, accept_torch)  # differentiable, any device
STEP_WEIGHT = 0.8
WARMUP = 0.05
MAX_GRAD_NORM = 0.5


@dataclass(frozen=True)
class Schedule:
    steps: int
    ttt_steps: int
    lr: float
    batch_size: int
    seed: int
    checkpoint_every: int
    log_every: int


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T + U] right-padded with 0
    states: torch.Tensor  # [B, T + U, 3 H] fp32
    final: torch.Tensor  # [B, T + U, H] fp32
    greedy: torch.Tensor  # [B, T + U]
    prompt_len: torch.Tensor  # [B]
    length: torch.Tensor  # [B]


def collate(samples: list[Sample], pad: int, device) -> Batch:
    """Samples right-padded to the longest plus `pad` slots (the unrolled steps read up to ttt_steps past it)."""
    T = max(s.tokens.numel() for s in samples) + pad

    def padded(get, dtype):
        return torch.stack([F.pad(get(s).to(dtype), (0, 0) * (get(s).dim() - 1) + (0, T - s.tokens.numel()))
                            for s in samples]).to(device)

    return Batch(padded(lambda s: s.tokens, torch.long), padded(lambda s: s.states, torch.float32),
                 padded(lambda s: s.final, torch.float32), padded(lambda s: s.greedy, torch.long),
                 torch.tensor([s.prompt_len for s in samples], device=device),
                 torch.tensor([s.tokens.numel() for s in samples], device=device))


def target_probs(batch: Batch, target_norm: torch.Tensor, eps: float, target_rows: torch.Tensor) -> torch.Tensor:
    """The target's distribution over the draft vocabulary after each token [B, T + U, Vd]."""
    logits = OPS.linear(OPS.rmsnorm(batch.final, target_norm, eps), target_rows, None)
    return logits.softmax(-1)


def unrolled_logits(head: TrainableHead, batch: Batch, steps: int) -> list[torch.Tensor]:
    """The head unrolled for `steps` steps over every pair index t = 0..n-1 at once (module docstring): step j's
    draft logits [B, n, Vd], predicting token t + 2 + j."""
    B = batch.tokens.shape[0]
    n = batch.tokens.shape[1] - steps - 1  # the longest sample's pairs: tokens 0..T-2 (collate padded by steps)
    device = batch.tokens.device
    t = torch.arange(n, device=device)
    head.ensure_rope(n + steps)
    # slot i * n + u holds step i's entry of index u; step j at index t sees step 0's u <= t and steps 1..j's u == t
    slot_step, slot_index = torch.arange(steps * n, device=device).div(n, rounding_mode="floor"), t.repeat(steps)
    causal = (slot_step[None] == 0) & (slot_index[None] <= t[:, None])
    diagonal = (slot_step[None] > 0) & (slot_index[None] == t[:, None])
    kv = torch.zeros(2, B, head.cfg.n_kv_heads, steps * n, head.cfg.head_dim, device=device)
    hidden = fuse(head, batch.states[:, :n], OPS)
    logits = []
    for j in range(steps):
        visible = (causal | diagonal & (slot_step[None] <= j))[None].expand(B, n, steps * n)
        kv = kv.clone()  # the earlier steps' attention saved the cache for backward: each step writes a copy
        hidden = midlayer(head, batch.tokens[:, 1 + j: 1 + j + n], hidden, (t + j)[None].expand(B, n), kv, OPS,
                          slots=(t + j * n)[None].expand(B, n), visible=visible)
        logits.append(draft_logits(head, hidden, OPS))
    return logits


def ttt_losses(head: TrainableHead, batch: Batch, probs: torch.Tensor, in_vocab: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
    """The loss of each unrolled step (module docstring)."""
    losses = []
    for j, logits in enumerate(unrolled_logits(head, batch, steps)):
        n = logits.shape[1]
        predicted = torch.arange(n, device=logits.device)[None] + 2 + j  # the index of the token predicted
        mask = (predicted < batch.length[:, None]) & (predicted >= batch.prompt_len[:, None]) \
            & in_vocab[batch.greedy[:, 1 + j: 1 + j + n]]
        ce = -(probs[:, 1 + j: 1 + j + n] * logits.float().log_softmax(-1)).sum(-1)
        losses.append((ce * mask).sum() / mask.sum().clamp(min=1))
    return losses


@torch.no_grad()
def first_draft_acceptance(head: TrainableHead, samples: list[Sample], batch_size: int) -> float:
    """Held-out acceptance (module docstring)."""
    hits = total = 0
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i: i + batch_size], 0, head.device)
        B, T = batch.tokens.shape
        n = T - 1
        head.ensure_rope(n)
        kv = torch.zeros(2, B, head.cfg.n_kv_heads, n, head.cfg.head_dim, device=head.device)
        positions = torch.arange(n, device=head.device)[None].expand(B, n)
        out = midlayer(head, batch.tokens[:, 1:], fuse(head, batch.states[:, :n], OPS), positions, kv, OPS)
        drafts = head.draft_to_target[draft_logits(head, out, OPS).argmax(-1)]
        predicted = positions + 2
        mask = (predicted < batch.length[:, None]) & (predicted >= batch.prompt_len[:, None])
        hits += int(((drafts == batch.greedy[:, 1:]) & mask).sum())
        total += int(mask.sum())
    return hits / max(total, 1)


def learning_rate(schedule: Schedule, step: int) -> float:
    warm = max(1, int(WARMUP * schedule.steps))
    if step < warm:
        return schedule.lr * (step + 1) / warm
    return schedule.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, schedule.steps - warm)))


def batch_indices(n_samples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Samples step*B .. step*B + B - 1 of the endless sequence of seeded per-epoch permutations."""
    orders: dict[int, torch.Tensor] = {}  # the epochs this batch reaches into
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, at = divmod(i, n_samples)
        if epoch not in orders:
            orders[epoch] = torch.randperm(n_samples,
                                           generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(orders[epoch][at]))
    return out


def train(head: TrainableHead, target, samples: list[Sample], heldout: list[Sample], schedule: Schedule,
          checkpoint: Path, resume_from: dict | None, progress) -> list[dict]:
    """Train `head` in place for schedule.steps steps (from the checkpoint's step when resuming), writing the
    checkpoint every schedule.checkpoint_every steps and at the end; `progress(entry)` gets each log entry
    (step, loss, per-step losses, held-out acceptance, learning rate). Returns the entries logged."""
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = 0
    if resume_from is not None:
        head.load_state_dict(resume_from["head"])
        optimizer.load_state_dict(resume_from["optimizer"])
        start = resume_from["step"]
    model = target.model
    target_rows = model.lm_head.detach()[head.draft_to_target].float()
    target_norm = model.norm.detach().float()
    in_vocab = torch.zeros(head.cfg.vocab_size, dtype=torch.bool, device=head.device)
    in_vocab[head.draft_to_target] = True
    entries = []
    for step in range(start, schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(schedule, step)
        chosen = [samples[i] for i in batch_indices(len(samples), schedule.batch_size, schedule.seed, step)]
        batch = collate(chosen, schedule.ttt_steps, head.device)
        probs = target_probs(batch, target_norm, model.cfg.rms_eps, target_rows)
        losses = ttt_losses(head, batch, probs, in_vocab, schedule.ttt_steps)
        loss = sum(STEP_WEIGHT ** j * l for j, l in enumerate(losses))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        done = step + 1
        if done % schedule.checkpoint_every == 0 or done == schedule.steps:
            save_checkpoint(checkpoint, head, optimizer, done)
        if done % schedule.log_every == 0 or done == schedule.steps or step == start:
            entry = {"step": done, "steps": schedule.steps, "loss": float(loss.detach()),
                     "step_losses": [round(float(l.detach()), 4) for l in losses], "lr": learning_rate(schedule, step),
                     "heldout_acceptance": first_draft_acceptance(head, heldout, schedule.batch_size)}
            entries.append(entry)
            progress(entry)
    return entries


def save_checkpoint(path: Path, head: TrainableHead, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, device) -> dict:
    return torch.load(path, map_location=device, weights_only=True)
