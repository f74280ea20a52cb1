"""Multi-draft speculative sampling over a draft tree (engine/tree.py `accept_tree_sampled`, issue #21): the emitted
tokens are distributed as sampling from the target alone (first token, and the first two jointly), with duplicate
siblings, invalid nodes and top-k/top-p; its greedy limit is `accept_tree`; its outputs are shaped as `accept_tree`'s.

The target here is a function from prefix to logits, as a model's is: every node's logits are the target's at the
node's prefix, so duplicate nodes carry the same logits and a continuation's exact probability is known everywhere.
"""
from __future__ import annotations

import math

import pytest
import torch

from specpilot.engine.sampling import SamplingParams, probabilities
from specpilot.engine.tree import accept_tree, accept_tree_sampled, chains, tree_from_paths

V = 6
SHAPE = tree_from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0]])  # 8 nodes: root, 3 children, 4 grandchildren
ROWS = 100_000  # samples per scenario
DELTA = 1e-6  # the chance that a correct implementation fails a TV check, at most (over seeds)


def target_logits(prefix) -> torch.Tensor:
    """The target's next-token logits after `prefix` (a tuple of tokens after the root): fixed random ones per
    prefix, scaled so that the most likely token often has most of the mass (the residual then matters)."""
    seed = 1 + sum((x + 1) * (V + 1) ** i for i, x in enumerate(prefix))
    return 2.0 * torch.randn(V, generator=torch.Generator().manual_seed(1000 + seed))


def target(prefix, sampling) -> torch.Tensor:
    return probabilities(target_logits(prefix)[None], sampling)[0].double()


def prefix_of(tokens, shape, n):
    out = []
    while n > 0:
        out.append(int(tokens[n]))
        n = shape.parents[n]
    return tuple(out[::-1])


def tree_tensors(shape):
    return (torch.tensor(shape.parents), shape.ancestors(), torch.tensor(shape.depths), shape.ancestor_at_depth())


def build(ranks, sampling):
    """One row of SHAPE: node n's token is the ranks[n - 1]-th most likely token of the target at its parent's
    prefix (a repeated rank below one parent makes duplicate siblings); logits [N, V] the target's at each node."""
    tokens = [0]  # the root's own token: the target's distribution at the root is target_logits(())
    for n in range(1, SHAPE.nodes):
        order = target(prefix_of(tokens, SHAPE, SHAPE.parents[n]), sampling).argsort(descending=True, stable=True)
        tokens.append(int(order[ranks[n - 1]]))
    logits = torch.stack([target_logits(prefix_of(tokens, SHAPE, n)) for n in range(SHAPE.nodes)])
    return torch.tensor(tokens), logits


# name: (ranks of nodes 1..7 as paths (0) (1) (2) (0,0) (0,1) (1,0) (2,0), valid of nodes 1..7)
SCENARIOS = {
    "distinct": ([0, 1, 2, 0, 1, 0, 0], [1] * 7),
    # (1) repeats (0)'s token: once it is refused, (1) must be too; once it is accepted, the children of both are
    # tried, (0,1) repeating (0,0) and (1,0) a token of its own
    "duplicates": ([0, 0, 1, 0, 0, 1, 0], [1] * 7),
    # (1) and (0,1) not drafted; (1,0) is, below an invalid node, so it can never be reached
    "invalid": ([0, 1, 2, 0, 1, 0, 0], [1, 0, 1, 1, 0, 1, 1]),
    "root only": ([0, 1, 2, 0, 1, 0, 0], [0] * 7),
    # the first child the least likely token (outside top-k: probability 0, never to be accepted)
    "unlikely first": ([V - 1, 0, 1, 0, 1, 0, 0], [1] * 7),
}
SAMPLINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4, top_p=0.9)]


