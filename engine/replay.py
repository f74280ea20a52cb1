"""The replay drafter (issue #24): acceptance replayed from a profile, for targets whose drafts cannot be measured.

A synthetic target (engine/synthetic.py) has the shapes and the step costs of an 8B model and random weights: no
drafter can predict it, so its acceptance would say nothing. The replay drafter proposes what the target itself will
emit, its greedy continuation of the prompt computed once by AR (`Engine.prepare`), and corrupts each draft with a
chance such that a step accepts at least i drafts with the probability the profile gives (`drafter.acceptance`, in
the form the bench reports a real drafter's `acceptance_by_position`). Verification, the gate and every kernel are
real: only the drafter's choice of tokens is replayed, and its cost, when `drafter.model` names an EAGLE-3 head (or
`random-eagle3`, a head of the target's shape with random weights), is that head's real forwards, their drafts
discarded. Every figure from it is marked `replay`.

How a row finds its continuation: its whole history is compared with every reference sequence (prompt + AR
continuation) up to the shorter of the two, on the device, at each step ([rows, references, positions]: cheap next
to an 8B step, and it needs no per-row state, so rows may switch requests between steps). A row whose history has
left its reference (the target emitted another token than AR did: a bf16 near-tie computed in another order) finds
none and drafts nothing from then on; the bench's τ shows it. (Synthetic targets are drawn so that their greedy
tokens win by a wide margin: engine/synthetic.py.)

Trees (static, `propose_tree`): a real drafter's tree wins over its chain where the target's token is not the
drafter's first candidate but its second or third, which the siblings hold. So at each depth a draw says which of
the drafter's candidates the target's token is: the 1st with the chain's chance (the profile's a_i / a_{i-1}), the
2nd, 3rd, ... with `drafter.ranks`' chances, or none; the node on the path of those candidates holds the true token
and every other node a wrong id of its depth, so a tree step verifies all N nodes (its real cost) and accepts as
deep as its branches follow the candidates. Without `ranks` the tree accepts along its first-child chain only, as
deep as the chain would. `best_static_tree` builds, for a rank profile, the tree of N drafts that accepts the most
on average, and `expected_accepted` says how much a tree should accept under one.

Corruption: draft i is kept with probability p_i = a_i / a_{i-1} (a_0 = 1), else replaced by another id. Draft i is
accepted when it and every draft before it are kept, so a step verifying k drafts accepts at least i of them with
probability a_i. The draws are a function of (seed, the reference's index, the row's length, the draft's index)
(engine/sampling.py's CounterRng): the same run replays the same acceptance, and a captured step draws anew.
"""
from __future__ import annotations

import heapq

import torch

from .drafters import Drafter, Proposal
from .model import compiled
from .sampling import CounterRng, SamplingParams


def kept_probabilities(acceptance: list[float]) -> list[float]:
    """p_i, the chance that draft i is kept, from a_i, the chance that a step accepts at least i drafts (a_i
    non-increasing in [0, 1]); a draft after one the profile never reaches is kept with 0."""
    kept, before = [], 1.0
    for a in acceptance:
        kept.append(a / before if before > 0 else 0.0)
        before = a
    return kept


def ranks_from_trees(chain: list[float], wider: dict[int, list[float]]) -> list[list[float]]:
    """`drafter.ranks` from measured acceptance (the bench's acceptance_by_position, per depth): `chain` a chain's of
    depth D, `wider[w]` that of a "fishbone" tree of depth D (the first-child chain with w candidates at each depth,
    only the chain expanded), for w = 2, 3, ... W. Such a tree accepts depth d when the path to it was the chain and
    the target's token is one of the w candidates at d, so the chance that it is candidate r + 1 given a right path
    is (wider[r + 1][d] - wider[r][d]) / chain[d - 1] (wider[1] = chain, chain[0 - 1] = 1). Measured acceptance is
    noisy: negative chances are 0, and a depth whose chances would pass 1 with the chain's is scaled down to fit;
    past a depth the chain never reaches nothing is known (0). The replay then assumes these chances for every
    right path, not only the chain (which is where they were measured)."""
    widths = sorted(wider)
    if widths != list(range(2, len(widths) + 2)):
        raise ValueError(f"fishbone widths must be 2, 3, ... without a gap, got {widths}")
    if any(len(a) != len(chain) for a in wider.values()):
        raise ValueError("every fishbone's acceptance needs the chain's depth")
    levels = [chain] + [wider[w] for w in widths]
    out = []
    for d, first in enumerate(kept_probabilities(chain)):
        before = chain[d - 1] if d else 1.0
        chances = [max(0.0, (levels[r][d] - levels[r - 1][d]) / before) if before > 0 else 0.0
                   for r in range(1, len(levels))]
        room = max(0.0, 1.0 - first)
        if sum(chances) > room:
            chances = [c * room / sum(chances) for c in chances]
        out.append(chances)
    return out


