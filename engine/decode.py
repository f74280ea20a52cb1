"""The decoding loop: autoregressive greedy, chain speculative decoding, and speculative sampling, for ragged batches.

One step, for every row b of the batch at once: the drafter proposes up to k tokens after the row's last token;
the target scores [last, d_1..d_k] at positions len_b-1 .. len_b-1+k in one forward; the acceptance rule keeps the
longest verified prefix plus one token of the target's own; the row advances by that many tokens. With no drafter
(k = 0) the same step is plain autoregressive decoding. All of a step's tensors have static shapes, so on CUDA a
greedy step (drafting, verification and acceptance together) is captured once as a CUDA graph and replayed; the one
host sync per step reads the accepted tokens, which the host needs anyway for stop conditions. Shapes stay static,
but work need not: greedy verification marks the slots past each row's valid drafts as dead, and a layer that can
skip them (the fused layer) does; with `drafter.adaptive` each row's draft budget follows its acceptance. With
`ar_after_miss` the host runs a plain AR step (one token, no verification: a graph of its own) when the drafter found
nothing at the latest step it has read, since even a dead slot costs something; the drafter still searches in AR
steps, so verification resumes as soon as it finds drafts again. With more requests than rows, a row whose request
finishes starts the next waiting one between two steps (continuous batching): waiting prompts are prefilled apart, a
group at a time, and a request's K/V copied into the row it takes (a drafter with state of its own sets the row up
anew: `Drafter.start_rows`), all enqueued behind the step in flight; once no request waits, a batch whose rows run
out moves to a smaller bucket (the drafter's rows too: `Drafter.move_rows`). With `batch.controller` each step's kind
(how many drafts it verifies, down to an AR step) is the batch controller's choice (engine/batch_controller.py).
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..kernels import Kernels, resolve as resolve_kernels
from ..kernels.builtin import attention_sdpa
from .drafters import Drafter, rows_of
from .errors import SpecPilotError
from .model import Block, KVCache, Packing, Transformer, TreeStep, compiled, compiled_dynamic, token_inputs, unpacked
from .batch_controller import (BLIND_AR, SPECULATION_MARGIN, DraftLengthController, fraction_kinds, is_packed,
                               packed_budget)
from .tree import (DynamicTree, TreeShape, accept_tree_sampled, ancestor_bits, compact_tree_kv, tree_mask,
                   tree_positions)
from .sampling import CounterRng, SamplingParams, accept_sampled, categorical, probabilities


@dataclass
class StopCondition:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's own; (): never stop on EOS
    stop_strings: tuple[str, ...] = ()


@dataclass
class RowResult:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each verification step
    found: list[int] = field(default_factory=list)  # drafts the drafter had for the row at each step
    token_times: list[float] = field(default_factory=list)  # seconds from the call's start at which each token arrived
    text: str = ""

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per target step (accepted drafts + 1): tau."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else 1.0


@dataclass(frozen=True)
class StepRecord:
    """One decoding step as the loop read it: what a continuously batched call's time went to, step by step
    (`tools.bench.metrics.time_budget` sums them up)."""
    seconds: float  # from the previous step's read (the first step: from the end of the first prefill) to this one's
    kind: int  # drafts a row verified at most (0, BLIND_AR: an AR step)
    rows: int  # the bucket it ran at
    live: int  # rows that decoded a request in it
    tokens: int  # tokens it gave requests (with those of requests started before it, whose first tokens it read)
    behind_refill: bool  # its read also waited for host work before it: requests started, or a move to a smaller bucket
    queue_empty: bool  # no request was waiting to start when it was read: the batch was draining


@dataclass
class BatchStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    ar_steps: int = 0  # of them, steps run without verification (ar_after_miss, or the controller's choice)
    draft_lengths: list[int] = field(default_factory=list)  # each step's kind k': drafts a row (ragged: per row on
    # average) it verified at most; 0: an AR step; BLIND_AR (-1): an AR step that did not search for drafts
    refills: int = 0  # requests started in a row another request had finished (continuous batching)
    shrinks: int = 0  # times the batch moved to a smaller bucket as its requests ran out (`Decoder._shrink`)
    bucket: int = 0  # the rows (bucket) the batch started in
    row_steps: int = 0  # live rows summed over the steps (over steps: the batch's mean occupancy)
    step_log: list[StepRecord] = field(default_factory=list)  # every step, in the order read
    # The prefills that started waiting requests (continuous batching): how many, and their time on the device (CUDA:
    # between events around each, read after the call; eagerly: the host's clock). Set against the time the steps
    # behind refills took beyond a typical step (the bench's time_budget), it says how much of that is the prefill's
    # own work and how much the loop waiting around it.
    refill_prefills: int = 0
    refill_prefill_s: float = 0.0

    def add(self, other: "BatchStats") -> None:
        """Count another batch's steps and times in (prompts decoded in several batches, one after another)."""
        self.prefill_s += other.prefill_s
        self.decode_s += other.decode_s
        self.steps += other.steps
        self.ar_steps += other.ar_steps
        self.draft_lengths += other.draft_lengths
        self.refills += other.refills
        self.shrinks += other.shrinks
        self.row_steps += other.row_steps
        self.step_log += other.step_log
        self.refill_prefills += other.refill_prefills
        self.refill_prefill_s += other.refill_prefill_s


PREFILL_WIDTH_STEP = 64  # the narrowest prefill width; prompts pad to a few widths: one prefill graph a width
# With bucketed shapes (CUDA graphs), a batch runs at the smallest of these sizes that holds it, the rows beyond it
# dead: every batch size of a workload then reuses a handful of captured graphs and compiled kernels.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Waiting requests prefilled together (continuous batching), ahead of the rows they will take: their prefill runs in
# a scratch cache of this many rows, at most (`Decoder._prefill_requests`).
REFILL_GROUP = 16
# Prefill's layers compiled (`Decoder.prefill_layer_fn`): off until the H200 has timed it against eager
COMPILED_PREFILL = os.environ.get("SPECPILOT_COMPILED_PREFILL", "0") == "1"
# An AR step's search for drafts (which only reports what a stateless drafter finds: the step verifies none) runs on
# a side stream beside the target's forward, joined before the step records what it found, instead of before the
# forward: the n-gram search cost the batch controller's AR steps 2% at chat B = 4 on the H100 (0.635 against 0.623
# ms a step; thirtieth lease). Off until a GPU has run and timed it (SPECPILOT_SIDE_SEARCH=1 turns it on).
SIDE_SEARCH = os.environ.get("SPECPILOT_SIDE_SEARCH", "0") == "1"
# Replayed step prices (`Decoder._measure_prices`): untimed replays of each kind first, then rounds of replays over
# the kinds in turn, a kind's price its median round
PRICE_WARM_REPLAYS, PRICE_ROUNDS, PRICE_REPLAYS = 5, 5, 3
# Whether those replays run each row past its length, at the middle of what the loop will decode (`_measure_prices`);
# SPECPILOT_PRICE_AHEAD=0 prices at the rows' lengths as they are, for A/B timing
PRICE_AHEAD = os.environ.get("SPECPILOT_PRICE_AHEAD", "1") == "1"


