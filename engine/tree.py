"""Draft trees: their shape, the attention mask of a tree step, greedy acceptance and the KV compaction after it.

A tree step verifies N tokens a row in one target forward: node 0 is the row's last token (the root), every other
node a draft whose parent is an earlier node. A static tree's shape is given by paths, as Medusa and EAGLE write them:
the path [i, j] is the j-th child of the i-th child of the root (0-based, children ranked by the drafter). Nodes are
numbered in path order sorted by depth (breadth first), so a parent always comes before its children.

Node n of a row whose last token sits at position P has position P + depth(n) (what RoPE sees) and cache slot
P + n (where its K/V go: every node needs a slot of its own). It attends to the row's cache before P and to its
ancestors (itself included) among the tree's slots. Greedy acceptance keeps the deepest node whose every ancestor
(itself included, the root excepted) is its parent's target argmax; the row emits that path's drafts and the
target's argmax at its end. Then each accepted node's K/V moves from slot P + n to slot P + depth(n), so the cache
holds the accepted sequence in order, as a chain step leaves it.

With sampling (temperature > 0), `accept_tree_sampled` walks the tree by multi-draft speculative sampling: each
node's children are tried in rank order by rejection sampling against the target's residual, so the emitted tokens
are distributed exactly as sampling from the target alone (SpecInfer; EAGLE; SGLang's target-only tree sampling).

A dynamic tree (EAGLE-2; `DynamicTree`, `grow_dynamic_tree`) has a shape of its own per row and step, chosen by the
drafter's probabilities: its parents, ancestors and depths are tensors [B, N, ...] (`RowTrees`), which the functions
here take in place of a static tree's [N, ...] (node n then sits at position P + its row's depth(n)). Its N is fixed.

Everything here has static shapes (N nodes a row every step), so a tree step captures as one CUDA graph.
This module knows nothing of models or drafters (SGLang keeps tree building apart from the model the same way).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, categorical, probabilities, uniform


@dataclass(frozen=True)
class TreeShape:
    """A static draft tree: `parents[n]` of each node (node 0, the root, has -1), its `depth`, and the path of child
    ranks that names it. `ancestors[n][m]` is True when m is an ancestor of n or n itself."""
    paths: tuple[tuple[int, ...], ...]  # per node, node 0's is ()
    parents: tuple[int, ...]
    depths: tuple[int, ...]

    @property
    def nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def ancestors(self, device=None) -> torch.Tensor:
        """bool [N, N]: row n marks n's ancestors and n itself."""
        anc = torch.zeros(self.nodes, self.nodes, dtype=torch.bool)
        for n in range(self.nodes):
            m = n
            while m >= 0:
                anc[n, m] = True
                m = self.parents[m]
        return anc.to(device)

    def ancestor_at_depth(self, device=None) -> torch.Tensor:
        """long [N, depth + 1]: node n's ancestor at each depth d <= depth(n) (n itself at its own depth; 0 beyond)."""
        out = torch.zeros(self.nodes, self.depth + 1, dtype=torch.long)
        for n in range(self.nodes):
            m = n
            while m >= 0:
                out[n, self.depths[m]] = m
                m = self.parents[m]
        return out.to(device)


def tree_from_paths(paths) -> TreeShape:
    """The tree of these paths (lists of child ranks), each path's every prefix included, breadth first. Refused
    with a ValueError naming the problem: an empty or negative path entry, or more than 256 nodes."""
    seen = set()
    for p in paths:
        p = tuple(p)
        if not p or any(not isinstance(c, int) or c < 0 for c in p):
            raise ValueError(f"tree path {list(p)}: must be a non-empty list of child ranks >= 0")
        for i in range(1, len(p) + 1):
            seen.add(p[:i])
    ordered = [()] + sorted(seen, key=lambda p: (len(p), p))
    if len(ordered) > 256:
        raise ValueError(f"a draft tree of {len(ordered)} nodes: at most 256")
    index = {p: i for i, p in enumerate(ordered)}
    return TreeShape(tuple(ordered), tuple(index[p[:-1]] if p else -1 for p in ordered),
                     tuple(len(p) for p in ordered))