def rank_edges(acceptance: list[float], ranks: list[list[float]]) -> list[list[float]]:
    """Per depth, the cumulative chances that the target's token is the drafter's 1st, 2nd, ... candidate (the 1st's
    from the acceptance profile, the others' from `ranks`), padded with the last to one width: a uniform draw u
    falls at candidate c where edges[c - 1] <= u < edges[c], and is no candidate at all past the last."""
    rows = []
    for i, first in enumerate(kept_probabilities(acceptance)):
        edge, total = [], 0.0
        for p in [first, *(ranks[i] if i < len(ranks) else [])]:
            total += p
            edge.append(total)
        rows.append(edge)
    width = max(map(len, rows))
    return [edge + [edge[-1]] * (width - len(edge)) for edge in rows]


def _candidate_chances(acceptance: list[float], ranks: list[list[float]]) -> list[list[float]]:
    """Per depth, the chance that the target's token is the drafter's 1st, 2nd, ... candidate (`rank_edges`)."""
    return [[e - (row[c - 1] if c else 0.0) for c, e in enumerate(row)] for row in rank_edges(acceptance, ranks)]


def expected_accepted(acceptance: list[float], ranks: list[list[float]], paths: list[list[int]]) -> float:
    """Drafts a step of this static tree accepts on average under the rank profile: over its nodes, the product
    along each node's path of the chance that the target's token is that candidate (0 past the profile)."""
    chances = _candidate_chances(acceptance, ranks)
    total = 0.0
    for path in {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}:
        chance = 1.0
        for depth, c in enumerate(path):
            chance *= chances[depth][c] if depth < len(chances) and c < len(chances[depth]) else 0.0
        total += chance
    return total


def best_static_tree(acceptance: list[float], ranks: list[list[float]], drafts: int) -> list[list[int]]:
    """The static tree of `drafts` nodes (the root not counted) that accepts the most drafts a step on average under
    a rank profile, as `tree.paths` takes it, best path first: a path (candidates c_1 .. c_d) is accepted with the
    product over its depths of the chance that the target's token is candidate c_i there (`rank_edges`), and a
    tree's expected accepted drafts are the sum over its nodes (Sequoia's construction, arXiv:2402.12374). A path's
    chance never exceeds its parent's, so taking paths best first from a frontier gives a tree that holds every
    prefix. Fewer nodes when no further path can be accepted."""
    chances = _candidate_chances(acceptance, ranks)
    frontier = [(-q, (c,)) for c, q in enumerate(chances[0]) if q > 0]
    heapq.heapify(frontier)
    paths: list[list[int]] = []
    while frontier and len(paths) < drafts:
        negative, path = heapq.heappop(frontier)
        paths.append(list(path))
        if len(path) < len(chances):
            for c, q in enumerate(chances[len(path)]):
                if q > 0:
                    heapq.heappush(frontier, (negative * q, path + (c,)))
    return paths