def batch_bucket(batch: int) -> int:
    """The batch size a batch of `batch` rows runs at when shapes are bucketed (past 64: a multiple of 64)."""
    for size in BATCH_BUCKETS:
        if batch <= size:
            return size
    return -(-batch // BATCH_BUCKETS[-1]) * BATCH_BUCKETS[-1]


def prefill_width(longest_prompt: int) -> int:
    """The padded prompt width a batch prefills at when shapes are bucketed: a multiple of 64 up to 256, then a power
    of two or 1.5 times one (384, 512, 768, 1024, 1536, ...): few widths to capture, a prefill padded by less than
    half (prefill is a small part of a decode; pad slots are masked and change no token)."""
    if longest_prompt <= 4 * PREFILL_WIDTH_STEP:
        return max(1, -(-longest_prompt // PREFILL_WIDTH_STEP)) * PREFILL_WIDTH_STEP
    power = 1 << (longest_prompt - 1).bit_length()
    return power * 3 // 4 if longest_prompt <= power * 3 // 4 else power


def prefill_widths(max_prompt_tokens: int) -> list[int]:
    """Every width a prompt of up to `max_prompt_tokens` tokens may prefill at (what a warm-up captures)."""
    widths = [prefill_width(1)]
    while widths[-1] < prefill_width(max_prompt_tokens):
        widths.append(prefill_width(widths[-1] + 1))
    return widths


# KV-cache lengths come in steps of an eighth of the power of two below them (at least 512 slots): few enough shapes
# that later batches reuse the cache and with it the compiled kernels and captured graphs (every change costs a
# recompile and a recapture), fine enough that a longer draft never doubles it. Rounded up to a power of two, the
# few slots k = 4's verification needs beyond AR's took chat prompts of 380 tokens from 512 slots to 1,024, and every
# kind of the controller's step ran 15% slower than AR's on the H200 (the fused layer launches attention programs
# over the whole cache: twenty-fifth and twenty-ninth leases, chat at B = 64).
MIN_CACHE_SLOTS = 512
CACHE_STEPS_PER_OCTAVE = 8


def cache_length(longest_prompt: int, max_new_tokens: int, k: int, overlap: bool = False) -> int:
    """KV-cache slots a batch gets: room for the prompt, the new tokens and one (with overlap two) steps of k + 1
    verified tokens, rounded up to the next multiple of an eighth of the power of two below it (MIN_CACHE_SLOTS at
    least): 519 slots needed get 576, 1,025 get 1,152."""
    need = longest_prompt + max_new_tokens + (k + 1) * (2 if overlap else 1) + 1
    if need <= MIN_CACHE_SLOTS:
        return MIN_CACHE_SLOTS
    step = (1 << ((need - 1).bit_length() - 1)) // CACHE_STEPS_PER_OCTAVE  # (the power of two below need)
    return -(-need // step) * step


def step_rng(st: "DecodeState") -> CounterRng:
    """A step's random draws: functions of its rows' seed, salts and lengths (the state's buffers, read when the step
    runs, a captured one at every replay)."""
    return CounterRng(st.seed, st.salt, st.lengths)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for the device: on CUDA through pinned memory, enqueued on
    the stream (a copy from pageable memory synchronizes the stream, stalling the host behind a step in flight)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@contextmanager
def capture(graph, pool=None):
    """`torch.cuda.graph(graph, pool=pool)` whose captured GEMMs use a cuBLAS workspace that the graph owns.

    cuBLAS takes its workspace from PyTorch's process-wide cache, one per (handle, stream); every graph captured on
    torch.cuda.graph's one default capture stream bakes in that same pointer, allocated by whichever capture came
    first (into that graph's private pool). Whoever clears the cache frees the workspace under every such graph:
    torch.compile's CUDA-graph trees (mode "reduce-overhead", which HF's static-cache `generate` uses) clear it
    before and after each warm-up and recording, and the next capture's `empty_cache` then unmaps it once its pool
    is released: our graphs' next replay wrote into freed, then unmapped memory and faulted ("unspecified launch
    failure", issue #20; tests/test_crash_regression.py reproduces it on a GPU). So, as the graph trees do: clear
    before the capture, so that the capture allocates a fresh workspace into this graph's pool, and after it, so
    that no later capture or clear shares or frees it. It then lives in the graph's pool as long as the graph does."""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


class DecodeState:
    """Static device buffers of one batch: every token so far, per-row lengths, and the step's outputs."""

    def __init__(self, batch: int, max_len: int, k: int, device):
        self.history = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        # [n_accepted, tokens (k + 1: the step's accepted drafts and the target's token)..., drafts verified,
        #  drafts found]
        self.out = torch.zeros(batch, k + 4, dtype=torch.long, device=device)
        self.budget = torch.full((batch,), k, dtype=torch.long, device=device)  # drafts a row may verify next
        # Sampling's random draws (CounterRng): the call's seed, and each row's salt (its request's index)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.salt = torch.zeros(batch, dtype=torch.long, device=device)
        self.batch = batch
        # two pinned buffers: the host reads one while the next step's copy lands
        self.host_out = [torch.empty_like(self.out, device="cpu").pin_memory() for _ in range(2)] \
            if self.out.device.type == "cuda" else None


def _record(history, lengths, active, out, n_acc, tokens) -> None:
    """Append each row's emitted tokens (tokens[:, :n_acc+1]) to its history and publish them in `out`."""
    S, width = history.shape[1], tokens.shape[1]
    slots = (lengths[:, None] + torch.arange(width, device=tokens.device)[None]).clamp(max=S - 1)
    rows = torch.arange(history.shape[0], device=tokens.device)[:, None]
    # slots past n_acc hold junk beyond the row's length: never read. An indexed store, not scatter_: compiled
    # (`_finish_step`), a scatter_ into an input ran on a copy of the whole history, copied back after (two passes
    # over B x S, every step): inductor's reinplacing takes index_put, not scatter (fx_passes/reinplace.py, 2.13)
    history[rows, slots] = tokens
    lengths.add_((n_acc + 1) * active)
    out[:, 0].copy_(n_acc)
    out[:, 1: 1 + width].copy_(tokens)


def _step_inputs(history, lengths, budget, active, drafts, valid, adaptive: bool, greedy: bool):
    """A step's target inputs [last, drafts...] and their cache positions; each row's valid drafts (none for a row
    that is not active: finished, or a dead row of a batch bucket; within its budget when the draft length is
    adaptive); and for greedy verification the live tokens: the logits are read only up to each row's valid drafts,
    so the slots after them are dead, and a layer that can skip them does (a step without drafts then costs about
    what an AR step does). AR (drafts None): no drafts, no live mask. `valid` (the drafter's count a row) may exceed
    the drafts given (a step narrower than the proposal): capped here, in the compiled step."""
    S = history.shape[1]
    last = history.gather(1, (lengths - 1)[:, None])
    if drafts is None:
        inputs, valid = last, torch.zeros_like(lengths)
    else:
        inputs = torch.cat([last, drafts], 1)
        valid = valid.clamp(max=drafts.shape[1]) * active
        if adaptive:
            valid = torch.minimum(valid, budget)
    offsets = torch.arange(inputs.shape[1], device=inputs.device)[None]
    positions = ((lengths - 1)[:, None] + offsets).clamp(max=S - 1)
    live = (offsets <= valid[:, None]).int().reshape(-1) if drafts is not None and greedy else None
    return inputs, valid, positions, live


def _update_budget(budget, valid, n_acc, k: int) -> None:
    """Adaptive draft length (as HF's assisted generation schedules it): a row whose drafts were all accepted may
    verify two more next step, one that saw a rejection one fewer, within 1..k; a step without drafts says nothing."""
    grown = torch.where(n_acc >= valid, (budget + 2).clamp(max=k), (budget - 1).clamp(min=1))
    budget.copy_(torch.where(valid > 0, grown, budget))


def _finish_step(history, lengths, active, out, drafts, valid, logits, accept, found) -> torch.Tensor:
    n_acc, tokens = accept(drafts, valid, logits)
    _record(history, lengths, active, out, n_acc, tokens)
    out[:, -2].copy_(valid)
    out[:, -1] = found  # (a tensor, or a number for every row)
    return n_acc


# -- ragged verification: each row's live tokens packed -----------------------------------------------------------
def _pack(inputs, positions, valid, active, budget: int, n_slots: int, cache_slots: int):
    """Pack a verification step: row b's last token and its first alloc_b drafts, rows one after another, into
    `n_slots` token slots, where alloc water-fills the step's `budget` of drafts over the rows' `valid` drafts
    (every row up to the largest common cap whose total fits, then one more each for the first rows with more,
    while the budget lasts: `water_fill` on the host). A row that is not active gets no slot. With
    n_slots = B + budget every live token fits. Returns alloc [B] and the packed tokens, positions, cache rows,
    padded slots (b * T + j; B * T for an unused slot) and live flags (int32), each [n_slots]. An unused slot is
    token 0 at the cache's last position of row 0: written, never read (a row's cache has room past its last
    position; cache_length), and skipped by a layer that reads `live`."""
    B, T = inputs.shape
    k = T - 1
    caps = torch.arange(k + 1, device=inputs.device)
    totals = torch.minimum(valid[:, None], caps[None]).sum(0)  # drafts verified with every row capped at c, [k + 1]
    cap = ((totals <= budget).sum() - 1).view(1)  # totals[0] = 0 always fits
    more = valid > cap
    extra = more & (torch.cumsum(more.long(), 0) <= budget - totals.gather(0, cap))  # (no host sync: graphs)
    alloc = torch.minimum(valid, cap) + extra.long()
    counts = (alloc + 1) * active
    start = torch.cumsum(counts, 0) - counts
    j = torch.arange(T, device=inputs.device)[None]
    dest = torch.where(j < counts[:, None], start[:, None] + j, n_slots).reshape(-1)  # n_slots: a trash slot

    def pack(values, unused):
        buf = torch.full((n_slots + 1,), unused, dtype=values.dtype, device=values.device)
        return buf.scatter_(0, dest, values.reshape(-1))[:-1]

    rows = torch.arange(B, device=inputs.device)[:, None].expand(B, T)
    slots = torch.arange(B * T, device=inputs.device).view(B, T)
    return (alloc, pack(inputs, 0), pack(positions, cache_slots - 1), pack(rows, 0), pack(slots, B * T),
            pack(torch.ones_like(inputs, dtype=torch.int32), 0))


def _finish_packed(history, lengths, active, out, drafts, alloc, logits, slots, found) -> torch.Tensor:
    """Greedy acceptance of a packed step: each packed token's argmax back at its padded slot, then as
    builtin.accept_torch (the longest prefix of the row's verified drafts that matches, and the target's token)."""
    B, k = drafts.shape
    target = torch.zeros(B * (k + 1) + 1, dtype=torch.long, device=drafts.device)
    target = target.scatter_(0, slots, logits.argmax(-1))[:-1].view(B, k + 1)
    match = (drafts == target[:, :k]) & (torch.arange(k, device=drafts.device)[None] < alloc[:, None])
    n_acc = match.long().cumprod(1).sum(1)
    _record(history, lengths, active, out, n_acc, target)
    out[:, -2].copy_(alloc)
    out[:, -1] = found  # (a tensor, or a number for every row)
    return n_acc


@dataclass
class Prefilled:
    """Waiting requests prefilled into the scratch cache, ready to take rows of a running batch (continuous
    batching): their padded prompts and lengths, first tokens, and the host's handle on those (`Decoder._read`)."""
    tokens: torch.Tensor  # [m, width] long, on the device
    lengths: torch.Tensor  # [m]
    first: torch.Tensor  # [m]
    salts: torch.Tensor  # [m]: the requests' indices in the call (their sampling salts)
    first_host: tuple


# The captured work that takes in what AR steps without the search left pending in a drafter with state of its own
# (`Drafter.absorb`), run before the next step that searches; kept with the steps' graphs under this kind
ABSORB = "absorb"


class EagerStep:
    """What a step "captured" without CUDA graphs is: the step itself, run eagerly at each replay. The decoder keeps
    these where it keeps graphs, so that the same code decides when a shape is new (and counts it) on any device."""

    def __init__(self, run):
        self.replay = run


class Decoder:
    """Runs one target model with an optional drafter and a fixed k under a recipe's settings."""

    def __init__(self, model: Transformer, drafter: Drafter | None = None, k: int = 0, cuda_graphs: bool = True,
                 eos_token_ids: tuple[int, ...] = (), tokenizer=None, compile: bool = False,
                 kernels: dict[str, str] | Kernels | None = None, overlap: bool = False, compile_mode: str = "default",
                 layer: str = "modular", adaptive_drafts: bool = False, ar_after_miss: bool = False,
                 controller: str = "none", probe_every: int = 16, prices: dict[int, dict[int, float]] | None = None,
                 ragged: bool = False, tree: TreeShape | DynamicTree | None = None,
                 margin: float = SPECULATION_MARGIN, refill_at: float = 0.0, packed_weights: dict | None = None,
                 fractions: tuple[float, ...] = ()):
        if drafter is None:
            k = 0
        if drafter is not None and k < 1:
            raise ValueError(f"a drafter needs k >= 1, got k={k}")
        if controller not in ("none", "cost"):
            raise ValueError(f"controller must be 'none' or 'cost', got {controller!r}")
        self.model, self.drafter, self.k = model, drafter, k
        # The target layers whose outputs the drafter reads (an EAGLE-3 head): every target forward returns them too.
        self.aux_layers = drafter.needs_hidden_states if drafter is not None else None
        self.adaptive_drafts = adaptive_drafts and k > 0
        # Continuous batching (`generate`): a row may switch requests between steps unless the drafter keeps per-row
        # state of its own that would have to switch with it (a draft model's cache, an EAGLE-3 head's states)
        self.continuous = drafter is None or drafter.stateless or drafter.refills
        # ... and with this share of a batch's rows free before waiting requests start in them: each start is host
        # work and a step that waits for it, paid per start, whatever the number of requests started
        self.refill_at = refill_at
        self.ar_after_miss = ar_after_miss and k > 0
        # The batch-level controller: each step verifies k' = 0..k drafts, whichever the acceptance measured so far
        # and the price of each kind of step at this batch size make fastest (each k' a graph of its own).
        self.controller = (DraftLengthController(k, probe_every, ragged, margin=margin,
                                                 fixed_drafts=not drafter.variable_drafts)
                           if controller == "cost" and k > 0 else None)
        # Ragged verification (greedy steps; with the controller, whose k' is then the batch's draft budget per row)
        self.ragged = ragged and self.controller is not None
        # The controller's kinds below one draft a row (`batch.fractions`): a greedy chain step verifying f x B
        # drafts packed across the batch, so that a large batch can verify a few drafts in a step of little more
        # than B tokens (at B = 16 on the H200 a step of 24 tokens cost 1.1 AR steps, one of 32, k' = 1, 1.6-1.8:
        # thirty-ninth lease)
        if any(not 0 < f < 1 for f in fractions):
            raise ValueError(f"batch fractions must lie strictly between 0 and 1, got {list(fractions)}")
        self.fractions = tuple(fractions) if self.controller is not None and tree is None else ()
        # Tree verification: every verifying step verifies the tree's N nodes a row (engine/tree.py), a static tree
        # (the same shape every step) or a dynamic one (each row's shape drafted anew at each step)
        self.tree = tree
        # Head cache slots a dynamic tree's drafting needs past the target's (Eagle3Drafter.propose_dynamic_tree)
        self._draft_margin = 0
        if tree is not None:
            dynamic = isinstance(tree, DynamicTree)
            if drafter is None or not hasattr(drafter, "propose_dynamic_tree" if dynamic else "propose_tree"):
                raise SpecPilotError("dynamic tree verification needs an EAGLE-3 head" if dynamic else
                                     "tree verification needs a drafter that proposes trees (the n-gram drafter, "
                                     "an EAGLE-3 head)")
            if tree.depth != k:
                raise SpecPilotError(f"tree verification: k must equal the tree's depth {tree.depth}, got {k}")
            if dynamic:
                self._draft_margin = max(0, tree.expanded - tree.nodes)
            else:
                dev = model.device
                self._tree_tensors = (torch.tensor(tree.parents, device=dev), tree.ancestors(dev),
                                      torch.tensor(tree.depths, device=dev), tree.ancestor_at_depth(dev))
        # Tokens a verifying step puts through the target for a row: k + 1, or the tree's nodes
        self.verify_width = self.tree.nodes if self.tree is not None else k + 1
        self.prices: dict[int, dict[int, float]] = {b: dict(p) for b, p in (prices or {}).items()}
        self._price_ahead: int | None = None  # set by `warmup` for the prices its short batches measure
        # The batch controller's loop times of each kind of step, per bucket (DraftLengthController.observe_time)
        self.step_seconds: dict[int, dict[int, float]] = {}
        self.step_timed: dict[int, dict[int, deque]] = {}  # the latest loop times each of those is the median of
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        # Batch sizes and prompt widths padded to buckets: few shapes, each captured (and compiled) once, which a
        # warm-up can do ahead of time. Only worth it with graphs: eagerly, padding is pure cost.
        self.bucketed = self.cuda_graphs
        self.ops = kernels if isinstance(kernels, Kernels) else resolve_kernels(kernels)
        # Prefill is one long, compute-bound pass: fused SDPA there whatever the step's attention slot holds (the
        # math version would materialize a [B, heads, T, S] score tensor).
        self.prefill_ops = self.ops._replace(attention=attention_sdpa)
        # Compiling fuses each layer's norms, rotary embedding and activations, and the drafter's and acceptance's
        # many small ops, into few kernels. Layers are compiled as one function shared by all of them (seconds,
        # not the minutes a whole unrolled model takes); prefill and sampling stay eager.
        compile = compile and model.device.type == "cuda"
        self.layer_fn = compiled(Block.forward, compile_mode) if compile else Block.forward
        # Prefill's layers: eager by default, each layer some 30-40 kernels (a refill's prefill of 16 chat prompts
        # took 11-13 ms on the H200, 12 of them 135 ms of a 937 ms cell at B = 64: eighteenth lease, D); with
        # SPECPILOT_COMPILED_PREFILL=1 compiled once for every width and group (`compiled_dynamic`), to be timed
        # against eager before it becomes the default.
        self.prefill_layer_fn = compiled_dynamic(Block.forward) if compile and COMPILED_PREFILL else None
        if layer == "fused":  # steps of few tokens in five Triton kernels a layer; others stay modular
            from ..kernels.triton_fused_layer import layer_function

            # (packed_weights: the 12-bit planes of `weights.format: lossless12`, which its steps read too)
            self.layer_fn = layer_function(self.layer_fn, packed_weights)
        self._prologue = compiled(token_inputs) if compile else None  # the target's per-token inputs in a step
        self._finish = compiled(_finish_step) if compile else _finish_step
        self._inputs = compiled(_step_inputs) if compile else _step_inputs
        self._update_budget = compiled(_update_budget) if compile else _update_budget
        self._pack = compiled(_pack) if compile else _pack
        self._finish_packed = compiled(_finish_packed) if compile else _finish_packed
        if drafter is not None:
            drafter.prepare(self.ops, self.layer_fn, compile)
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.eos_token_ids = eos_token_ids
        # One KV cache for every batch bucket (each decodes in its first rows), a state per bucket, and the graphs
        # captured on them: (bucket, drafts verified) -> step graph, (bucket, width) -> prefill graph.
        self._base_cache: KVCache | None = None
        self._cache: KVCache | None = None  # the current batch's rows of it
        self._states: dict[int, DecodeState] = {}
        self._state: DecodeState | None = None
        self._graphs: dict = {}
        self._prefill_graphs: dict = {}  # (B, padded length) -> (graph, static inputs, logits)
        self._prefill_pool = None
        self._scratch: KVCache | None = None  # where waiting requests prefill (`_prefill_requests`)
        # Shapes seen for the first time: with CUDA graphs each is a capture (and a compile), eagerly the same count.
        # After `warmup`, a batch within its bounds adds none.
        self.captures = 0
        self.captured: list[tuple] = []
        self.last_stats = BatchStats()
        # Profiling hook (specpilot.tools.profile.profiler.PhaseTimer): when set, greedy steps run eagerly (no CUDA
        # graph) and `mark(point)` is called at each phase boundary of a step. Decoding is otherwise unchanged.
        self.phase_timer = None
        self._blind_run = 0  # AR steps in a row that skipped the search of a drafter with a backlog (`_run_step`)
        self._search_stream: torch.cuda.Stream | None = None  # (`_side_stream`)

    @property
    def batch_rows(self) -> int | None:
        """Rows of the latest batch (its bucket), None before any."""
        return self._state.batch if self._state is not None else None

    @property
    def cache_slots(self) -> int | None:
        """Slots a row of the static KV cache holds (what the fused layer's attention grid covers), None before any
        cache. The cache only grows: a decoder keeps the longest a call of it needed (`reserve`)."""
        return self._base_cache.max_len if self._base_cache is not None else None

    def _mark(self, point: str) -> None:
        if self.phase_timer is not None:
            self.phase_timer.mark(point)

    # -- one step ------------------------------------------------------------------------------------------------
    def _step(self, st: DecodeState, sampling: SamplingParams, drafts_k: int | None = None) -> None:
        """One decoding step of kind `drafts_k` (None: k): each row verifies up to that many drafts, or, ragged, the
        batch up to drafts_k x B packed. With 0 an AR step: the target sees one token; the drafter still searches:
        a drafter that finds drafts for some rows only (n-gram) with k, so that ar_after_miss and the controller
        know what it finds; one that always has k (a head, a draft model) for one draft, the least that keeps its
        own state up to date (its cache must see every token's pair). BLIND_AR: an AR step without the search
        (found 0 for every row), for a stateless drafter or one with a backlog (`_step_kinds`). ABSORB: no step,
        the drafter's `absorb` (`_run_step`). Sampled, its random draws are functions of each row's (seed, salt, length)
        and of the draw's place in the step (CounterRng): so a captured step draws anew at each replay."""
        if drafts_k == ABSORB:
            return self.drafter.absorb(st.history, st.lengths)
        k = self.k
        generator = None if sampling.greedy else step_rng(st)
        drafts_k = k if drafts_k is None else drafts_k
        search = drafts_k != BLIND_AR
        drafts_k = max(drafts_k, 0)
        if self.tree is not None and drafts_k > 0:
            return self._tree_step(st, sampling, generator)
        ragged = is_packed(drafts_k, self.ragged) and sampling.greedy
        if drafts_k != int(drafts_k) and not ragged:
            raise ValueError(f"a step of {drafts_k} drafts a row packs them: greedy steps only")
        drafts = proposed = prop = side = None
        # a drafter that reports what each row would draft (`Drafter.reports_found`) and always has some: k where
        # it did not search (a blind AR step), so that the controller does not take the skipped search for none (a
        # number, which the compiled bookkeeping writes: a tensor of it was one more kernel in every step)
        found = k if self.drafter is not None and self.drafter.reports_found else 0
        if k and search:
            # A drafter whose search costs the same for any length (n-gram) always proposes k, so every step reports
            # how many drafts each row has; a ragged step verifies up to k a row, but one below a draft a row of a
            # drafter that always has k (a head) one: each draft costs it a pass (`DraftLengthController._plan`).
            width = (k if self.drafter.variable_drafts or ragged and drafts_k >= 1
                     else 1 if ragged else max(drafts_k, 1))
            side = self._side_stream() if drafts_k == 0 and self.drafter.stateless else None
            if side is not None:  # beside the forward (SIDE_SEARCH): it reads the history the forward leaves alone
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    prop = self.drafter.propose(st.history, st.lengths, width, sampling, generator)
            else:
                prop = self.drafter.propose(st.history, st.lengths, width, sampling, generator)
            found = prop.valid if prop.found is None else prop.found
            if drafts_k:
                keep = k if ragged else drafts_k
                drafts, proposed = prop.tokens[:, :keep], prop.valid  # (capped at keep by `_step_inputs`)
            self._mark("draft")
        inputs, valid, positions, live = self._inputs(st.history, st.lengths, st.budget, st.active, drafts, proposed,
                                                      self.adaptive_drafts, sampling.greedy and not ragged)
        if ragged:
            budget = packed_budget(drafts_k, st.batch)
            valid, tokens, at, rows, slots, live = self._pack(inputs, positions, valid, st.active, budget,
                                                              st.batch + budget, st.history.shape[1])
            logits, hidden = self._forward(tokens[None], at[None], live=live, packing=Packing(rows, slots, positions))
            if hidden is not None:  # each packed token's states back at its row's slot
                hidden = unpacked(hidden[0], slots, st.batch, inputs.shape[1])
            self._mark("verify")
            n_acc = self._finish_packed(st.history, st.lengths, st.active, st.out, inputs[:, 1:], valid, logits[0],
                                        slots, found)
        elif sampling.greedy:
            skip = {} if live is None else {"live": live}
            logits, hidden = self._forward(inputs, positions, **skip)
            self._mark("verify")
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
            n_acc = self._finish(st.history, st.lengths, st.active, st.out, inputs[:, 1:], valid, logits,
                                 self.ops.accept, found)
        else:
            logits, hidden = self._forward(inputs, positions)
            self._mark("verify")
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
            q = prop.probs[:, : inputs.shape[1] - 1] if drafts is not None and prop.probs is not None else None
            n_acc, tokens = accept_sampled(inputs[:, 1:], valid, q, logits, sampling, generator)  # q None: one-hot
            _record(st.history, st.lengths, st.active, st.out, n_acc, tokens)
            st.out[:, -2].copy_(valid)
            st.out[:, -1] = found
        if drafts is not None and self.adaptive_drafts:
            self._update_budget(st.budget, valid, n_acc, k)
        if hidden is not None:  # every step, AR steps too: the drafter reads the states of every token emitted
            self.drafter.update(n_acc, hidden=hidden, searched=search)
        elif drafts is not None:
            self.drafter.update(n_acc)
        self._mark("bookkeeping")

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The stream an AR step's search runs on beside the forward: captured steps on CUDA (SIDE_SEARCH), not
        under the phase timer (whose marks time the phases one after another)."""
        if not (SIDE_SEARCH and self.cuda_graphs and self.model.device.type == "cuda" and self.phase_timer is None):
            return None
        if self._search_stream is None:
            self._search_stream = torch.cuda.Stream(self.model.device)
        return self._search_stream

    def _tree_step(self, st: DecodeState, sampling: SamplingParams, generator) -> None:
        """A tree step: the drafter fills the tree's nodes, the target scores all N nodes of every row in one forward
        (each node at position P + depth, cache slot P + index, seeing the row's cache and its ancestors), the
        accepted path (greedy: the deepest matching one; sampled: recursive rejection over siblings, which keeps the
        target's distribution) is kept and moved into place in the cache. A dynamic tree's shape is each row's own,
        drafted with its nodes."""
        if isinstance(self.tree, DynamicTree):
            node_tokens, node_valid, trees = self.drafter.propose_dynamic_tree(st.history, st.lengths, self.tree)
            parents, ancestors, depths, at_depth = trees.parents, trees.ancestors, trees.depths, trees.at_depth
        else:
            parents, ancestors, depths, at_depth = self._tree_tensors
            node_tokens, node_valid = self.drafter.propose_tree(st.history, st.lengths, self.tree)
        self._mark("draft")
        S = st.history.shape[1]
        last = st.lengths - 1  # the root's position
        inputs = torch.cat([st.history.gather(1, last[:, None]), node_tokens], 1)
        valid = torch.cat([torch.ones_like(node_valid[:, :1]), node_valid & st.active[:, None]], 1)
        positions, slots = (t.clamp(max=S - 1) for t in tree_positions(last, depths))
        bits = ancestor_bits(ancestors)
        logits, hidden = self._forward(inputs, positions, tree=TreeStep(
            slots, tree_mask(last, ancestors, S), None if bits is None else bits.expand_as(slots)))
        self._mark("verify")
        n_acc, emitted, path = accept_tree_sampled(inputs, valid, logits, parents, ancestors, depths, at_depth,
                                                   sampling, generator)
        n_acc = n_acc * st.active
        compact_tree_kv(self._cache.kv, last, path)
        _record(st.history, st.lengths, st.active, st.out, n_acc, emitted)
        st.out[:, -2].copy_(valid[:, 1:].sum(1))
        st.out[:, -1].copy_(node_valid.sum(1))
        if hidden is not None:  # the accepted path's states by depth: the slots of a chain step that accepted it
            self.drafter.update(n_acc, hidden=hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1])))
        else:
            self.drafter.update(n_acc)
        self._mark("bookkeeping")

    def _forward(self, tokens, positions, **kwargs):
        """The target's forward over a step's tokens: (logits, the hidden states the drafter reads or None)."""
        if self.aux_layers is not None:
            kwargs["aux_layers"] = self.aux_layers
        out = self.model(tokens, positions, self._cache, ops=self.ops, layer_fn=self.layer_fn,
                         prologue=self._prologue, **kwargs)
        return out if self.aux_layers is not None else (out, None)

    def _run_step(self, st: DecodeState, sampling: SamplingParams, drafts_k: int) -> None:
        """Run a step of kind `drafts_k`; first, in a drafter with a backlog, have the pairs of the AR steps that
        skipped its search absorbed when this step searches or the backlog is full."""
        backlog = self.drafter.backlog if self.drafter is not None else 0
        if self._blind_run and (drafts_k != BLIND_AR or self._blind_run >= backlog):
            self._run(st, sampling, ABSORB)
            self._blind_run = 0
        self._blind_run = self._blind_run + 1 if drafts_k == BLIND_AR and backlog else 0
        self._run(st, sampling, drafts_k)

    def absorb_backlog(self, st: DecodeState) -> None:
        """Any pairs that AR steps without the search left pending on `st`'s rows, absorbed now, as the loop does
        before its next searching step: a step that searches reads only the first k + 1 pending pairs, and one
        replayed over a backlog indexed past them (on the H100, thirty-fourth lease: a device-side assert that killed
        the process). Where the loop can leave one: prices measured mid-call for a new bucket, and replays from the
        state a call left, whose rows past the bucket it drained into keep what they held when it moved (so not
        only when `_blind_run` says so). With no backlog pending it changes nothing a step reads."""
        if ABSORB in self._graph_kinds():
            with torch.inference_mode():
                self._run(st, SamplingParams(), ABSORB)
            self._blind_run = 0

    def _run(self, st: DecodeState, sampling: SamplingParams, drafts_k) -> None:
        if self.phase_timer is not None:
            return self._step(st, sampling, drafts_k)
        self._graph(st, sampling, drafts_k).replay()

    def _seen(self, key: tuple) -> None:
        self.captures += 1
        self.captured.append(key)

    def _graph(self, st: DecodeState, sampling: SamplingParams, drafts_k: int):
        """The captured step verifying `drafts_k` drafts for this batch bucket (captured now if it is new); a sampled
        step is a graph of its own for each setting (temperature, top-k, top-p are constants in it)."""
        key = (st.batch, drafts_k) if sampling.greedy else (st.batch, drafts_k, sampling)
        graph = self._graphs.get(key)
        if graph is None:
            self._seen(("step",) + key)
            try:
                graph = self._capture(st, sampling, drafts_k)
            except Exception as e:  # a sampled step that does not capture still runs, eagerly, and says why
                if sampling.greedy or not self.cuda_graphs:
                    raise
                print(f"specpilot: sampled steps run without a CUDA graph ({type(e).__name__}: {e})", file=sys.stderr)
                graph = EagerStep(lambda: self._step(st, sampling, drafts_k))
            self._graphs[key] = graph
        return graph

    def forget_steps(self) -> None:
        """Drop every captured step (the next use captures it again): the drafter's tensors that they read moved."""
        self._graphs = {}

    def _step_kinds(self, bucket: int | None = None, greedy: bool = True) -> tuple:
        """The draft lengths this decoder's steps may verify: k; with ar_after_miss also 0; with the controller all,
        with greedy steps on `bucket` (default: the current batch's) its fractions whose packed budget is at least
        one draft (`fraction_kinds`), and BLIND_AR for a stateless drafter or one with a backlog. (A drafter with state of its own, an EAGLE-3
        head's or a draft model's cache, must see every step's tokens: a step that skipped its search leaves its
        pair for `absorb`, which only a drafter with a `backlog` can take. Before that was kept, the packaged head's
        chain with the controller ran 362 AR steps without the search at summarize B = 4 on the H100, 2026-12-06, its
        cache missing each one's entry.) A drafter with a backlog that always has k drafts (the head) never runs 0
        under the controller, whose AR steps for it are all BLIND_AR (`fixed_drafts`): 0 is neither captured nor
        priced."""
        if self.controller is not None:
            low = BLIND_AR if self.drafter.stateless or self.drafter.backlog else 0
            kinds = tuple(range(self.k, low - 1, -1))
            if low == BLIND_AR and self.controller.fixed_drafts:
                kinds = tuple(kind for kind in kinds if kind != 0)
            bucket = bucket if bucket is not None else self._state.batch if self._state is not None else 1
            fractions = fraction_kinds(self.fractions, bucket) if greedy else ()
            return tuple(sorted(kinds + fractions, reverse=True))
        return (self.k, 0) if self.ar_after_miss else (self.k,)

    def _graph_kinds(self, bucket: int | None = None, greedy: bool = True) -> tuple:
        """What `_capture_all` captures: the kinds of step, and ABSORB where a drafter with a backlog may skip
        its search."""
        kinds = self._step_kinds(bucket, greedy)
        absorbs = BLIND_AR in kinds and self.drafter is not None and self.drafter.backlog
        return kinds + (ABSORB,) if absorbs else kinds

    def _capture_all(self, st: DecodeState, sampling: SamplingParams) -> None:
        """Capture every kind of step this decoder may launch for `st` before the first one runs, rather than when
        each is first needed (a capture takes tens of milliseconds and may compile): the verification step, with
        ar_after_miss the AR step, with the controller a step for each draft length (and ABSORB)."""
        if self.phase_timer is not None:
            return
        for drafts_k in self._graph_kinds(st.batch, sampling.greedy):
            self._graph(st, sampling, drafts_k)

    def _main_graph(self):
        """The last batch's verification step (for an AR decoder its only step)."""
        return self._graphs[(self._state.batch, self.k)]

    def time_graph_replay(self, replays: int = 20) -> float | None:
        """Device seconds of one captured step: the last batch's graph replayed between CUDA events. The replays
        append junk tokens; the lengths are put back, so the state is as before. None when no graph exists."""
        if not self.cuda_graphs or (self._state is None or (self._state.batch, self.k) not in self._graphs):
            return None
        return self._time_step(self._state, self.k, replays)

    def _time_step(self, st: DecodeState, drafts_k: int, replays: int, ahead: int = 0) -> float:
        """Seconds of one step verifying `drafts_k` drafts on this bucket: its graph replayed `replays` times, every
        row active, each replay timed alone (between CUDA events; eagerly, by the host's clock) from the state the
        step would start from: the rows' lengths and the drafter's state are put back before each. (Replayed one
        after the other, a step appends up to drafts_k + 1 tokens each time, and 20 replays of k = 16 from a row near
        the end of its cache wrote past it: H200, seventeenth lease, a device-side assert in the KV write that killed
        the process.) With `ahead`, each row's step runs `ahead` positions past its length (as far as its cache has
        room for two steps more): the context it attends over then, whose slots in between hold whatever they held
        (a timed step's outputs are discarded, and the slots it writes are written again before any step reads
        them). Lengths, budgets, activity and the drafter's state are as before afterwards, but for a backlog of
        pending pairs, absorbed before a searching step is timed (`absorb_backlog`: what the loop does next)."""
        graph = self._graph(st, SamplingParams(), drafts_k)
        if drafts_k != BLIND_AR:
            self.absorb_backlog(st)
        saved = (st.lengths.clone(), st.budget.clone(), st.active.clone())
        timed_lengths = saved[0]
        if ahead > 0:
            room = st.history.shape[1] - 2 * self.verify_width - 1
            timed_lengths = torch.maximum(torch.clamp(saved[0] + ahead, max=room), saved[0])
        drafter_state = self.drafter.snapshot() if self.drafter is not None else None
        st.active.fill_(True)
        cuda = st.out.device.type == "cuda"
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(replays)] if cuda else []
        seconds = 0.0
        if cuda:
            torch.cuda.synchronize()
        with torch.inference_mode():
            for i in range(replays):
                st.lengths.copy_(timed_lengths)
                if self.drafter is not None:
                    self.drafter.restore(drafter_state)
                if cuda:
                    events[i][0].record()
                    graph.replay()
                    events[i][1].record()
                else:
                    t0 = time.perf_counter()
                    graph.replay()
                    seconds += time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
            seconds = sum(a.elapsed_time(b) for a, b in events) / 1e3
        for buf, value in zip((st.lengths, st.budget, st.active), saved):
            buf.copy_(value)
        if self.drafter is not None:
            self.drafter.restore(drafter_state)
        return seconds / replays

    def _prices(self, st: DecodeState, ahead: int = 0) -> dict[int, float]:
        """The controller's price of each kind of step on this bucket: given, measured at warm-up, or now (each
        row `ahead` positions past its length: `_measure_prices`)."""
        prices = self.prices.get(st.batch)
        if prices is None:
            prices = self.prices[st.batch] = self._measure_prices(st, ahead)
        return prices

    def _measure_prices(self, st: DecodeState, ahead: int = 0) -> dict[int, float]:
        """Each kind's replayed step time: after PRICE_WARM_REPLAYS untimed replays of every kind, PRICE_ROUNDS
        rounds of PRICE_REPLAYS replays a kind, the kinds interleaved, and each kind's median round. Timed one kind
        after the other, the first kinds ran on a GPU still clocking up: on the H200 (thirteenth lease, chat B = 4)
        k' = 4, timed first, was priced 1.32 ms where the loop timed it at 1.13. Each row's step runs `ahead`
        positions past its length (`_time_step`): the callers pass the middle of what the loop will decode, since a
        step's attention grows with its context on the fused layer and not on the modular one (whose masked
        attention spans the whole cache). Priced at the warm-up's one-token prompts, the loop's fused steps took
        1.2-1.43x their price and the modular ones theirs (H100, forty-second lease, chat B = 8-16), and a kind
        priced from the others' loop ratios across the two layers was mispriced by up to 15%."""
        kinds = self._step_kinds(st.batch)
        ahead = ahead if PRICE_AHEAD else 0
        for kind in kinds:
            self._time_step(st, kind, PRICE_WARM_REPLAYS, ahead)
        rounds = {kind: [] for kind in kinds}
        for _ in range(PRICE_ROUNDS):
            for kind in kinds:
                rounds[kind].append(self._time_step(st, kind, PRICE_REPLAYS, ahead))
        return {kind: sorted(times)[len(times) // 2] for kind, times in rounds.items()}

    def replay_once(self) -> None:
        """Replay the last captured step once (for a profiler trace); the lengths are put back afterwards."""
        graph, lengths = self._main_graph(), self._state.lengths.clone()
        graph.replay()
        torch.cuda.synchronize()
        self._state.lengths.copy_(lengths)

    def _launch(self, st: DecodeState, sampling: SamplingParams, index: int, drafts_k: int):
        """Enqueue one step and the copy of its outputs to the host; returns what `_read` waits on."""
        self._mark("begin")
        self._run_step(st, sampling, drafts_k)
        if st.host_out is None:
            return st.out.clone(), None
        buf = st.host_out[index % 2]
        buf.copy_(st.out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return buf, done

    @staticmethod
    def _read(pending) -> list[list[int]]:
        buf, done = pending
        if done is not None:
            done.synchronize()
        return buf.tolist()

    def _capture(self, st: DecodeState, sampling: SamplingParams, drafts_k: int):
        if not self.cuda_graphs:
            return EagerStep(lambda: self._step(st, sampling, drafts_k))
        # Warm up on a side stream (lazy library init must not happen during capture), restoring the state after
        # each run: a step only appends, so restoring history and lengths undoes it.
        saved = (st.history.clone(), st.lengths.clone())
        drafter_state = self.drafter.snapshot() if self.drafter is not None else None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(st, sampling, drafts_k)
                st.history.copy_(saved[0])
                st.lengths.copy_(saved[1])
                if self.drafter is not None:
                    self.drafter.restore(drafter_state)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            self._step(st, sampling, drafts_k)
        return graph

    def _prefill_forward(self, tokens, positions, lengths, cache, refill: bool = False):
        """Each row's logits at its last prompt token, the drafter's own pass over the prompts after them, part of
        the same graph (`Drafter.prefill_prompts`; with `refill`, waiting requests prefilled into the scratch cache:
        `Drafter.prefill_refills`)."""
        aux = {} if self.aux_layers is None else {"aux_layers": self.aux_layers}
        out = self.model(tokens, positions, cache, logits_at=(lengths - 1)[:, None], ops=self.prefill_ops,
                         layer_fn=self.prefill_layer_fn, **aux)
        logits, hidden = (out[:, 0], None) if self.aux_layers is None else (out[0][:, 0], out[1])
        if self.drafter is not None:
            if refill:
                self.drafter.prefill_refills(tokens, positions, lengths, hidden=hidden)
            else:
                self.drafter.prefill_prompts(tokens, positions, lengths, hidden=hidden)
        return logits

    def _prefill_cache(self, batch: int, scratch: bool) -> KVCache:
        """The cache a prefill of `batch` rows writes: the batch's own rows, or (`scratch`, for requests started in
        a running batch) the first rows of the scratch cache, made now if it is missing or too small."""
        if not scratch:
            return self._cache
        if self._scratch is None or self._scratch.k.shape[1] < batch:
            # A new scratch cache invalidates the prefill graphs captured on the old one: start the prefill graphs
            # over, in a fresh pool (PyTorch cannot capture into a pool whose graphs are gone).
            rows = max(batch, min(REFILL_GROUP, self._base_cache.k.shape[1]))
            self._scratch = self.model.new_cache(rows, self._base_cache.max_len)
            if self.drafter is not None:
                self.drafter.reserve_refills(rows, self._base_cache.max_len)
            self._prefill_graphs, self._prefill_pool = {}, None
        return rows_of(self._scratch, batch)

    def _prefill_graph(self, batch: int, width: int, scratch: bool = False):
        """The prefill of this bucket and width: with CUDA graphs a graph captured once on zero prompts (its inputs
        are copied in at each replay); eagerly nothing to keep, but the shape is counted the same way."""
        # Eagerly a prefill compiles nothing per width: its shape is counted by the bucket a graph would be
        # captured for, so that `captures` means the same on a CPU as on CUDA.
        key = (batch, width if self.cuda_graphs else prefill_width(width)) + (("scratch",) if scratch else ())
        cache = self._prefill_cache(batch, scratch)
        if key in self._prefill_graphs:
            return self._prefill_graphs[key]
        self._seen(("prefill",) + key)
        entry = None
        if self.cuda_graphs:
            device = self.model.device
            static = (torch.zeros(batch, width, dtype=torch.long, device=device),
                      torch.arange(width, device=device)[None].expand(batch, width).contiguous(),
                      torch.ones(batch, dtype=torch.long, device=device))
            stream = torch.cuda.Stream()  # warm up (lazy library init must not happen during capture)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                self._prefill_forward(*static, cache, refill=scratch)
            torch.cuda.current_stream().wait_stream(stream)
            if self._prefill_pool is None:  # one memory pool for all prefill graphs: they never run at once
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=self._prefill_pool), torch.inference_mode():
                logits = self._prefill_forward(*static, cache, refill=scratch)
            entry = (graph, static, logits)
        self._prefill_graphs[key] = entry
        return entry

    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                 scratch: bool = False) -> torch.Tensor:
        """The prompts' forward pass: their K/V into the cache (`scratch`: the scratch cache), and each row's logits
        at its last token [B, vocab].

        With CUDA graphs it is replayed as a graph captured once per (batch, padded length): eager, a prefill of a
        small model is bound by the host launching its hundreds of kernels one by one (on the H200, SmolLM2's took
        ~25 ms for a prompt the device computes in a few)."""
        entry = self._prefill_graph(*tokens.shape, scratch=scratch)
        if entry is None:
            return self._prefill_forward(tokens, positions, lengths, self._prefill_cache(tokens.shape[0], scratch),
                                         refill=scratch)
        graph, static, logits = entry
        for buf, value in zip(static, (tokens, positions, lengths)):
            buf.copy_(value)
        graph.replay()
        return logits

    # -- batches: buckets, cache, warm-up --------------------------------------------------------------------------
    def reserve(self, rows: int, max_len: int) -> None:
        """Make room for batches of up to `rows` rows in a cache of at least `max_len` slots. A larger cache than
        the current one drops every graph (they point into the old one) and starts over."""
        base = self._base_cache
        if base is not None and base.k.shape[1] >= rows and base.max_len >= max_len:
            return
        if base is not None:
            rows, max_len = max(rows, base.k.shape[1]), max(max_len, base.max_len)
        # (a fresh pool for the new prefill graphs: PyTorch cannot capture into a pool whose graphs are gone)
        self._graphs, self._prefill_graphs, self._prefill_pool, self._states = {}, {}, None, {}
        self._base_cache = self._cache = self._state = self._scratch = None
        self._base_cache = self.model.new_cache(rows, max_len)
        if self.drafter is not None:
            self.drafter.reserve(rows, max_len + self._draft_margin)

    def _use(self, batch: int, max_len: int) -> DecodeState:
        """The state of a batch bucket of `batch` rows, its rows of the cache current."""
        self.reserve(batch, max_len)
        st = self._states.get(batch)
        if st is None:
            st = self._states[batch] = DecodeState(batch, self._base_cache.max_len, self.k, self.model.device)
        self._cache, self._state = rows_of(self._base_cache, batch), st
        return st

    def warmup(self, batch_sizes, max_prompt_tokens: int, max_new_tokens: int) -> None:
        """Capture (and compile) everything a batch of one of these sizes, prompts of up to `max_prompt_tokens` and
        up to `max_new_tokens` new tokens will run, so that decoding it captures nothing (`captures` stays put):
        the cache at its final size, then for each batch bucket one short greedy batch (its step graphs, and prefill
        at the narrowest width; eagerly this pays torch's lazy initialization), the prefill graph of every wider
        width, with continuous batching the prefill of every group of requests that may start in a running batch,
        and with the controller the price of each kind of step; with continuous batching also the steps (and prices)
        of every smaller bucket, where a batch moves as its requests run out. Sampled steps (a graph for each
        sampling setting) are captured at their first call, not here."""
        buckets = sorted({batch_bucket(b) if self.bucketed else b for b in batch_sizes})
        widths = prefill_widths(max_prompt_tokens) if self.bucketed or not self.cuda_graphs else [max_prompt_tokens]
        need = cache_length(max_prompt_tokens, max_new_tokens, self.verify_width - 1, self.overlap)
        self.reserve(max(buckets), max(need, widths[-1]))
        most = min(REFILL_GROUP, max(buckets))
        groups = sorted({batch_bucket(m) if self.bucketed else m for m in range(1, most + 1)})
        with torch.inference_mode():
            if self.continuous:  # the scratch cache first: making it starts the prefill graphs over
                self._prefill_graph(groups[-1], widths[0], scratch=True)
        # A batch drains into smaller buckets as its requests run out (`_shrink`): their steps are ready too.
        drains = [b for b in BATCH_BUCKETS if b < max(buckets) and b not in buckets] \
            if self.continuous and self.bucketed else []
        # Each bucket priced (in its short batch) at the middle of what a request of this call will decode
        # (`_measure_prices`), not at its two tokens
        self._price_ahead = (max_prompt_tokens + max_new_tokens) // 2
        try:
            for batch in sorted(buckets + drains):
                self.generate([[0]] * batch, StopCondition(2, ()))
                st = self._use(batch, 0)
                with torch.inference_mode():
                    for width in widths if batch in buckets else ():
                        self._prefill_graph(batch, width)
                    if self.controller is not None:
                        self._prices(st, self._price_ahead)
        finally:
            self._price_ahead = None
        with torch.inference_mode():
            for group in groups if self.continuous else ():
                for width in widths:
                    self._prefill_graph(group, width, scratch=True)

    # -- a batch -------------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], stop: StopCondition, sampling: SamplingParams = SamplingParams(),
                 seed: int = 0, max_batch: int | None = None) -> list[RowResult]:
        """Decode token-id prompts of any lengths, up to `max_batch` rows at once (None: all at once); each row stops
        on its own, and the results come in the prompts' order. With more prompts than rows, a row whose request
        finishes takes the next waiting prompt before the next step (continuous batching): the batch stays full,
        and no request waits for the slowest of its batch (a drafter with per-row state of its own sets a started
        row up anew: an EAGLE-3 head, `Drafter.refills`). One that cannot (a draft model) decodes its prompts in
        batches of `max_batch`, in order."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        rows = len(prompts) if max_batch is None else min(max_batch, len(prompts))
        if rows == len(prompts) or self.continuous:
            return self._decode(prompts, rows, stop, sampling, seed)
        results, stats, t0 = [], BatchStats(), time.perf_counter()
        for i in range(0, len(prompts), rows):
            offset = time.perf_counter() - t0
            for r in self._decode(prompts[i: i + rows], rows, stop, sampling, seed + i):
                r.token_times = [offset + t for t in r.token_times]  # on the clock of this call
                results.append(r)
            stats.add(self.last_stats)
        self.last_stats = stats
        return results

    def _decode(self, prompts: list[list[int]], concurrency: int, stop: StopCondition, sampling: SamplingParams,
                seed: int) -> list[RowResult]:
        """Decode `prompts` in `concurrency` rows: the first ones prefilled together, the rest started in rows
        that finish (`_prefill_requests`, `_move_in`)."""
        device = self.model.device
        B = min(concurrency, len(prompts))
        # Bucketed, a batch runs at its bucket's size: the rows past B are dead (one-token prompts, inactive from
        # the start, no drafts verified), they take part in every step's fixed shapes and in no result.
        rows = batch_bucket(B) if self.bucketed else B
        first_longest, longest = max(len(p) for p in prompts[:B]), max(len(p) for p in prompts)
        width = prefill_width(first_longest) if self.bucketed else first_longest  # prompts right-padded to this
        need = cache_length(longest, stop.max_new_tokens, self.verify_width - 1, self.overlap)
        st = self._use(rows, max(need, prefill_width(longest) if self.bucketed else longest))
        max_len = self._cache.max_len
        # Sampling's draws: this call's seed, and row b's salt the index of the request it decodes (dead rows: their
        # own), so that no two requests draw alike and the same call draws the same again
        st.seed.fill_(seed)
        st.salt.copy_(to_device(torch.tensor(list(range(B)) + [-1 - b for b in range(B, rows)]), device))
        results = [RowResult(prompt=list(p)) for p in prompts]
        eos = set(self.eos_token_ids if stop.eos_token_ids is None else stop.eos_token_ids)
        controller = self.controller
        if controller is not None:  # acceptance is measured per call; the loop's step times carry over
            controller.reset(rows, self.step_seconds.setdefault(rows, {}), self.step_timed.setdefault(rows, {}))

        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            lengths = torch.tensor([len(p) for p in prompts[:B]] + [1] * (rows - B), device=device)
            padded = torch.zeros(rows, width, dtype=torch.long)
            for b, p in enumerate(prompts[:B]):
                padded[b, : len(p)] = torch.tensor(p)
            padded = padded.to(device)
            positions = torch.arange(width, device=device)[None].expand(rows, width)
            # Right padding is safe: pad slots lie past each row's end, are masked, and are overwritten later.
            logits = self._prefill(padded, positions, lengths)  # (the drafter's pass over the prompts inside)
            if sampling.greedy:
                first = logits.argmax(-1)
            else:
                first = categorical(probabilities(logits, sampling), CounterRng(st.seed, st.salt, lengths))
            if self.drafter is not None:
                self.drafter.prefill(padded, positions, max_len)
            st.history.zero_()
            st.history[:, :width] = padded
            st.history.scatter_(1, lengths[:, None], first[:, None])
            st.lengths.copy_(lengths + 1)
            st.budget.fill_(self.k)
            first_host = first.tolist()
            t_first = time.perf_counter() - t0
            active = [False] * rows
            for b in range(B):
                active[b] = self._append(results[b], [first_host[b]], t_first, stop, eos)
            owner = list(range(B)) + [None] * (rows - B)  # the request each row decodes
            since = [0] * rows  # the first step whose output belongs to the row's current request
            kept = [0] * rows  # at the step just read: the accepted drafts each row kept (its request may have ended)
            firsts: dict[int, tuple] = {}  # row -> (handle, index): its started request's first token, read with
            # the request's first step
            waiting = deque(range(B, len(prompts)))
            stats = BatchStats(prefill_s=t_first, bucket=rows)
            verify = True  # the next step may verify drafts (else, with ar_after_miss, it is an AR step)
            launched = 0

            group = min(REFILL_GROUP, rows)  # waiting requests prefilled together, ahead of the rows they take
            prefill_events: list = []  # CUDA: (start, end) around each refill's prefill, read after the call

            def prefill_timer():
                """Start timing a refill's prefill; the returned function ends it (stats.refill_prefill_s)."""
                if device.type == "cuda":
                    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    events[0].record()
                    prefill_events.append(events)
                    return events[1].record
                t = time.perf_counter()

                def done():
                    stats.refill_prefill_s += time.perf_counter() - t
                return done
            # Steps launched right after requests started, and the step in flight while the host started them:
            # their read waits for the prefill and move-in too (or the host's part of them), work that every kind of
            # step would pay alike (the same requests start whatever the steps verify), so their loop times are not
            # a price of their kind. (Timed, the kind that tends to follow a refill, an AR step
            # for the new rows, looked twice its cost at B = 64: the H200's chat cells, thirteenth lease.)
            behind_refill: set[int] = set()
            ready: deque = deque()  # (request, its prefill, its row there): prefilled, waiting for a free row
            idle: list[int] = []  # rows whose requests ended, not yet given waiting ones
            refill_rows = max(1, math.ceil(self.refill_at * rows))  # (batch.refill_at)

            def start(free: list[int]) -> bool:
                """Start waiting requests in the rows of `free` (behind any step in flight); True when any did. They
                are prefilled `group` at a time, before rows free up for all of them: one prefill (a graph of some
                400 kernels on a small model, launch-bound) then costs a whole group what it cost one request."""
                take = free[: len(waiting) + len(ready)]
                at = 0
                while at < len(take):
                    if not ready:  # (the scratch cache is overwritten only once every request in it has moved out)
                        requests = [waiting.popleft() for _ in range(min(group, len(waiting)))]
                        timing = prefill_timer()
                        prefilled = self._prefill_requests([prompts[i] for i in requests], sampling, requests)
                        timing()
                        stats.refill_prefills += 1
                        ready.extend((i, prefilled, j) for j, i in enumerate(requests))
                    moving = [ready.popleft() for _ in range(min(len(ready), len(take) - at))]
                    self._move_in(st, take[at: at + len(moving)], moving[0][1], [j for _, _, j in moving])
                    for b, (i, prefilled, j) in zip(take[at:], moving):
                        owner[b], since[b], active[b], firsts[b] = i, launched, True, (prefilled.first_host, j)
                    at += len(moving)
                stats.refills += len(take)
                if take:  # the next step launched runs behind these requests' prefill and move-in
                    behind_refill.add(launched)
                return bool(take)

            def launch():
                nonlocal launched
                drafts_k = self.k if verify else 0
                if controller is not None:  # (with ar_after_miss too: no drafts found, no verifying step pays)
                    prices = self._prices(st, stop.max_new_tokens // 2 if self._price_ahead is None
                                          else self._price_ahead)  # (`_measure_prices`)
                    if not sampling.greedy:  # (fractions pack their drafts: greedy steps only)
                        prices = {kind: t for kind, t in prices.items() if kind == int(kind)}
                    drafts_k = controller.choose(prices)
                stats.ar_steps += drafts_k <= 0 and self.k > 0
                stats.draft_lengths.append(drafts_k)
                launched += 1
                return launched - 1, self._launch(st, sampling, launched - 1, drafts_k)

            start([b for b in range(B) if not active[b]])  # requests that ended at their first token
            st.active.copy_(to_device(torch.tensor(active), device))
            pending = None
            self._blind_run = 0  # AR steps in a row that skipped a drafter's search (`_run_step`)
            if any(active):
                self._capture_all(st, sampling)
                pending = launch()
            draining = False  # the batch will move to a smaller bucket: no step is launched ahead until it has
            while pending is not None:
                # With overlap the device runs step i+1 while the host reads step i; a row that finished at step i
                # takes part in step i+1 too, and its extra tokens are dropped (the cache has room for them). A
                # request started in that row begins with the step after.
                ahead = launch() if self.overlap and not draining else None
                self._mark("sync")
                index, handle = pending
                out = self._read(handle)  # the step's one host sync
                self._mark("synced")
                now = time.perf_counter() - t0
                waited = index in behind_refill
                if controller is not None and stats.steps and not waited:
                    # (the first read also waited for the prefill)
                    controller.observe_time(stats.draft_lengths[index], now - last_read)
                behind_refill.discard(index)
                interval, last_read = now - (last_read if stats.steps else t_first), now
                queue_empty = not (waiting or ready)
                stats.steps += 1
                stepped, finished, emitted = [], [], 0
                for b in range(rows):
                    if not active[b] or index < since[b]:
                        continue
                    r = results[owner[b]]
                    before = len(r.tokens)
                    if b in firsts:  # a started request's first token, prefilled before this step
                        first_handle, j = firsts.pop(b)
                        if not self._append(r, [self._read(first_handle)[j]], now, stop, eos):
                            active[b] = False
                            finished.append(b)
                            emitted += 1
                            continue
                    stepped.append(b)
                    n = out[b][0]
                    r.accepted.append(n)
                    r.found.append(out[b][-1])
                    had = len(r.tokens)
                    if not self._append(r, out[b][1: n + 2], now, stop, eos):
                        active[b] = False
                        finished.append(b)
                    kept[b] = max(0, min(n, len(r.tokens) - had - 1))  # accepted drafts past the end dropped
                    emitted += len(r.tokens) - before
                stats.row_steps += len(stepped)
                stats.step_log.append(StepRecord(interval, stats.draft_lengths[index], rows, len(stepped),
                                                 emitted, waited, queue_empty))
                if controller is not None:
                    found = [out[b][-1] if self.drafter.variable_drafts or self.drafter.reports_found else self.k
                             for b in stepped]
                    controller.observe([out[b][-2] for b in stepped], [out[b][0] for b in stepped], found,
                                       [kept[b] for b in stepped])
                idle += finished
                # Requests start once enough rows are free, or all of them fit, or nothing else would run
                started = bool(waiting or ready) and bool(idle) and (
                    len(idle) >= min(refill_rows, len(waiting) + len(ready)) or not any(active)) and start(idle)
                if started or not (waiting or ready):
                    idle = []
                if started and ahead is not None:  # the step in flight: its read's wait held the host's start
                    behind_refill.add(ahead[0])
                if finished:
                    st.active.copy_(to_device(torch.tensor(active), device))
                if self.ar_after_miss:  # verify next only if the drafter found something for a live row
                    verify = started or any(active[b] and out[b][-1] > 0 for b in stepped)
                self._mark("end")
                if not any(active):
                    break
                live = [b for b in range(rows) if active[b]]
                smaller = None if waiting or ready or firsts else self._smaller_bucket(len(live), rows, sampling)
                draining = smaller is not None and ahead is not None
                if smaller is not None and ahead is None:  # nothing in flight: the rows can move now
                    st = self._shrink(st, live, smaller)
                    owner = [owner[b] for b in live] + [None] * (smaller - len(live))
                    since = [since[b] for b in live] + [0] * (smaller - len(live))
                    kept = [kept[b] for b in live] + [0] * (smaller - len(live))
                    active, rows = [True] * len(live) + [False] * (smaller - len(live)), smaller
                    if controller is not None:
                        controller.rebucket(rows, self.step_seconds.setdefault(rows, {}),
                                            self.step_timed.setdefault(rows, {}))
                    behind_refill.add(launched)  # (the next step's read also waits for the move)
                    stats.shrinks += 1
                pending = ahead or launch()
            sync()
            stats.decode_s = time.perf_counter() - t0 - t_first
            stats.refill_prefill_s += sum(a.elapsed_time(b) for a, b in prefill_events) / 1e3
        self.last_stats = stats
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        return results

    def _smaller_bucket(self, live: int, rows: int, sampling: SamplingParams) -> int | None:
        """The smallest bucket below `rows` that holds `live` rows and is ready to step (a state, and with CUDA graphs
        every kind of step captured, with the controller priced: warmed up, so that moving there captures and times
        nothing), or None. Only a drafter without per-row state of its own can move with its rows (`continuous`)."""
        if not self.continuous:
            return None
        extra = () if sampling.greedy else (sampling,)  # (a sampled step's graph is one of its setting)
        for bucket in sorted(b for b in self._states if live <= b < rows):
            kinds = self._graph_kinds(bucket, sampling.greedy)
            if all((bucket, kind) + extra in self._graphs for kind in kinds) and (
                    self.controller is None or bucket in self.prices):
                return bucket
        return None

    def _shrink(self, st: DecodeState, live: list[int], bucket: int) -> DecodeState:
        """Move the `live` rows of a batch (in order) to the first rows of the smaller `bucket`'s state, and their
        K/V to the first rows of the cache (where that bucket decodes); the rows past them are dead (inactive, one
        token). As requests run out the steps then cost what a batch of the rows left costs, not the full batch's:
        a batch of speculative steps drains unevenly (its requests end at different steps) and without this paid
        the full width for its last, nearly empty steps. Called with no step in flight."""
        device = self.model.device
        index = to_device(torch.tensor(live), device)
        # Only up to the longest row's end: past it a row holds junk of drafts never accepted.
        span = min(int(st.lengths[index].max()) + self.verify_width, self._base_cache.max_len)
        kv = self._base_cache.kv
        kv[:, :, : len(live), :, :span] = kv[:, :, index, :, :span]  # (the gather copies before the write)
        small = self._use(bucket, 0)
        n = len(live)
        small.history[:n] = st.history[index]
        small.history[n:] = 0
        small.lengths[:n] = st.lengths[index]
        small.lengths[n:] = 1
        small.budget[:n] = st.budget[index]
        small.budget[n:] = self.k
        small.active[:n] = True
        small.active[n:] = False
        small.seed.copy_(st.seed)
        small.salt[:n] = st.salt[index]
        if self.drafter is not None:
            self.drafter.move_rows(index, bucket)
        return small

    def _prefill_requests(self, prompts: list[list[int]], sampling: SamplingParams,
                          ids: list[int]) -> "Prefilled":
        """Prefill waiting requests (`ids`: their indices in the call, their sampling salts) into the scratch cache
        (rows 0..len(prompts)-1; a graph per group bucket and width, like the batch's prefill) and pick their first
        tokens, enqueued behind any step in flight."""
        device = self.model.device
        m = len(prompts)
        group = batch_bucket(m) if self.bucketed else m
        longest = max(len(p) for p in prompts)
        width = prefill_width(longest) if self.bucketed else longest
        padded = torch.zeros(group, width, dtype=torch.long)
        lengths = torch.ones(group, dtype=torch.long)
        for j, p in enumerate(prompts):
            padded[j, : len(p)], lengths[j] = torch.tensor(p), len(p)
        padded, lengths = to_device(padded, device), to_device(lengths, device)
        salts = to_device(torch.tensor(ids), device)
        positions = torch.arange(width, device=device)[None].expand(group, width)
        logits = self._prefill(padded, positions, lengths, scratch=True)  # (the drafter's pass inside)
        if sampling.greedy:
            first = logits.argmax(-1)[:m]
        else:
            first = categorical(probabilities(logits[:m], sampling), CounterRng(self._state.seed, salts, lengths))
        if device.type != "cuda":
            return Prefilled(padded[:m], lengths[:m], first, salts, (first, None))
        buf = torch.empty(m, dtype=torch.long, pin_memory=True)
        buf.copy_(first, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Prefilled(padded[:m], lengths[:m], first, salts, (buf, done))

    def _move_in(self, st: DecodeState, rows: list[int], prefilled: "Prefilled", slots: list[int]) -> None:
        """Start prefilled requests (their rows `slots` of the scratch cache) in the finished `rows` of the running
        batch: K/V copied in, history, lengths and draft budgets set; enqueued behind any step in flight, which so
        still runs the rows' old requests."""
        device = self.model.device
        index, src = to_device(torch.tensor(rows), device), to_device(torch.tensor(slots), device)
        width = prefilled.tokens.shape[1]
        self._cache.kv[:, :, index, :, :width] = self._scratch.kv[:, :, src, :, :width]
        lengths = prefilled.lengths[src]
        history = torch.zeros(len(rows), st.history.shape[1], dtype=torch.long, device=device)
        history[:, :width] = prefilled.tokens[src]
        history.scatter_(1, lengths[:, None], prefilled.first[src][:, None])
        st.history.index_copy_(0, index, history)
        st.lengths.index_copy_(0, index, lengths + 1)
        st.salt.index_copy_(0, index, prefilled.salts[src])
        st.budget.index_fill_(0, index, self.k)
        if self.drafter is not None:  # its own state of those rows (if any), from its pass in the prefill
            self.drafter.start_rows(index, src, width)

    def _append(self, r: RowResult, new: list[int], now: float, stop: StopCondition, eos: set[int]) -> bool:
        """Append a step's tokens to a row, cut at the first stop condition; False when the row is finished."""
        for tok in new:
            r.tokens.append(tok)
            r.token_times.append(now)
            if tok in eos:
                r.finish_reason = "eos"
            elif len(r.tokens) >= stop.max_new_tokens:
                r.finish_reason = "length"
            elif stop.stop_strings and self._hit_stop_string(r, stop.stop_strings):
                r.finish_reason = "stop"
            if r.finish_reason:
                return False
        return True

    def _hit_stop_string(self, r: RowResult, stops: tuple[str, ...]) -> bool:
        if self.tokenizer is None:
            raise SpecPilotError("stop strings need a tokenizer, and this target has none")
        # Decode only a tail long enough to hold the longest stop string (tokens are at least one character).
        tail = self.tokenizer.decode(r.tokens[-max(len(s) for s in stops) - 8:])
        return any(s in tail for s in stops)
