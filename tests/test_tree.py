"""Draft trees (engine/tree.py) against brute force: the shape from paths, the attention mask of a tree step,
greedy acceptance (the deepest path every node of which is its parent's argmax) and the KV compaction after it."""
from __future__ import annotations

import random

import pytest
import torch

from specpilot.engine.tree import accept_tree, chains, compact_tree_kv, tree_from_paths, tree_mask, tree_positions

MEDUSA_LIKE = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2]]


def test_tree_from_paths():
    t = tree_from_paths(MEDUSA_LIKE)
    assert t.paths == ((), (0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0))
    assert t.parents == (-1, 0, 0, 0, 1, 1, 1, 2, 4) and t.depths == (0, 1, 1, 1, 2, 2, 2, 2, 3)
    assert tree_from_paths([[0, 0, 1]]).paths == ((), (0,), (0, 0), (0, 0, 1))  # prefixes added
    c = chains(2, 3)
    assert c.paths == ((), (0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)) and c.depth == 3
    for bad in ([[]], [[0, -1]], [[0.5]]):
        with pytest.raises(ValueError, match="tree path"):
            tree_from_paths(bad)


def brute_mask(last, shape, S):
    B, N = len(last), shape.nodes
    m = torch.zeros(B, N, S, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            for s in range(S):
                if s < last[b]:
                    m[b, n, s] = True
                elif s - last[b] < N:
                    a = n
                    while a >= 0:
                        m[b, n, s] |= a == s - last[b]
                        a = shape.parents[a]
    return m


def test_tree_mask_and_positions():
    shape = tree_from_paths(MEDUSA_LIKE)
    last = torch.tensor([3, 10, 0])
    got = tree_mask(last, shape.ancestors(), 24)
    assert torch.equal(got, brute_mask(last.tolist(), shape, 24))
    pos, slots = tree_positions(last, shape)
    assert pos[1].tolist() == [10 + d for d in shape.depths] and slots[1].tolist() == list(range(10, 10 + 9))


def brute_accept(tokens, valid, logits, shape):
    target = logits.argmax(-1)
    out = []
    for b in range(tokens.shape[0]):
        best = 0
        for n in range(1, shape.nodes):
            ok, m = True, n
            while m > 0:
                ok &= bool(valid[b, m]) and int(tokens[b, m]) == int(target[b, shape.parents[m]])
                m = shape.parents[m]
            if ok and shape.depths[n] > shape.depths[best]:
                best = n
        path, m = [], best
        while m >= 0:
            path.append(m)
            m = shape.parents[m]
        path = path[::-1]
        out.append((shape.depths[best], [int(tokens[b, m]) for m in path[1:]] + [int(target[b, best])], path))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_accept_tree_matches_brute_force(seed):
    rng = random.Random(seed)
    shape = chains(rng.randint(1, 3), rng.randint(1, 4)) if seed % 2 else tree_from_paths(MEDUSA_LIKE)
    B, N, V = 4, shape.nodes, 5  # a small vocabulary: drafts often match
    tokens = torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(seed))
    logits = torch.randn(B, N, V, generator=torch.Generator().manual_seed(seed + 100))
    valid = torch.rand(B, N, generator=torch.Generator().manual_seed(seed + 200)) < 0.8
    valid[:, 0] = True
    n_acc, emitted, path = accept_tree(tokens, valid, logits, torch.tensor(shape.parents), shape.ancestors(),
                                       torch.tensor(shape.depths), shape.ancestor_at_depth())
    for b, (n, toks, nodes) in enumerate(brute_accept(tokens, valid, logits, shape)):
        assert int(n_acc[b]) == n and emitted[b, : n + 1].tolist() == toks and path[b, : n + 1].tolist() == nodes


def test_compact_tree_kv():
    shape = tree_from_paths(MEDUSA_LIKE)
    kv = torch.randn(2, 3, 2, 2, 32, 4)
    before = kv.clone()
    last = torch.tensor([5, 12])
    path = torch.tensor([[0, 1, 4, 8], [0, 2, 7, 0]])  # row 0 accepted depth 3, row 1 depth 2 (then filler)
    compact_tree_kv(kv, last, path)
    for b, nodes in enumerate(([0, 1, 4, 8], [0, 2, 7])):
        P = int(last[b])
        for d, n in enumerate(nodes):
            assert torch.equal(kv[:, :, b, :, P + d], before[:, :, b, :, P + n])
        assert torch.equal(kv[:, :, b, :, :P], before[:, :, b, :, :P])  # the prefix untouched