def _references(history, lengths, k, table, table_lengths):
    """Each row's reference in `table` [R, S] (prompt + AR continuation, `table_lengths` [R] long): ([rows, k] the
    true continuation, [rows] how many of it the reference has, [rows] which reference)."""
    width = min(history.shape[1], table.shape[1])
    position = torch.arange(width, device=history.device)
    compared = torch.minimum(lengths[:, None], table_lengths[None, :])  # [rows, R]
    same = (history[:, None, :width] == table[None, :, :width]) | (position >= compared[..., None])
    match = same.all(-1) & (table_lengths[None, :] > lengths[:, None])  # and the reference continues past the row
    found = match.any(-1)
    ref = match.to(torch.int8).argmax(-1)  # the first matching reference (argmax of a bool row: its first True)
    at = (lengths[:, None] + torch.arange(k, device=history.device)).clamp(max=table.shape[1] - 1)
    truth = table[ref].gather(1, at)
    valid = torch.where(found, (table_lengths[ref] - lengths).clamp(0, k), torch.zeros_like(lengths))
    return truth, valid, ref


def replay_tree(history, lengths, table, table_lengths, edges, child, seed, vocab: int):
    """A static tree's [rows, N - 1] node tokens and [rows] valid counts: at each depth a uniform draw (the chain's
    keep draw) picks the candidate that the target's token is (`edges` [depth, C], cumulative), or none; the node on
    the path of picked candidates (`child` [N - 1, depth]: each node's child indices from the root, -1 past its
    depth) holds the true token of its depth, every other node a wrong id of its depth (a distinct one per node)."""
    rows, depth = history.shape[0], edges.shape[0]
    truth, valid, ref = _references(history, lengths, depth, table, table_lengths)
    u = CounterRng(seed, ref, lengths).uniform((rows, depth))
    rank = (u[..., None] >= edges[None]).sum(-1)
    rank = torch.where(rank >= edges.shape[1], -2, rank)  # (no candidate: matches no child index)
    on_path = ((rank[:, None, :] == child[None]) | (child[None] < 0)).all(-1)
    node_depth = (child >= 0).sum(-1)
    at = truth.gather(1, (node_depth - 1)[None].expand(rows, -1))
    index = torch.arange(1, child.shape[0] + 1, device=history.device)
    return torch.where(on_path, at, (at + index[None]) % vocab), valid


def replay_drafts(history: torch.Tensor, lengths: torch.Tensor, k: int, table: torch.Tensor,
                  table_lengths: torch.Tensor, kept: torch.Tensor, seed: torch.Tensor, vocab: int):
    """[rows, k] drafts, [rows] valid counts and the [rows, k] true continuation: each row's continuation in the
    reference `table` [R, S] (prompt + AR continuation, `table_lengths` [R] long), each draft replaced by another id
    unless a uniform draw falls below its `kept` probability [k]."""
    rows = history.shape[0]
    truth, valid, ref = _references(history, lengths, k, table, table_lengths)
    draws = CounterRng(seed, ref, lengths)
    keep = draws.uniform((rows, k)) < kept[None, :k]
    other = (truth + 1 + (draws.uniform((rows, k)) * (vocab - 1)).long().clamp(max=vocab - 2)) % vocab
    return torch.where(keep, truth, other), valid, truth