def tv_bound(cells: int, n: int) -> float:
    """A bound on the total-variation distance between n samples' histogram and their true distribution over `cells`
    outcomes that holds with probability >= 1 - DELTA: E[TV] <= 1/2 sum_i sqrt(2 p_i (1 - p_i) / (pi n)) <=
    1/2 sqrt(2 / pi) sqrt(cells / n) (Cauchy-Schwarz), and one sample moves TV by at most 1/n, so by McDiarmid's
    inequality TV exceeds its mean by more than sqrt(ln(1/DELTA) / (2n)) with probability <= DELTA."""
    return 0.5 * math.sqrt(2 / math.pi) * math.sqrt(cells / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.8-topk4-topp0.9"])
def test_distribution_matches_target(sampling):
    """Every scenario's rows in one batch (rows independent, each its own tree): the first emitted token against the
    target at the root, and the first two jointly against p_root(x1) * p_(x1)(x2). Where the row emitted only x1, x2
    is drawn from the target at (x1), as the decoder's next step would (the first token's law being what is checked
    at the root): so the joint is the 2-token continuation decoding produces."""
    names = list(SCENARIOS)
    rows = [build(SCENARIOS[k][0], sampling) for k in names]
    tokens = torch.stack([r[0] for r in rows]).repeat_interleave(ROWS, 0)
    logits = torch.stack([r[1] for r in rows]).repeat_interleave(ROWS, 0)
    valid = torch.tensor([[1] + SCENARIOS[k][1] for k in names], dtype=torch.bool).repeat_interleave(ROWS, 0)
    gen = torch.Generator().manual_seed(7)
    n_acc, emitted, path = accept_tree_sampled(tokens, valid, logits, *tree_tensors(SHAPE), sampling, gen)

    p1 = target((), sampling)
    p2 = torch.stack([target((x,), sampling) for x in range(V)])  # [x1, x2]
    x1 = emitted[:, 0]
    x2 = torch.where(n_acc >= 1, emitted[:, 1], torch.multinomial(p2[x1].float(), 1, generator=gen).squeeze(1))
    bound1, bound2 = tv_bound(V, ROWS), tv_bound(V * V, ROWS)  # about 0.011 and 0.016
    for i, name in enumerate(names):
        sl = slice(i * ROWS, (i + 1) * ROWS)
        first = torch.bincount(x1[sl], minlength=V).double() / ROWS
        joint = torch.bincount(x1[sl] * V + x2[sl], minlength=V * V).double().view(V, V) / ROWS
        tv1, tv2 = tv(first, p1), tv(joint, p1[:, None] * p2)
        print(f"{name}: TV first {tv1:.4f} (bound {bound1:.4f}), joint {tv2:.4f} (bound {bound2:.4f}), "
              f"mean accepted {n_acc[sl].double().mean():.3f}")
        assert tv1 < bound1 and tv2 < bound2, name
        # what each scenario must do besides: never emit a token of probability 0, reach no node below an invalid one
        assert bool((p1[x1[sl]] > 0).all())
        if name == "root only":
            assert bool((n_acc[sl] == 0).all())
        if name == "invalid":
            assert not bool((path[sl] == 2).any() | (path[sl] == 5).any() | (path[sl] == 6).any())
        if name == "duplicates":  # a duplicate's child reached through the merged siblings
            assert bool((path[sl, 2] == 6).any())
        if name == "unlikely first" and sampling.top_k:
            assert not bool((path[sl, 1] == 1).any())


def sequential_root(p, drafts, renormalize=True, zero_refused=True):
    """The law of the first emitted token (exactly, not sampled) when the root's children carry `drafts`: the
    correct rule, or one that skips the residual's renormalization (accepting t with probability r(t), not
    r(t) / sum(r)) or its update altogether (each sibling tried against p, the last token drawn from p)."""
    out, reach, r = torch.zeros_like(p), 1.0, p.clone()
    for t in drafts:
        a = float(r[t] / r.sum()) if renormalize else float(r[t])
        out[t] += reach * a
        reach *= 1 - a
        if zero_refused:
            r[t] = 0
    return out + reach * r / r.sum()


def test_distribution_test_would_catch_a_missing_residual():
    """The distribution test has power where it matters: its scenarios' first sibling takes most of the root's mass
    (> 0.5), so a walk that skips renormalizing the residual, or keeps trying siblings against p itself, would emit a
    first token law far (> 10 bounds) from the target's; the correct rule is exact."""
    sampling = SAMPLINGS[0]
    p1 = target((), sampling)
    bound1 = tv_bound(V, ROWS)
    for name in ("distinct", "duplicates"):
        tokens, _ = build(SCENARIOS[name][0], sampling)
        drafts = [int(t) for t in tokens[1:4]]  # the root's children, in rank order
        assert float(p1[drafts[0]]) > 0.5
        assert tv(sequential_root(p1, drafts), p1) < 1e-6  # p1 is fp32's: its sum is 1 to rounding
        for wrong in (dict(renormalize=False), dict(zero_refused=False)):
            assert tv(sequential_root(p1, drafts, **wrong), p1) > 10 * bound1, (name, wrong)  # 0.15 to 0.27


MEDUSA_LIKE = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2]]


