"""Per-row draft trees and EAGLE-2's dynamic tree (engine/tree.py, issue #21): every row of a batch with a tree of
its own shape gets, from the functions that take per-row tensors, the mask, greedy acceptance and KV compaction a
brute force gives for that row's tree alone; sampled acceptance per row is each row's static-tree acceptance; and
`grow_dynamic_tree` keeps the N - 1 candidates of best cumulative draft log-probability that a brute-force
enumeration of EAGLE-2's rule keeps, a kept node's parent always among them, ties included."""
from __future__ import annotations

import random

import pytest
import torch

from specpilot.engine.sampling import SamplingParams
from specpilot.engine.tree import (DynamicTree, TreeShape, accept_tree, accept_tree_sampled, compact_tree_kv,
                                   grow_dynamic_tree, row_trees, tree_mask, tree_positions)
from test_tree import brute_accept, brute_mask


def random_tree(rng: random.Random, nodes: int) -> TreeShape:
    """A tree of `nodes` nodes, each node's parent a random earlier one (paths unused)."""
    parents = [-1] + [rng.randrange(n) for n in range(1, nodes)]
    depths = [0]
    for n in range(1, nodes):
        depths.append(depths[parents[n]] + 1)
    return TreeShape((), tuple(parents), tuple(depths))


def batch_of(shapes: list[TreeShape]):
    """The rows' trees as per-row tensors (row_trees), and the depth they are built for."""
    depth = max(s.depth for s in shapes)
    parents = torch.tensor([s.parents for s in shapes])
    depths = torch.tensor([s.depths for s in shapes])
    return row_trees(parents, depths, depth), depth


@pytest.mark.parametrize("seed", range(10))
def test_row_trees_are_each_rows_tree(seed):
    rng = random.Random(seed)
    shapes = [random_tree(rng, 9) for _ in range(4)]
    trees, depth = batch_of(shapes)
    for b, s in enumerate(shapes):
        assert torch.equal(trees.ancestors[b], s.ancestors())
        want = torch.zeros(s.nodes, depth + 1, dtype=torch.long)
        want[:, : s.depth + 1] = s.ancestor_at_depth()
        assert torch.equal(trees.at_depth[b], want)


@pytest.mark.parametrize("seed", range(10))
def test_per_row_mask_and_positions(seed):
    rng = random.Random(seed)
    shapes = [random_tree(rng, 8) for _ in range(3)]
    trees, _ = batch_of(shapes)
    last = torch.tensor([3, 10, 0])
    mask = tree_mask(last, trees.ancestors, 24)
    positions, slots = tree_positions(last, trees.depths)
    for b, s in enumerate(shapes):
        assert torch.equal(mask[b], brute_mask([int(last[b])], s, 24)[0])
        assert positions[b].tolist() == [int(last[b]) + d for d in s.depths]
        assert slots[b].tolist() == list(range(int(last[b]), int(last[b]) + 8))


def random_step(seed, B, N, V=4):
    """Tokens, valid flags and logits of a tree step: a small vocabulary, so that drafts often match."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, N), generator=g)
    logits = torch.randn(B, N, V, generator=g)
    valid = torch.rand(B, N, generator=g) < 0.9
    valid[:, 0] = True
    return tokens, valid, logits


@pytest.mark.parametrize("seed", range(30))
def test_per_row_acceptance_and_compaction_match_brute_force(seed):
    """Greedy acceptance of a batch whose rows have different trees is each row's brute-force acceptance, and the
    compaction moves each row's own accepted path into place."""
    rng = random.Random(seed)
    shapes = [random_tree(rng, 10) for _ in range(4)]
    trees, _ = batch_of(shapes)
    tokens, valid, logits = random_step(seed, 4, 10)
    n_acc, emitted, path = accept_tree(tokens, valid, logits, trees.parents, trees.ancestors, trees.depths,
                                       trees.at_depth)
    kv = torch.randn(2, 2, 4, 2, 40, 3)
    before = kv.clone()
    last = torch.tensor([4, 20, 0, 11])
    compact_tree_kv(kv, last, path)
    for b, s in enumerate(shapes):
        n, toks, nodes = brute_accept(tokens[b : b + 1], valid[b : b + 1], logits[b : b + 1], s)[0]
        assert int(n_acc[b]) == n and emitted[b, : n + 1].tolist() == toks and path[b, : n + 1].tolist() == nodes
        P = int(last[b])
        for d, m in enumerate(nodes):
            assert torch.equal(kv[:, :, b, :, P + d], before[:, :, b, :, P + m])
        assert torch.equal(kv[:, :, b, :, :P], before[:, :, b, :, :P])