def chains(branches: int, depth: int) -> TreeShape:
    """`branches` chains of `depth` drafts from the root: what a drafter with several candidate continuations (the
    n-gram drafter's several matches) fills."""
    return tree_from_paths([[b] + [0] * (d - 1) for b in range(branches) for d in range(1, depth + 1)])


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic draft tree (SGLang's `build_tree`), shaped per row and step by the drafter's probabilities
    (`grow_dynamic_tree`): `depth` levels, the `topk` best drafts after each node expanded, `tokens` nodes verified
    a row, the root included (SGLang's speculative_num_draft_tokens)."""
    depth: int
    topk: int
    tokens: int

    @property
    def nodes(self) -> int:
        return self.tokens

    @property
    def candidates(self) -> int:
        """Drafts scored a step, of which tokens - 1 are kept: the root's topk, then topk x topk a level."""
        return self.topk + (self.depth - 1) * self.topk ** 2

    @property
    def expanded(self) -> int:
        """Nodes the drafter runs to draft their children, the root aside: the beam of each level above the last."""
        return (self.depth - 1) * self.topk


@dataclass(frozen=True)
class RowTrees:
    """A draft tree per row, N nodes each (node 0 the root, each parent before its children): a `TreeShape`'s
    tensors with the batch in front. `row_trees` builds them."""
    parents: torch.Tensor  # [B, N] long, -1 at the root
    ancestors: torch.Tensor  # [B, N, N] bool: [b, n, m] when m is an ancestor of n or n itself
    depths: torch.Tensor  # [B, N] long
    at_depth: torch.Tensor  # [B, N, depth + 1] long: n's ancestor at each depth up to its own (0 beyond)


def row_trees(parents: torch.Tensor, depths: torch.Tensor, depth: int) -> RowTrees:
    """The trees of these parents [B, N] and depths [B, N] (at most `depth`): depth + 1 steps up the parents, as
    tensor ops (no host synchronization)."""
    B, N = parents.shape
    device = parents.device
    node = torch.arange(N, device=device).expand(B, N)  # each node's ancestor some steps up; -1 past the root
    # one column more than needed each: the writes of nodes already past the root land there and are dropped
    ancestors = torch.zeros(B, N, N + 1, dtype=torch.bool, device=device)
    at_depth = torch.zeros(B, N, depth + 2, dtype=torch.long, device=device)
    for _ in range(depth + 1):
        live = node >= 0
        up = node.clamp(min=0)
        ancestors.scatter_(2, torch.where(live, node, N)[..., None], True)
        at_depth.scatter_(2, torch.where(live, depths.gather(1, up), depth + 1)[..., None], up[..., None])
        node = torch.where(live, parents.gather(1, up), -1)
    return RowTrees(parents, ancestors[..., :N], depths, at_depth[..., : depth + 1])


def grow_dynamic_tree(root_logits: torch.Tensor, expand, spec: DynamicTree) -> tuple[torch.Tensor, RowTrees]:
    """EAGLE-2's dynamic tree for every row (SGLang: the draft steps' top-k, then `build_tree`). A node's score is
    its path's cumulative draft log-probability (the sum of the log-softmax of the drafter's logits along it).
    Level 1: the root's `topk` best drafts. Level d + 1: the `topk` best drafts after each node of level d's beam,
    its `topk` best-scoring nodes (all of level 1). Of these candidates (topk + (depth - 1) x topk^2) the
    `tokens - 1` best-scoring are kept, numbered after the root in candidate order: by level, then beam rank, then
    draft rank. A child's score is at most its parent's (log-probabilities are <= 0 and rounding is monotone) and a
    stable sort puts the earlier candidate first on ties, so a kept node's parent is always kept.

    `root_logits` [B, V] are the drafter's after the root; `expand(depth, drafts, parent)` runs the drafter on the
    beam of level `depth`: its draft ids [B, topk] and each one's parent as an index into the previous call's nodes
    (the root, 0, at depth 1); it returns the logits after each of them [B, topk, V]. Returns the kept nodes' draft
    ids [B, tokens - 1] and the rows' trees. Tensor ops throughout: no host synchronization."""
    K, D, B = spec.topk, spec.depth, root_logits.shape[0]
    device = root_logits.device
    top = root_logits.float().log_softmax(-1).topk(K, -1)
    beam = torch.arange(K, device=device).expand(B, K)  # the beam's candidate indices
    beam_drafts, beam_scores, beam_parent = top.indices, top.values, torch.zeros_like(beam)
    scores, drafts, parents = [top.values], [top.indices], [torch.full_like(beam, -1)]  # per level
    first = K  # the candidate index of the level's first candidate
    for depth in range(1, D):
        top = expand(depth, beam_drafts, beam_parent).float().log_softmax(-1).topk(K, -1)  # [B, beam, K]
        level_scores = (beam_scores[..., None] + top.values).flatten(1)  # beam node i's drafts at i * K ...
        level_drafts = top.indices.flatten(1)
        scores.append(level_scores)
        drafts.append(level_drafts)
        parents.append(beam[..., None].expand(B, K, K).flatten(1))
        if depth + 1 < D:
            best = level_scores.sort(dim=-1, descending=True, stable=True).indices[:, :K]
            beam, beam_parent = first + best, best // K
            beam_drafts, beam_scores = level_drafts.gather(1, best), level_scores.gather(1, best)
        first += K * K
    scores, drafts, parents = torch.cat(scores, 1), torch.cat(drafts, 1), torch.cat(parents, 1)
    kept = scores.sort(dim=-1, descending=True, stable=True).indices[:, : spec.tokens - 1].sort(-1).values
    node_of = torch.zeros_like(scores, dtype=torch.long)  # each kept candidate's node index
    node_of.scatter_(1, kept, torch.arange(1, spec.tokens, device=device).expand_as(kept))
    parent = parents.gather(1, kept)
    node_parents = torch.where(parent < 0, 0, node_of.gather(1, parent.clamp(min=0)))
    level = torch.where(kept < K, 1, 2 + (kept - K).div(K * K, rounding_mode="floor"))
    root = torch.zeros_like(kept[:, :1])
    trees = row_trees(torch.cat([root - 1, node_parents], 1), torch.cat([root, level], 1), D)
    return drafts.gather(1, kept), trees


def tree_positions(last_positions: torch.Tensor, shape: TreeShape | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, cache slots) [B, N] of a tree step for rows whose last token sits at `last_positions` [B]; `shape`
    a static tree or the nodes' depths, [N] or per row [B, N]."""
    depths = torch.tensor(shape.depths, device=last_positions.device) if isinstance(shape, TreeShape) else shape
    index = torch.arange(depths.shape[-1], device=last_positions.device)
    return last_positions[:, None] + depths, last_positions[:, None] + index[None]


def tree_mask(last_positions: torch.Tensor, ancestors: torch.Tensor, cache_slots: int) -> torch.Tensor:
    """bool [B, N, S]: query node n of row b may attend to cache slot s when s is before the row's last token's slot
    P_b, or s = P_b + m for an ancestor m of n (itself included). `ancestors` [N, N], or per row [B, N, N]."""
    B, N = last_positions.shape[0], ancestors.shape[-1]
    slot = torch.arange(cache_slots, device=last_positions.device)
    rel = slot[None, :] - last_positions[:, None]  # [B, S]: the slot's node, where 0 <= rel < N
    in_tree = (rel >= 0) & (rel < N)
    seen = ancestors.expand(B, N, N).gather(2, rel.clamp(0, N - 1)[:, None, :].expand(B, N, cache_slots))
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & seen)  # seen[b, n, s] = ancestors[b, n, rel[b, s]]


def ancestor_bits(ancestors: torch.Tensor) -> torch.Tensor | None:
    """int64 [..., N]: bit m of node n's entry set when node m is an ancestor of n or n itself, from `ancestors`
    bool [..., N, N]; None past 64 nodes (the fused layer's attention masks a tree by these bits)."""
    N = ancestors.shape[-1]
    if N > 64:
        return None
    bits = torch.ones(N, dtype=torch.long, device=ancestors.device) << torch.arange(N, device=ancestors.device)
    return (ancestors.long() * bits).sum(-1)  # disjoint bits: the sum is their OR (bit 63 wraps to the sign bit)


def _per_row(batch: int, parents, ancestors, depths, at_depth):
    """A tree's tensors per row: a static tree's ([N], [N, N], [N], [N, depth + 1]) expanded to `batch` rows (views,
    no copies), per-row trees' ([B, N], ...) as they are."""
    if parents.dim() == 2:
        return parents, ancestors, depths, at_depth
    return tuple(t.expand(batch, *t.shape) for t in (parents, ancestors, depths, at_depth))


def accept_tree(tokens: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor, parents: torch.Tensor,
                ancestors: torch.Tensor, depths: torch.Tensor, at_depth: torch.Tensor):
    """Greedy acceptance of a tree step. tokens [B, N] (node 0 the root), valid bool [B, N] (a node the drafter
    filled; the root always), logits [B, N, V]; the tree's parents [N], ancestors [N, N], depths [N] and
    at_depth [N, depth + 1] (`TreeShape`), or each row's own ([B, N], ...: `RowTrees`). Returns (n_accepted [B],
    emitted [B, depth + 1], path [B, depth + 1]): the deepest node all of whose non-root ancestors match their
    parent's argmax (ties: the lowest index), its depth, the tokens the row emits (the path's drafts, then the
    target's argmax at the path's end; junk past n_accepted), and the path's nodes by depth (0 past its end)."""
    B, N = tokens.shape
    parents, ancestors, depths, at_depth = _per_row(B, parents, ancestors, depths, at_depth)
    target = logits.argmax(-1)  # [B, N]
    match = valid & (tokens == target.gather(1, parents.clamp(min=0)))
    match[:, 0] = True
    accepted = ~((~match)[:, None, :] & ancestors).any(-1)  # [B, N]: every ancestor (and itself) matched
    score = torch.where(accepted, depths * (N + 1) + (N - torch.arange(N, device=tokens.device))[None], -1)
    best = score.argmax(-1)  # [B]
    return _emit(tokens, best, target.gather(1, best[:, None]), depths, at_depth)


def _emit(tokens, best, bonus, depths, at_depth):
    """(n_accepted, emitted, path) of rows that accepted the path to node `best` [B] and end with `bonus` [B, 1];
    depths [B, N] and at_depth [B, N, depth + 1] per row."""
    n_acc = depths.gather(1, best[:, None]).squeeze(1)
    path = at_depth.gather(1, best[:, None, None].expand(-1, 1, at_depth.shape[2])).squeeze(1)  # [B, depth + 1]
    depth_range = torch.arange(path.shape[1], device=tokens.device)[None]
    drafts = tokens.gather(1, path[:, 1:])  # the path's drafts by depth 1..depth
    emitted = torch.cat([drafts, bonus], 1)  # position n_acc gets the bonus below
    emitted = torch.where(depth_range == n_acc[:, None], bonus, emitted)
    return n_acc, emitted, torch.where(depth_range <= n_acc[:, None], path, 0)


def accept_tree_sampled(tokens: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor, parents: torch.Tensor,
                        ancestors: torch.Tensor, depths: torch.Tensor, at_depth: torch.Tensor,
                        sampling: SamplingParams, generator):
    """Multi-draft speculative sampling over a tree step ("target-only" recursive rejection sampling, each draft a
    point mass as the n-gram drafter's and an EAGLE-3 head's top-k drafts are). Inputs (one tree or a tree per
    row) and outputs as `accept_tree`'s; the target's distribution at node
    n is `probabilities(logits[:, n], sampling)`, as plain sampling's. A greedy `sampling` is `accept_tree`.

    From the root, the current node's valid children are tried in rank (index) order: child token t is accepted with
    probability r(t) / sum(r), r the current residual (at first the node's p); accepted, the walk moves on to the child
    with r = its p; refused, r(t) = 0 (max(p - q, 0) with q one-hot at t), so a sibling repeating a refused token is
    refused too. With no child accepted, the last token is drawn from r. The emitted tokens (the accepted drafts, then
    that token) are distributed exactly as sampling from the target alone.

    Siblings with the same token stand for the same prefix, so once that token is accepted the children of all of
    them are tried (the first's p scoring them): the greedy limit (top_k=1) then keeps `accept_tree`'s path, the
    deepest match, rather than losing a duplicate sibling's subtree. Needs each parent before its children (as
    `tree_from_paths` and `grow_dynamic_tree` number them). Random draws come from `generator` (a CounterRng, a
    torch.Generator or None); no host synchronization."""
    if sampling.greedy:
        return accept_tree(tokens, valid, logits, parents, ancestors, depths, at_depth)
    B, N = tokens.shape
    device = tokens.device
    parents, ancestors, depths, at_depth = _per_row(B, parents, ancestors, depths, at_depth)
    p = probabilities(logits, sampling)  # [B, N, V] fp32
    parent_of = parents.clamp(min=0)
    child = valid & (torch.arange(N, device=device) > 0)[None]  # nodes that may be accepted (never the root)
    node = torch.zeros(B, dtype=torch.long, device=device)  # the deepest node accepted so far
    here = torch.zeros(B, N, dtype=torch.bool, device=device)  # the nodes standing for the accepted prefix
    here[:, 0] = True
    residual = p[:, 0].clone()  # r, unnormalized: zeroing a refused token is its whole update
    u = uniform((B, N), generator, device)
    for n in range(1, N):  # index order: ranks within a parent, every parent before its children
        t = tokens[:, n : n + 1]
        offered = child[:, n] & here.gather(1, parent_of[:, n : n + 1]).squeeze(1)
        r_t = residual.gather(1, t)
        take = offered & (u[:, n] * residual.sum(-1) < r_t.squeeze(1))  # strict: a refused (zeroed) token never is
        residual.scatter_(1, t, torch.where(offered & ~take, 0.0, r_t.squeeze(1))[:, None])
        residual = torch.where(take[:, None], p[:, n], residual)
        same = child & here.gather(1, parent_of) & (tokens == t)  # n and its duplicate siblings
        here = torch.where(take[:, None], same, here)
        node = torch.where(take, n, node)
    rows = torch.arange(B, device=device)
    # An all-zero residual needs every token refused, which a sum of 1 makes impossible but for rounding: fall back
    # to the node's p, as accept_sampled does.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, node])
    bonus = categorical(residual, generator)[:, None]
    return _emit(tokens, node, bonus, depths, at_depth)


def compact_tree_kv(kv: torch.Tensor, last_positions: torch.Tensor, path: torch.Tensor) -> None:
    """Move each row's accepted path into place: the K/V of the path's node at depth d, written at slot P + node,
    copied to slot P + d (d = 1..depth; past the path's end the copies land past the row's new end, where nothing
    reads before the next step overwrites them). kv: [2, layers, B, kv_heads, S, head_dim], in place."""
    B, D = path.shape[0], path.shape[1] - 1
    if D == 0:
        return
    S = kv.shape[4]
    src = (last_positions[:, None] + path[:, 1:]).clamp(max=S - 1)  # [B, D]
    dst = (last_positions[:, None] + torch.arange(1, D + 1, device=path.device)[None]).clamp(max=S - 1)
    rows = torch.arange(B, device=path.device)[:, None].expand(B, D)
    moved = kv[:, :, rows, :, src]  # [B, D, 2, layers, kv_heads, head_dim]: gathered whole before any write
    kv[:, :, rows, :, dst] = moved