def random_step(shape, seed, B=64, vocab=3):
    """Random drafts over a small vocabulary (duplicate siblings and matches are frequent), the target's logits at
    each node's prefix (a row's context a seed of its own), random invalid nodes."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, shape.nodes), generator=g)
    valid = torch.rand(B, shape.nodes, generator=g) < 0.8
    valid[:, 0] = True
    logits = torch.stack([torch.stack([target_logits((seed, b) + prefix_of(tokens[b], shape, n))[:vocab]
                                       for n in range(shape.nodes)]) for b in range(B)])
    return tokens, valid, logits


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("sampling", [SamplingParams(1.0, top_k=1), SamplingParams(1e-4), SamplingParams(0.0)],
                         ids=["topk1", "t1e-4", "greedy"])
def test_greedy_limit_is_accept_tree(seed, sampling):
    """With a one-hot target (top_k=1, or a tiny temperature) every draft matching the argmax is accepted and every
    other refused, so the walk keeps accept_tree's path (the deepest match, duplicate siblings' subtrees included;
    ties the lowest index) and emits its tokens; a greedy `sampling` is accept_tree itself."""
    shape = tree_from_paths(MEDUSA_LIKE) if seed % 2 else chains(3, 3)
    tokens, valid, logits = random_step(shape, seed)
    t = tree_tensors(shape)
    want = accept_tree(tokens, valid, logits, *t)
    got = accept_tree_sampled(tokens, valid, logits, *t, sampling, torch.Generator().manual_seed(seed))
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert int(want[0].max()) >= 2  # the case is not trivial: some row accepts at least two drafts


@pytest.mark.parametrize("shape", [tree_from_paths(MEDUSA_LIKE), chains(2, 3), chains(4, 1)],
                         ids=["medusa-like", "chains2x3", "chains4x1"])
def test_shapes_and_dtypes_match_accept_tree(shape):
    tokens, valid, logits = random_step(shape, 0, B=5, vocab=V)
    t = tree_tensors(shape)
    want = accept_tree(tokens, valid, logits, *t)
    sampling = SamplingParams(1.0)
    got = accept_tree_sampled(tokens, valid, logits, *t, sampling, torch.Generator().manual_seed(0))
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device
    n_acc, emitted, path = got
    for b in range(tokens.shape[0]):  # the path a chain from the root, its drafts the emitted tokens, zeros after
        n = int(n_acc[b])
        nodes = path[b, : n + 1].tolist()
        assert nodes[0] == 0 and all(shape.parents[nodes[d]] == nodes[d - 1] for d in range(1, n + 1))
        assert all(bool(valid[b, m]) for m in nodes)
        assert emitted[b, :n].tolist() == [int(tokens[b, m]) for m in nodes[1:]]
        assert not path[b, n + 1:].any()
    again = accept_tree_sampled(tokens, valid, logits, *t, sampling, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, g) for a, g in zip(again, got))  # the generator's draws decide everything
    accept_tree_sampled(tokens, valid, logits, *t, sampling, None)  # the default generator works too