@pytest.mark.parametrize("seed", range(10))
def test_per_row_sampled_acceptance_is_each_rows_static_one(seed):
    """With the same random draws, row b of a sampled per-row step is row b of the same step with row b's tree for
    every row (the per-row trees change whose parents are read, nothing else); top_k = 1 is accept_tree."""
    rng = random.Random(seed)
    shapes = [random_tree(rng, 8) for _ in range(3)]
    trees, depth = batch_of(shapes)
    tokens, valid, logits = random_step(seed, 3, 8)
    sampling = SamplingParams(temperature=0.9)
    per_row = accept_tree_sampled(tokens, valid, logits, trees.parents, trees.ancestors, trees.depths,
                                  trees.at_depth, sampling, torch.Generator().manual_seed(seed))
    for b, s in enumerate(shapes):
        at_depth = torch.zeros(s.nodes, depth + 1, dtype=torch.long)
        at_depth[:, : s.depth + 1] = s.ancestor_at_depth()
        alone = accept_tree_sampled(tokens, valid, logits, torch.tensor(s.parents), s.ancestors(),
                                    torch.tensor(s.depths), at_depth, sampling, torch.Generator().manual_seed(seed))
        n = int(per_row[0][b])
        assert int(alone[0][b]) == n
        assert per_row[1][b, : n + 1].tolist() == alone[1][b, : n + 1].tolist()
        assert per_row[2][b, : n + 1].tolist() == alone[2][b, : n + 1].tolist()
    greedy = accept_tree_sampled(tokens, valid, logits, trees.parents, trees.ancestors, trees.depths,
                                 trees.at_depth, SamplingParams(temperature=1.0, top_k=1), None)
    want = accept_tree(tokens, valid, logits, trees.parents, trees.ancestors, trees.depths, trees.at_depth)
    assert torch.equal(greedy[0], want[0])
    for b, n in enumerate(want[0].tolist()):
        assert greedy[1][b, : n + 1].tolist() == want[1][b, : n + 1].tolist()
        assert greedy[2][b, : n + 1].tolist() == want[2][b, : n + 1].tolist()


# -- EAGLE-2's dynamic tree --------------------------------------------------------------------------------------
def prefix_logits(seed: int, V: int):
    """A drafter as a function from a prefix (a tuple of draft ids after the root) to its next-draft logits: fixed
    random ones per prefix."""
    def logits(prefix) -> torch.Tensor:
        key = seed * 1_000_003 + sum((t + 1) * (V + 1) ** i for i, t in enumerate(prefix))
        return 3.0 * torch.randn(V, generator=torch.Generator().manual_seed(key))
    return logits


def grow(f, rows: int, spec: DynamicTree):
    """grow_dynamic_tree over `rows` rows of drafter `f` (row b's prefixes start with (b,), so rows differ), with
    each row's kept nodes as prefixes in node order (from the returned parents) and the expand calls' depths."""
    prefixes = [[(b,)] for b in range(rows)]  # the previous call's nodes, the root first
    calls = []

    def expand(depth, drafts, parent):
        calls.append(depth)
        for b in range(rows):
            prefixes[b] = [prefixes[b][int(p)] + (int(t),) for t, p in zip(drafts[b], parent[b])]
        return torch.stack([torch.stack([f(p) for p in prefixes[b]]) for b in range(rows)])

    root = torch.stack([f((b,)) for b in range(rows)])
    drafts, trees = grow_dynamic_tree(root, expand, spec)
    kept = []
    for b in range(rows):
        nodes = [(b,)]
        for n in range(1, spec.tokens):
            p = int(trees.parents[b, n])
            assert 0 <= p < n and int(trees.depths[b, n]) == int(trees.depths[b, p]) + 1  # the parent is kept
            nodes.append(nodes[p] + (int(drafts[b, n - 1]),))
            assert int(trees.depths[b, n]) == len(nodes[n]) - 1
        kept.append(nodes[1:])
    return kept, trees, calls


def brute_dynamic(f, root: tuple, spec: DynamicTree) -> list[tuple]:
    """EAGLE-2's rule by enumeration: every candidate with its cumulative log-probability (fp32, summed from the
    root down), level by level; the beam of a level its topk best (earlier first on ties); the tokens - 1 best
    candidates kept (earlier first on ties), in candidate order."""
    def top(prefix, score):
        lp = f(prefix).float().log_softmax(-1)
        order = sorted(range(lp.shape[0]), key=lambda t: -float(lp[t]))[: spec.topk]
        return [(score + lp[t], prefix + (t,)) for t in order]

    level = top(root, torch.tensor(0.0))
    candidates = list(level)
    for _ in range(spec.depth - 1):
        beam = sorted(level, key=lambda c: -float(c[0]))[: spec.topk]
        level = [child for score, prefix in beam for child in top(prefix, score)]
        candidates += level
    best = sorted(range(len(candidates)), key=lambda i: -float(candidates[i][0]))[: spec.tokens - 1]
    return [candidates[i][1] for i in sorted(best)]


@pytest.mark.parametrize("depth,topk,tokens", [(1, 3, 3), (2, 2, 6), (3, 3, 12), (4, 2, 9), (3, 1, 4), (3, 3, 22)])
@pytest.mark.parametrize("seed", range(4))
def test_dynamic_tree_is_eagle2s_rule(depth, topk, tokens, seed):
    """The kept nodes are the brute force's, in its order; the drafter ran depth - 1 times, once a level."""
    spec = DynamicTree(depth, topk, tokens)
    f = prefix_logits(seed, V=6)
    kept, trees, calls = grow(f, 3, spec)
    assert calls == list(range(1, depth))
    for b in range(3):
        assert kept[b] == brute_dynamic(f, (b,), spec), b
    assert trees.at_depth.shape == (3, tokens, depth + 1)


def test_a_kept_nodes_parent_is_kept_on_ties():
    """Log-probabilities of 0 (one finite logit) give a child its parent's score and -inf ones tie everywhere: the
    kept nodes still hang together (grow checks each node's parent), and a chain is kept from the root down."""
    def certain(prefix):
        return torch.tensor([0.0] + [float("-inf")] * 4)

    kept, _, _ = grow(certain, 2, DynamicTree(3, 1, 3))
    assert kept == [[(0, 0), (0, 0, 0)], [(1, 0), (1, 0, 0)]]  # depths 1 and 2, not the equally scored depth 3
    grow(certain, 2, DynamicTree(4, 2, 15))  # every candidate
    coarse = prefix_logits(5, V=4)
    grow(lambda p: coarse(p).sign(), 3, DynamicTree(4, 3, 25))  # logits in {-1, 1}: many equal scores
