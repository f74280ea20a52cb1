"""Drafters: propose up to k tokens per row for the current context, then learn what was accepted.

Every drafter works on device tensors and returns fixed shapes ([B, k] tokens, [B] valid counts), so a decoding
step needs no host sync and its model forwards can be captured as CUDA graphs. A drafter that samples also returns
its proposal distributions q [B, k, V] for speculative sampling; deterministic drafters return None (q is one-hot).
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..kernels.builtin import attention_sdpa
from .model import Block, KVCache, Transformer, compiled
from .sampling import SamplingParams, categorical, probabilities


def rows_of(cache: KVCache, rows: int) -> KVCache:
    """The first `rows` rows of a cache, sharing its memory: every batch bucket decodes in one allocation (a layer's
    slice of it is still contiguous), and graphs captured for one bucket stay valid while others run."""
    view = copy.copy(cache)
    view.kv = cache.kv[:, :, :rows]
    view.k, view.v = view.kv[0], view.kv[1]
    return view


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] long; entries at or past `valid` are filler
    valid: torch.Tensor  # [B] long, 0..k
    probs: torch.Tensor | None = None  # [B, k, V] proposal distribution q when sampled
    # [B]: the drafts each row would have in a step as wide as the drafter's widest, where that is not `valid` (which
    # a narrower step asked for caps): what the batch controller plans with (`Drafter.reports_found`). None: valid.
    found: torch.Tensor | None = None


class Drafter(ABC):
    """The interface: `prefill` once per batch, then `propose` / `update` once per step."""

    name = "base"
    # True when the drafter finds a different number of drafts for each row (valid < k), at the same cost for any k:
    # the decoder then always asks for k, and what it found tells the batch controller which rows have drafts.
    variable_drafts = False
    # True when a row's drafts may differ from the others' although the decoder asks for a step's width only (not
    # variable_drafts: each draft has a cost): the proposal's `found` then tells the batch controller what each row
    # would have in the widest step (an EAGLE-3 head with prompt lookup deeper than its chain, engine/eagle3.py).
    reports_found = False
    # The target layers (0-based) whose outputs the drafter reads (an EAGLE-3 head: three of them). None: none. When
    # set, the target's forwards also return those hidden states (Transformer.forward's `aux_layers`), and the
    # decoder hands them over: the prompt's to `prefill` (hidden=, lengths=), each step's to `update` (hidden=).
    needs_hidden_states: tuple[int, ...] | None = None
    # True when the proposals depend on the history alone (no per-row state of the drafter's own): a row of the
    # batch may then take a new request between steps (continuous batching).
    stateless = False
    # True when the drafter keeps per-row state but can set a row's up for a new request (`start_rows`): continuous
    # batching then works as for a stateless one.
    refills = False
    # How many AR steps in a row a drafter with state of its own can go without its search (BLIND_AR), keeping
    # their pairs for `absorb`; 0: none (a draft model's cache would miss their tokens). A stateless drafter skips
    # the search at no cost to later drafts.
    backlog = 0

    def reserve(self, rows: int, max_len: int) -> None:
        """Make room for batches of up to `rows` rows and `max_len` positions: the decoder calls it when it
        (re)allocates its own cache, and captured steps then keep pointing at the same memory for every batch size."""

    def prefill_prompts(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                        hidden: torch.Tensor | None = None) -> None:
        """Inside the batch's prefill (right-padded prompts `tokens` [B, T] at `positions`, `lengths` [B], with
        `needs_hidden_states` the target's states of them `hidden` [B, T, n * hidden]), and with CUDA graphs
        captured with it, before `prefill`: the drafter's own pass over the prompts into its rows 0..B-1. As with
        `prefill_refills`, a warm-up that captures every prefill then leaves nothing of it to compile or plan in a
        call. Nothing by default."""

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int,
                hidden: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> None:
        """See the (right-padded) prompts; `max_len` bounds every position this batch will use. The decoder has
        run `prefill_prompts` inside the prefill; a caller that has not gives a drafter with `needs_hidden_states`
        `hidden` ([B, T, n * hidden], the target's states of the prompt tokens) and `lengths` ([B], each
        prompt's length), and it runs that pass here."""

    @abstractmethod
    def propose(self, history: torch.Tensor, lengths: torch.Tensor, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Up to k tokens per row after `history[b, :lengths[b]]`."""

    def reserve_refills(self, rows: int, max_len: int) -> None:
        """Make room for `rows` waiting requests of up to `max_len` prompt tokens, prefilled ahead of the rows they
        will take (continuous batching): the decoder calls it when it (re)allocates its scratch cache, before any
        prefill graph that runs `prefill_refills` is captured on that memory."""

    def prefill_refills(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                        hidden: torch.Tensor | None = None) -> None:
        """Inside the prefill of waiting requests (right-padded prompts `tokens` [m, T] at `positions`, `lengths`
        [m], with `needs_hidden_states` the target's states of them `hidden` [m, T, n * hidden]), and with CUDA
        graphs captured with it: the drafter's own pass over them, kept in its refill rows 0..m-1 until
        `start_rows` moves them into the running batch. Its shapes are the prefill's (a group of requests padded
        to a bucket, a padded width), so a warm-up that captures every prefill leaves nothing for a refill to
        compile, plan or capture, and a refill launches it as part of one graph. Nothing by default."""

    def start_rows(self, rows: torch.Tensor, slots: torch.Tensor, width: int) -> None:
        """Rows `rows` ([m] long) of the running batch start the requests prefilled in refill rows `slots` ([m]
        long) of the last `prefill_refills` (prompts of at most `width` tokens), as `prefill` would have set them
        up. Enqueued behind the step in flight, whose own update of these rows it overrides. Nothing to set up
        without per-row state; a drafter with some sets its rows up here and says so with `refills` (one that
        cannot never runs continuously batched)."""

    def move_rows(self, live: torch.Tensor, rows: int) -> None:
        """The batch moved to a smaller bucket of `rows` rows: the state of rows `live` ([n] long, in order) goes to
        rows 0..n-1, and the current batch is the first `rows` rows. Nothing to move without per-row state."""

    def update(self, accepted: torch.Tensor, hidden: torch.Tensor | None = None, searched: bool = True) -> None:
        """Learn from the number of drafts each row accepted this step ([B] long, on device). Called after every
        verification step; with `needs_hidden_states` after every step, AR steps too (accepted 0), with `hidden`
        [B, T, n * hidden]: the target's states of the step's T verified slots, row b's first accepted[b] + 1 of them
        those of tokens now in the history (the rest are junk, possibly not even finite). `searched` False: an AR
        step that did not call `propose` (BLIND_AR; only with a `backlog`)."""

    def absorb(self, history: torch.Tensor, lengths: torch.Tensor) -> None:
        """Take in what the steps that skipped the search left pending (at most `backlog` of them), so that the
        next `propose` drafts as if every step had searched. The decoder calls it before a step that searches after
        such steps, and when `backlog` of them ran in a row. Nothing by default."""

    def snapshot(self):
        """The device state a step changes, or None: the decoder runs steps it then undoes (warm-ups before a CUDA
        graph capture, timing a step for the controller's prices) and puts this back afterwards with `restore`."""
        return None

    def restore(self, state) -> None:
        """Put back what `snapshot` returned."""

    def prepare(self, ops, layer_fn, compile: bool) -> None:
        """Use the decoder's kernel implementations and layer function; compile device work when asked."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose what followed.

    Tries n = max_ngram down to min_ngram and keeps the longest n that matches. Runs as tensor ops over the whole
    history on the device: no host round trip, and cheap next to a target forward.
    """

    name = "ngram"
    variable_drafts = True
    stateless = True
    # On CUDA the search runs as one Triton kernel (kernels/triton_ngram.py, the same proposals) instead of the
    # torch ops below, which compile to several kernels, each a launch gap in the step's graph.
    use_kernel = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram drafter needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def prepare(self, ops, layer_fn, compile):
        if compile:
            self._search = compiled(self._search)

    def propose(self, history, lengths, k, sampling, generator):
        if history.is_cuda and self.use_kernel:
            from ..kernels.triton_ngram import MAX_NGRAM, ngram_search

            if self.max_ngram <= MAX_NGRAM:
                return Proposal(*ngram_search(history, lengths, k, self.max_ngram, self.min_ngram))
        return Proposal(*self._search(history, lengths, k))

    def propose_branches(self, history, lengths, branches: int, depth: int):
        """Up to `branches` candidate continuations a row, [B, branches, depth] tokens and [B, branches] valid
        counts: what followed the `branches` latest occurrences of the longest tail n-gram that occurs (branch 0 is
        `propose`'s chain). Fewer occurrences leave the other branches empty (valid 0). Torch ops on the device."""
        B, S = history.shape
        device = history.device
        chosen = torch.full((B, branches), -1, dtype=torch.long, device=device)  # index of each branch's next token
        cols = torch.arange(S, device=device)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if S <= n:
                continue
            tail_idx = (lengths[:, None] - n + torch.arange(n, device=device)[None]).clamp(min=0)
            tail = history.gather(1, tail_idx)
            hit = (history.unfold(1, n, 1) == tail[:, None, :]).all(-1)
            starts = cols[: S - n + 1]
            ok = hit & (starts[None] + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
            after = torch.where(ok, starts[None] + n, -1)
            latest = after.topk(min(branches, after.shape[1]), dim=1).values  # descending; -1 where fewer
            if latest.shape[1] < branches:
                latest = torch.cat([latest, latest.new_full((B, branches - latest.shape[1]), -1)], 1)
            take = (chosen[:, :1] < 0) & (latest[:, :1] >= 0)  # rows with no longer match take this n's
            chosen = torch.where(take, latest, chosen)
        offs = (chosen[..., None] + torch.arange(depth, device=device)).clamp(0, S - 1)
        tokens = history.gather(1, offs.view(B, -1)).view(B, branches, depth)
        valid = torch.where(chosen >= 0, (lengths[:, None] - chosen).clamp(0, depth), 0)
        return tokens, valid

    def propose_tree(self, history, lengths, shape):
        """Draft-tree nodes (engine/tree.py) for every row: tokens and valid flags [B, N - 1] of nodes 1..N-1. A
        node whose path is [b, 0, 0, ...] is draft d = len(path) of branch b (`propose_branches`); a node with any
        other path (a second child below the first level) has no n-gram continuation and stays empty."""
        index, depth, fillable = self._tree_index(shape, history.device)
        branches = int(max(p[0] for p in shape.paths[1:])) + 1
        tokens, valid = self.propose_branches(history, lengths, branches, shape.depth)
        node_tokens = tokens.reshape(tokens.shape[0], -1)[:, index]
        node_valid = fillable[None] & (valid.gather(1, (index // shape.depth)[None].expand(valid.shape[0], -1))
                                       >= depth[None])
        return node_tokens, node_valid

    def _tree_index(self, shape, device):
        """Per node 1..N-1: its (branch, draft) as an index into [branches x depth], its depth, whether n-gram
        drafting can fill it."""
        cached = getattr(self, "_tree_cache", None)
        if cached is not None and cached[0] == (shape, device):
            return cached[1]
        paths = shape.paths[1:]
        index = torch.tensor([p[0] * shape.depth + len(p) - 1 for p in paths], device=device)
        depth = torch.tensor([len(p) for p in paths], device=device)
        fillable = torch.tensor([all(c == 0 for c in p[1:]) for p in paths], device=device)
        self._tree_cache = ((shape, device), (index, depth, fillable))
        return index, depth, fillable

    def _search(self, history, lengths, k: int):
        B, S = history.shape
        device = history.device
        best_start = torch.full((B,), -1, dtype=torch.long, device=device)  # index of the token after the match
        cols = torch.arange(S, device=device)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if S <= n:
                continue
            tail_idx = (lengths[:, None] - n + torch.arange(n, device=device)[None]).clamp(min=0)
            tail = history.gather(1, tail_idx)  # [B, n], the last n tokens
            windows = history.unfold(1, n, 1)  # [B, S-n+1, n]
            hit = (windows == tail[:, None, :]).all(-1)
            starts = cols[: S - n + 1]
            # a match must end before the tail starts (so a next token exists) and the tail must be complete
            ok = hit & (starts[None] + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
            last = torch.where(ok, starts[None], -1).amax(1)
            found = (last >= 0) & (best_start < 0)
            best_start = torch.where(found, last + n, best_start)
        offs = best_start[:, None] + torch.arange(k, device=device)[None]
        tokens = history.gather(1, offs.clamp(0, S - 1))
        valid = torch.where(best_start >= 0, (lengths - best_start).clamp(0, k), 0)
        return tokens, valid


class ModelDrafter(Drafter):
    """A draft model with its own KV cache: a separate model sharing the target's vocabulary, or the target's own
    first `n_layers` layers with its final norm and LM head (layer-skip self-draft)."""

    def __init__(self, model: Transformer, n_layers: int | None = None, name: str = "model"):
        self.model, self.n_layers, self.name = model, n_layers, name
        self.cache: KVCache | None = None  # the current batch's rows of `_base`
        self._base: KVCache | None = None
        self.ops, self.layer_fn = model.default_ops, Block.forward

    def prepare(self, ops, layer_fn, compile):
        self.ops, self.layer_fn = ops, layer_fn

    def reserve(self, rows, max_len):
        base = self._base
        if base is None or base.k.shape[1] < rows or base.max_len < max_len:
            self._base = self.model.new_cache(rows, max_len, self.n_layers)

    def prefill(self, tokens, positions, max_len):
        self.reserve(tokens.shape[0], max_len)
        self.cache = rows_of(self._base, tokens.shape[0])
        self.model(tokens, positions, self.cache, self.n_layers, ops=self.ops._replace(attention=attention_sdpa))

    def _step(self, tokens, positions):
        return self.model(tokens, positions, self.cache, self.n_layers, ops=self.ops, layer_fn=self.layer_fn)[:, -1]

    def propose(self, history, lengths, k, sampling, generator):
        B = history.shape[0]
        # Feed the last two tokens: the newest is not in our cache yet, and when every draft of the last step was
        # accepted the one before it is not either. Recomputing an entry we already have is harmless.
        pos = (lengths[:, None] - 2 + torch.arange(2, device=history.device)[None]).clamp(min=0)
        logits = self._step(history.gather(1, pos), pos)
        tokens, probs = [], []
        next_pos = lengths[:, None]
        for i in range(k):
            if sampling.greedy:
                tok = logits.argmax(-1)
            else:
                q = probabilities(logits, sampling)
                tok = categorical(q, generator)
                probs.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = self._step(tok[:, None], next_pos + i)
        valid = torch.full((B,), k, dtype=torch.long, device=history.device)
        return Proposal(torch.stack(tokens, 1), valid, torch.stack(probs, 1) if probs else None)
