"""EAGLE-3's training-time test, the optimizer loop, held-out acceptance and checkpoints.

Pairs as the engine drafts (engine/eagle3.py's module docstring): at index t the head reads the target's fused
state of token t with the embedding of token t + 1 and predicts token t + 2. Unrolled for `ttt_steps` steps as
SpecForge's OnlineEagle3Model does: step 0 reads the target's states; step j > 0 reads the head's own step j - 1
output at t with the true token t + 1 + j and predicts token t + 2 + j. Attention: step j at index t sees step 0's
entries of indices 0..t and its own chain's entries of steps 1..j at index t (SpecForge's cache of earlier steps,
visible on the diagonal only). Positions: step j sits at position t + j, where the engine's j-th draft step sits
(SpecForge keeps position t for every step; at decode time the head's cache has the draft at t + j, so this trains
the function the engine runs). The unroll runs engine/eagle3.py's own `midlayer` with `ttt_attention` in place of
its cache and SDPA, computed as SpecForge's llama3_eagle computes it: the scores of step 0's keys u < t by one matmul
under a causal mask, those of steps 0..j's keys at t by one dot product each, one softmax over both. That is
n * n + n * (j + 1) scores at step j, where SDPA over a cache of one slot per (step, index) under the visibility
mask scored n * steps * n, nearly all of them masked out (~7x the attention FLOPs at the default 7 steps).

Loss (SpecForge): at each step, the cross-entropy of the head's draft-vocabulary distribution against the target's
distribution restricted to the draft vocabulary (softmax of the target's logits at those rows: forward KL up to
the target's entropy), averaged over answer tokens whose target argmax is in the draft vocabulary; steps weighted
0.8 ** j and summed. AdamW (betas 0.9, 0.95, no weight decay), linear warm-up over the first WARMUP of the steps
then cosine decay to 0, gradients clipped at norm 0.5 (SpecForge's max_grad_norm). Batches follow a seeded
permutation of the samples per epoch, grouped by length (`epoch_order`), so a run's batch at step s depends only on
the seed, s and the samples: with the optimizer's state in the checkpoint, a resumed run is the uninterrupted one.

On CUDA the samples are moved to the device once (when they fit) and matmuls run in TF32 during training
(`resident`, `tf32_matmuls`); on CPU neither changes anything. `--minutes` (`time_training`) times a few steps on a
deep copy of the head, so the head trained afterwards is the one the resolved step count gives.

Held-out acceptance: on held-out samples, the share of answer positions where the head's first draft (step 0, on
the target's states) is the target's greedy next token: what a chain's first draft would have had accepted.
"""
from __future__ import annotations