class ReplayDrafter(Drafter):
    """Proposes each row's reference continuation, corrupted by the profile; with `cost` (a drafter, an EAGLE-3
    head's), also runs that drafter's steps and discards its drafts."""

    name = "replay"
    variable_drafts = True  # a row past its reference's end, or off it, has fewer

    def __init__(self, acceptance: list[float], vocab: int, device, cost: Drafter | None = None, seed: int = 0,
                 ranks: list[list[float]] | None = None):
        self.acceptance, self.vocab, self.device, self.cost = list(acceptance), vocab, device, cost
        self.kept = torch.tensor(kept_probabilities(acceptance), dtype=torch.float32, device=device)
        self.edges = torch.tensor(rank_edges(acceptance, ranks or []), dtype=torch.float32, device=device)
        self.seed = torch.tensor([seed], dtype=torch.long, device=device)
        self.needs_hidden_states = cost.needs_hidden_states if cost is not None else None
        self.stateless = cost is None or cost.stateless
        self.backlog = cost.backlog if cost is not None else 0
        # The replay's own work (find each row's reference, draw its corruptions: some 110 small kernels eagerly,
        # 0.2 ms of an 8B step that a real drafter does not pay) compiled with the decoder's steps (`prepare`)
        self._drafts, self._tree = replay_drafts, replay_tree
        self.references: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + AR continuation
        self.table = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.table_lengths = torch.zeros(1, dtype=torch.long, device=device)

    def missing(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The prompts (each once) whose reference is unknown or shorter than max_new_tokens new tokens."""
        out = {}
        for p in prompts:
            have = self.references.get(tuple(p))
            if have is None or len(have) - len(p) < max_new_tokens:
                out[tuple(p)] = list(p)
        return list(out.values())

    def add_references(self, sequences: dict[tuple[int, ...], list[int]]) -> bool:
        """Keep these references (prompt -> prompt + continuation); True when the table moved to new memory (steps
        captured before read the old one: the caller drops them)."""
        self.references.update(sequences)
        seqs = list(self.references.values())
        rows, width = len(seqs), max(len(s) for s in seqs)
        moved = rows > self.table.shape[0] or width > self.table.shape[1]
        if moved:
            self.table = torch.zeros(rows, width, dtype=torch.long, device=self.device)
            self.table_lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.table.zero_()
        self.table_lengths.zero_()
        for i, s in enumerate(seqs):
            self.table[i, : len(s)] = torch.tensor(s, device=self.device)
            self.table_lengths[i] = len(s)
        return moved

    def propose(self, history, lengths, k: int, sampling: SamplingParams, generator) -> Proposal:
        if self.cost is not None:
            self.cost.propose(history, lengths, k, sampling, generator)
        tokens, valid, _ = self._drafts(history, lengths, k, self.table, self.table_lengths, self.kept, self.seed,
                                        self.vocab)
        return Proposal(tokens, valid)

    def propose_tree(self, history, lengths, shape):
        """A static tree's nodes [rows, N - 1] and valid flags (`replay_tree`): at each depth the target's token is
        the drafter's 1st candidate (child 0) with the profile's chance, its 2nd, 3rd, ... (children 1, 2, ...) with
        `ranks`' (none: never), so a tree accepts as deep as its branches reach the picked candidates, and without
        `ranks` along its first-child chain only, as deep as a chain would. Every other node holds a wrong id: its
        verification costs what a real node's does. With a cost head, the head drafts the same tree shape (its
        nodes discarded)."""
        if self.cost is not None:
            self.cost.propose_tree(history, lengths, shape)
        child = self._children(shape, history.device)
        tokens, valid = self._tree(history, lengths, self.table, self.table_lengths, self.edges[: shape.depth],
                                   child, self.seed, self.vocab)
        return tokens, valid[:, None] >= (child >= 0).sum(-1)[None]

    def _children(self, shape, device) -> torch.Tensor:
        """[N - 1, depth] each node's child indices from the root, -1 past its depth (made once per shape)."""
        cached = getattr(self, "_tree_cache", None)
        if cached is None or cached[0] != (shape, device):
            paths = shape.paths[1:]
            cached = ((shape, device), torch.tensor([list(p) + [-1] * (shape.depth - len(p)) for p in paths],
                                                    dtype=torch.long, device=device))
            self._tree_cache = cached
        return cached[1]

    # The cost drafter's state follows the batch as its own would.
    def reserve(self, rows, max_len):
        if self.cost is not None:
            self.cost.reserve(rows, max_len)

    def prefill_prompts(self, tokens, positions, lengths, hidden=None):
        if self.cost is not None:
            self.cost.prefill_prompts(tokens, positions, lengths, hidden=hidden)

    def prefill(self, tokens, positions, max_len, hidden=None, lengths=None):
        if self.cost is not None:
            self.cost.prefill(tokens, positions, max_len, hidden=hidden, lengths=lengths)

    def update(self, accepted, hidden=None, searched=True):
        if self.cost is not None:
            self.cost.update(accepted, hidden=hidden, searched=searched)

    def absorb(self, history, lengths):
        if self.cost is not None:
            self.cost.absorb(history, lengths)

    def snapshot(self):
        return self.cost.snapshot() if self.cost is not None else None

    def restore(self, state):
        if self.cost is not None:
            self.cost.restore(state)

    def prepare(self, ops, layer_fn, compile):
        if compile:
            self._drafts, self._tree = compiled(replay_drafts), compiled(replay_tree)
        if self.cost is not None:
            self.cost.prepare(ops, layer_fn, compile)