import copy
import functools
import math
import time
from contextlib import contextmanager
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
RESIDENT_SHARE = 0.5  # the samples move to the GPU once when they take at most this share of its free memory
# --minutes: untimed, then timed training steps on a copy of the head (batches grouped by length differ in cost:
# enough of them to average over)
TIMING_WARMUP, TIMING_STEPS = 2, 12
LENGTH_WINDOW = 32  # batches of the epoch's permutation sorted by length together (`epoch_order`)


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


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Step j's attention (module docstring) for queries q [B, n, heads, head_dim] after RoPE, `cache` holding steps
    0..j's (k, v) [B, n, kv_heads, head_dim]: one softmax over step 0's keys u < t and steps 0..j's keys at t;
    [B, n, heads * head_dim]."""
    (k0, v0), (B, n, nh, hd) = cache[0], q.shape
    nkv = k0.shape[2]
    rep = nh // nkv
    q = q.view(B, n, nkv, rep, hd) * hd ** -0.5  # SDPA's default scale
    grouped = q.permute(0, 2, 3, 1, 4).reshape(B, nkv, rep * n, hd)
    earlier = (grouped @ k0.permute(0, 2, 3, 1)).view(B, nkv, rep, n, n)  # [.., t, u]
    # u >= t masked: step 0's key at t comes with the later steps' (one stack, never empty)
    earlier = earlier.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(), float("-inf"))
    keys, values = (torch.stack(x, 3) for x in zip(*cache))  # every step's entry at t: [B, n, kv_heads, j + 1, hd]
    probs = torch.cat([earlier, torch.einsum("btgrd,btgid->bgrti", q, keys)], -1).softmax(-1)
    o = (probs[..., :n].reshape(B, nkv, rep * n, n) @ v0.transpose(1, 2)).view(B, nkv, rep, n, hd)
    o = o.permute(0, 3, 1, 2, 4) + torch.einsum("bgrti,btgid->btgrd", probs[..., n:], values)
    return o.reshape(B, n, nh * hd)


def unrolled_logits(head: TrainableHead, batch: Batch, steps: int) -> list[torch.Tensor]:
    """The head unrolled for `steps` steps over every pair index t = 0..n-1 at once (module docstring): step j's
    draft logits [B, n, Vd], predicting token t + 2 + j."""
    B = batch.tokens.shape[0]
    n = batch.tokens.shape[1] - steps - 1  # the longest sample's pairs: tokens 0..T-2 (collate padded by steps)
    t = torch.arange(n, device=batch.tokens.device)
    head.ensure_rope(n + steps)
    cache = []  # each step's (k, v) [B, n, kv_heads, head_dim]; appended, never written in place (backward)

    def attend(q, k, v):
        cache.append((k, v))
        return ttt_attention(q, cache)

    hidden = fuse(head, batch.states[:, :n], OPS)
    logits = []
    for j in range(steps):
        hidden = midlayer(head, batch.tokens[:, 1 + j: 1 + j + n], hidden, (t + j)[None].expand(B, n), None, OPS,
                          attend=attend)
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
def first_drafts(head: TrainableHead, samples: list[Sample], batch_size: int) -> list[torch.Tensor]:
    """Each sample's first drafts, teacher-forced (module docstring): [T - 1] target ids, entry t the head's draft
    of token t + 2 from the target's state of token t and token t + 1 (an Eagle3Head runs it as well)."""
    out = []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i: i + batch_size]
        batch = collate(chunk, 0, head.device)
        B, T = batch.tokens.shape
        n = T - 1
        head.ensure_rope(n)
        kv = torch.zeros(2, B, head.cfg.n_kv_heads, n, head.cfg.head_dim, device=head.device)
        positions = torch.arange(n, device=head.device)[None].expand(B, n)
        hidden = midlayer(head, batch.tokens[:, 1:], fuse(head, batch.states[:, :n], OPS), positions, kv, OPS)
        drafts = head.draft_to_target[draft_logits(head, hidden, OPS).argmax(-1)].cpu()
        out += [drafts[b, : len(s.tokens) - 1] for b, s in enumerate(chunk)]
    return out


def first_draft_acceptance(head: TrainableHead, samples: list[Sample], batch_size: int) -> float:
    """Held-out acceptance (module docstring): the share of answer positions whose first draft is the target's
    greedy token."""
    hits = total = 0
    for s, drafts in zip(samples, first_drafts(head, samples, batch_size)):
        # draft t predicts token t + 2, an answer token where t + 2 >= the prompt's length; its greedy is greedy[t + 1]
        counted = slice(max(s.prompt_len - 2, 0), len(s.tokens) - 2)
        hits += int((drafts[counted] == s.greedy[counted.start + 1: counted.stop + 1]).sum())
        total += counted.stop - counted.start
    return hits / max(total, 1)


def learning_rate(schedule: Schedule, step: int) -> float:
    warm = max(1, int(WARMUP * schedule.steps))
    if step < warm:
        return schedule.lr * (step + 1) / warm
    return schedule.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, schedule.steps - warm)))


@functools.lru_cache(maxsize=4)  # a step reads one epoch's order, two at an epoch's end: made once an epoch
def epoch_order(n_samples: int, batch_size: int, seed: int, epoch: int,
                lengths: tuple[int, ...] | None = None) -> list[int]:
    """One epoch's order of the samples: a seeded permutation; with `lengths`, grouped by length (HF Trainer's
    group_by_length): each window of LENGTH_WINDOW batches of the permutation sorted by length, then the epoch's
    batches in a seeded order. A batch pads to its longest sample, and the training-time test's attention grows
    with the square of it: random batches of 16 samples of 100-650 tokens pad to about 1.7 times their tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n_samples, generator=g).tolist()
    if lengths is None:
        return order
    window = batch_size * LENGTH_WINDOW
    grouped = [i for w in range(0, n_samples, window) for i in sorted(order[w: w + window], key=lengths.__getitem__)]
    full = n_samples // batch_size  # whole batches shuffled; a last, partial one stays last (the batches stay aligned)
    return [i for b in torch.randperm(full, generator=g).tolist()
            for i in grouped[b * batch_size: (b + 1) * batch_size]] + grouped[full * batch_size:]


def batch_indices(n_samples: int, batch_size: int, seed: int, step: int,
                  lengths: tuple[int, ...] | None = None) -> list[int]:
    """Samples step*B .. step*B + B - 1 of the endless sequence of seeded per-epoch orders (`epoch_order`)."""
    orders: dict[int, list[int]] = {}  # the epochs this batch reaches into
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, at = divmod(i, n_samples)
        if epoch not in orders:
            orders[epoch] = epoch_order(n_samples, batch_size, seed, epoch, lengths)
        out.append(orders[epoch][at])
    return out


@dataclass
class Targets:
    """What the loss reads from the target, on the head's device: its LM-head rows of the draft vocabulary, its final
    norm, and which target ids are in the draft vocabulary."""
    rows: torch.Tensor  # [Vd, H] fp32
    norm: torch.Tensor  # [H] fp32
    eps: float
    in_vocab: torch.Tensor  # [V] bool


def targets(head: TrainableHead, model) -> Targets:
    in_vocab = torch.zeros(head.cfg.vocab_size, dtype=torch.bool, device=head.device)
    in_vocab[head.draft_to_target] = True
    return Targets(model.lm_head.detach()[head.draft_to_target].float(), model.norm.detach().float(),
                   model.cfg.rms_eps, in_vocab)


def optimizer_for(head: TrainableHead, lr: float) -> torch.optim.Optimizer:
    """AdamW over the head's trainable parameters (module docstring); a frozen lm_head is a buffer, not among them."""
    params = [p for p in head.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_step(head: TrainableHead, optimizer, chosen: list[Sample], t: Targets, ttt_steps: int,
               lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One optimizer step on the samples `chosen`: (the weighted loss, each unrolled step's loss)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = collate(chosen, ttt_steps, head.device)
    probs = target_probs(batch, t.norm, t.eps, t.rows)
    losses = ttt_losses(head, batch, probs, t.in_vocab, ttt_steps)
    loss = sum(STEP_WEIGHT ** j * l for j, l in enumerate(losses))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], MAX_GRAD_NORM)
    optimizer.step()
    return loss, losses


def resident(samples: list[Sample], device) -> list[Sample]:
    """The samples on a CUDA `device`, moved once (states kept in the target's dtype; collate casts a batch), when
    they take at most RESIDENT_SHARE of its free memory; else as they are (collated from host memory each step).
    Collating on the device gives the same batches as collating on the host: the same values, cast the same way."""
    device = torch.device(device)
    if device.type != "cuda":
        return samples
    size = sum(t.numel() * t.element_size() for s in samples for t in (s.tokens, s.states, s.final, s.greedy))
    free, _ = torch.cuda.mem_get_info(device)
    if size > RESIDENT_SHARE * free:
        return samples
    return [Sample(s.tokens.to(device), s.prompt_len, s.states.to(device), s.final.to(device), s.greedy.to(device))
            for s in samples]


@contextmanager
def tf32_matmuls(device):
    """TF32 matmuls (and cuDNN convolutions) inside the block on a CUDA device, the previous flags restored after;
    nothing changes elsewhere (CPU results are as without it)."""
    if torch.device(device).type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    step: float  # seconds an optimizer step takes
    evaluation: float  # seconds a held-out evaluation takes
    checkpoint: float  # seconds a checkpoint takes to write

    def steps_within(self, seconds: float, log_every: int, checkpoint_every: int) -> int:
        """The most steps whose training, with an evaluation every log_every steps (and one at the first step) and a
        checkpoint every checkpoint_every steps, fits in `seconds` (at least 1)."""
        per_step = self.step + self.evaluation / log_every + self.checkpoint / checkpoint_every
        return max(1, int((seconds - self.evaluation) / per_step))


def time_training(head: TrainableHead, target, samples: list[Sample], heldout: list[Sample], schedule: Schedule,
                  scratch: Path, warmup: int = TIMING_WARMUP, timed: int = TIMING_STEPS) -> Timing:
    """Times `timed` training steps after `warmup` untimed ones, a held-out evaluation and a checkpoint, on a deep
    copy of the head with an optimizer of its own: `head` and the run's optimizer are untouched, so the training
    that follows is the one a given step count gives. The checkpoint goes to `scratch` and is removed."""
    probe = copy.deepcopy(head)
    optimizer = optimizer_for(probe, schedule.lr)
    t = targets(probe, target.model)
    pool, held = resident(samples, probe.device), resident(heldout, probe.device)
    device = probe.device

    lengths = tuple(s.tokens.numel() for s in pool)

    def run(steps: range) -> None:
        for step in steps:
            chosen = [pool[i] for i in batch_indices(len(pool), schedule.batch_size, schedule.seed, step, lengths)]
            train_step(probe, optimizer, chosen, t, schedule.ttt_steps, schedule.lr)

    def seconds(fn) -> float:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    with tf32_matmuls(device):
        run(range(warmup))
        step = seconds(lambda: run(range(warmup, warmup + timed))) / timed
        evaluation = seconds(lambda: first_draft_acceptance(probe, held, schedule.batch_size))
    checkpoint = seconds(lambda: save_checkpoint(scratch, probe, optimizer, 0))
    scratch.unlink(missing_ok=True)
    return Timing(step, evaluation, checkpoint)


def train(head: TrainableHead, target, samples: list[Sample], heldout: list[Sample], schedule: Schedule,
          checkpoint: Path, resume_from: dict | None, progress) -> list[dict]:
    """Train `head` in place for schedule.steps steps (from the checkpoint's step when resuming), writing the
    checkpoint every schedule.checkpoint_every steps and at the end; `progress(entry)` gets each log entry
    (step, loss, per-step losses, held-out acceptance, learning rate). Returns the entries logged."""
    optimizer = optimizer_for(head, schedule.lr)
    start = 0
    if resume_from is not None:
        head.load_state_dict(resume_from["head"])
        optimizer.load_state_dict(resume_from["optimizer"])
        start = resume_from["step"]
    t = targets(head, target.model)
    pool, held = resident(samples, head.device), resident(heldout, head.device)
    entries = []
    lengths = tuple(s.tokens.numel() for s in pool)
    with tf32_matmuls(head.device):
        for step in range(start, schedule.steps):
            chosen = [pool[i] for i in batch_indices(len(pool), schedule.batch_size, schedule.seed, step, lengths)]
            loss, losses = train_step(head, optimizer, chosen, t, schedule.ttt_steps, learning_rate(schedule, step))
            done = step + 1
            if done % schedule.checkpoint_every == 0 or done == schedule.steps:
                save_checkpoint(checkpoint, head, optimizer, done)
            if done % schedule.log_every == 0 or done == schedule.steps or step == start:
                entry = {"step": done, "steps": schedule.steps, "loss": float(loss.detach()),
                         "step_losses": [round(float(l.detach()), 4) for l in losses],
                         "lr": learning_rate(schedule, step),
                         "heldout_acceptance": first_draft_acceptance(head, held, schedule.batch_size)}
                entries.append(entry)
                progress(entry)
    return entries


def save_checkpoint(path: Path, head: TrainableHead, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, device) -> dict:
    return torch.load(path, map_location=device, weights_only=True)
