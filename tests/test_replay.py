"""The replay drafter (engine/replay.py, issue #24): it drafts the target's own AR continuation, corrupted so that a
step accepts at least i drafts with the profile's probability a_i; decoding stays AR's, greedy, whatever the profile,
and recipes with a bad profile are refused."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import RecipeError, parse
from specpilot.engine.replay import kept_probabilities, replay_drafts
from specpilot.engine.replay import rank_edges as replay_rank_edges


def prompts(n: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, TINY_VOCAB, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def replay(loaded, acceptance, rows: int = 8, **drafter) -> Engine:
    return Engine(loaded, parse({"drafter": {"kind": "replay", "acceptance": list(acceptance), **drafter},
                                 "k": len(acceptance), "cuda_graphs": False, "batch": {"max_batch_size": rows}}))


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from specpilot.engine.loader import load

    return load(str(tiny_model_dir("llama")), "fp32", "cpu")


@pytest.fixture(scope="module")
def ar_tokens(loaded):
    ar = Engine(loaded, parse({"cuda_graphs": False}))
    return [r.tokens for r in ar.generate(prompts(), 20, ignore_eos=True)]


def test_a_sure_profile_drafts_exactly_what_ar_emits(loaded, ar_tokens):
    """a = 1 everywhere: every step accepts all k drafts (but where the request ends first), and the tokens are
    AR's."""
    eng = replay(loaded, [1.0, 1.0, 1.0])
    out = eng.generate(prompts(), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens
    for r in out:  # 20 tokens: the first from the prefill, then 3 + 1 a step; the last step's drafts run past 20
        assert r.accepted[:-1] == [3] * (len(r.accepted) - 1)


@pytest.mark.parametrize("rows", (1, 2))
def test_a_middle_profile_keeps_ar_tokens_and_accepts_between(loaded, ar_tokens, rows):
    """a = (0.7, 0.4): tokens are still AR's (rows switch requests when rows < prompts: each finds its own
    reference), and steps accept 0, 1 and 2 drafts."""
    out = replay(loaded, [0.7, 0.4], rows=rows).generate(prompts(), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens
    seen = {n for r in out for n in r.accepted}
    assert seen == {0, 1, 2}


def test_a_zero_profile_never_drafts_a_right_token(loaded, ar_tokens):
    out = replay(loaded, [0.0, 0.0]).generate(prompts(), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens
    assert all(n == 0 for r in out for n in r.accepted)


def test_acceptance_follows_the_profile():
    """Rows at many lengths of their references (the table's rows), drafts checked against the truth as greedy
    verification does (the longest kept prefix): the share of steps accepting at least i drafts is a_i within 0.04
    (4,000 steps: the binomial's standard deviation is below 0.008)."""
    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, 50, (40, 130), generator=g)
    table_lengths = torch.full((40,), 130)
    acceptance = [0.8, 0.5, 0.45, 0.1]
    kept = torch.tensor(kept_probabilities(acceptance))
    lengths = torch.arange(100).repeat(40) + 10  # 4,000 rows: each reference at 100 lengths
    history = table.repeat_interleave(100, 0)
    drafts, valid, _ = replay_drafts(history, lengths, 4, table, table_lengths, kept, torch.tensor([7]), 50)
    assert bool((valid == 4).all())
    truth = history.gather(1, lengths[:, None] + torch.arange(4))
    accepted = (drafts == truth).long().cumprod(1).sum(1)
    for i, a in enumerate(acceptance, start=1):
        assert float((accepted >= i).float().mean()) == pytest.approx(a, abs=0.04), i
    wrong = drafts != truth
    assert bool(((drafts >= 0) & (drafts < 50)).all()) and bool(wrong.any())


def test_rows_find_their_own_reference_or_none():
    """A row whose history is a prefix of a reference drafts its continuation (a shorter reference that the row
    has outgrown is not it); a row off every reference, or at a reference's end, drafts nothing."""
    table = torch.tensor([[1, 2, 3, 4, 5, 0, 0], [1, 2, 9, 9, 9, 9, 9]])
    table_lengths = torch.tensor([5, 7])
    history = torch.tensor([[1, 2, 3, 0, 0, 0, 0], [1, 2, 9, 9, 0, 0, 0], [1, 2, 7, 0, 0, 0, 0],
                            [1, 2, 3, 4, 5, 0, 0]])
    lengths = torch.tensor([3, 4, 3, 5])
    sure = torch.ones(2)
    drafts, valid, _ = replay_drafts(history, lengths, 2, table, table_lengths, sure, torch.tensor([0]), 10)
    assert valid.tolist() == [2, 2, 0, 0]
    assert drafts[0].tolist() == [4, 5] and drafts[1].tolist() == [9, 9]


def test_the_replays_own_work_traces_as_one_graph(loaded, monkeypatch):
    """With the decoder compiling (CUDA), the replay's search and draws run compiled (`prepare`): some 110 small
    kernels eagerly, a few fused. Here the function traces whole (fullgraph; the CPU runs no Inductor, so a tracing
    backend stands in) and draws exactly what it draws eagerly."""
    from specpilot.engine import replay

    g = torch.Generator().manual_seed(4)
    table = torch.randint(0, 50, (6, 90), generator=g)
    history, lengths = table.repeat_interleave(3, 0), torch.arange(18) + 20
    args = (history, lengths, 4, table, torch.full((6,), 90), torch.tensor(kept_probabilities([0.8, 0.5, 0.45, 0.1])),
            torch.tensor([7]), 50)
    traced = torch.compile(replay.replay_drafts, fullgraph=True, backend="aot_eager")
    for a, b in zip(replay.replay_drafts(*args), traced(*args)):
        assert torch.equal(a, b)
    edges = torch.tensor(replay.rank_edges([0.8, 0.5], [[0.1, 0.05], [0.2]]))
    child = torch.tensor([[0, -1], [0, 0], [1, -1], [1, 0], [0, 1]])
    tree_args = (history, lengths, table, torch.full((6,), 90), edges, child, torch.tensor([7]), 50)
    traced = torch.compile(replay.replay_tree, fullgraph=True, backend="aot_eager")
    for a, b in zip(replay.replay_tree(*tree_args), traced(*tree_args)):
        assert torch.equal(a, b)
    used = []
    monkeypatch.setattr(replay, "compiled", lambda fn: used.append(fn) or fn)
    drafter = Engine(loaded, parse({"drafter": {"kind": "replay", "acceptance": [0.5]}, "k": 1})).decoder.drafter
    drafter.prepare(None, None, compile=True)
    assert used == [replay.replay_drafts, replay.replay_tree] and drafter._drafts is replay.replay_drafts


def test_kept_probabilities_are_the_profiles_ratios():
    assert kept_probabilities([0.8, 0.4, 0.0, 0.0]) == pytest.approx([0.8, 0.5, 0.0, 0.0])


def test_the_cost_of_a_random_head_of_the_targets_shape(loaded, ar_tokens):
    """drafter.model 'random-eagle3': a head of the target's shape with random weights runs its forwards each step
    (static batches: its cache is per row), and the replayed drafts, not its own, are verified."""
    eng = replay(loaded, [1.0, 1.0], rows=2, model="random-eagle3")
    assert eng.decoder.drafter.cost.head.cfg.hidden_size == loaded.model.cfg.hidden_size
    assert not eng.decoder.continuous
    out = eng.generate(prompts(), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens
    assert all(n == 2 for r in out for n in r.accepted[:-1])


def test_prepare_computes_the_references_once(loaded, monkeypatch):
    """Engine.prepare (the bench calls it before timing) decodes the references; generate then decodes no AR of its
    own for the same prompts, and new prompts are added (the table grows, the captured steps are dropped)."""
    from specpilot.engine import decode

    eng = replay(loaded, [0.9, 0.6])
    calls = []
    real = decode.Decoder.generate
    monkeypatch.setattr(decode.Decoder, "generate", lambda self, p, *a, **kw: (calls.append(self.drafter),
                                                                                 real(self, p, *a, **kw))[1])
    eng.prepare(prompts(3), 12)
    assert calls == [None]  # one AR decode
    eng.generate(prompts(3), 12, ignore_eos=True)
    assert calls == [None, eng.decoder.drafter]
    eng.generate(prompts(4), 12, ignore_eos=True)  # one new prompt: its reference first
    assert calls[2:] == [None, eng.decoder.drafter] and len(eng.decoder.drafter.references) == 4


@pytest.mark.parametrize("drafter, k, why", [
    ({"kind": "replay", "acceptance": [0.9]}, 2, "needs k = 2 values"),
    ({"kind": "replay", "acceptance": [0.5, 0.7]}, 2, "above value 1"),
    ({"kind": "replay", "acceptance": [1.2, 0.5]}, 2, "in [0, 1]"),
    ({"kind": "ngram", "acceptance": [0.5]}, 1, "a replay drafter's profile"),
])
def test_bad_profiles_are_refused(drafter, k, why):
    with pytest.raises(RecipeError, match="drafter.acceptance") as e:
        parse({"drafter": drafter, "k": k})
    assert why in str(e.value)


def test_the_bench_names_replay_and_prepares_its_references(loaded, tmp_path):
    """A replay recipe's system says `replay` in its name, and the bench's warm-up (EngineSystem.prepare) computes
    its references before anything is timed."""
    import json

    from specpilot.tools.bench.run import recipes_to_measure
    from specpilot.tools.bench.systems import EngineSystem

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"name": "eagle-profile", "drafter": {"kind": "replay", "acceptance": [0.9, 0.5]},
                                "k": 2, "cuda_graphs": False}))
    (name, recipe), = recipes_to_measure([str(path)], None)[2:]
    assert name == "eagle-profile-replay"
    system = EngineSystem(name, loaded, recipe)
    system.prepare([prompts(2), prompts(3)[2:]], 8)
    assert sorted(map(len, system.engine.decoder.drafter.references)) == [3, 5, 7]


@pytest.mark.parametrize("model", ["", "random-eagle3"])
def test_the_profiler_prices_a_replay_recipe_by_what_it_runs(loaded, model):
    """The profiler prepares the references (its decoder's calls bypass Engine.generate) and prices the drafter as
    what it runs: the head's drafting with one, a search over the history without."""
    from specpilot.tools.profile.profiler import profile

    recipe = parse({"drafter": {"kind": "replay", "acceptance": [0.9, 0.6], "model": model}, "k": 2,
                    "cuda_graphs": False})
    p = profile(loaded, recipe, prompts=prompts(2), max_new_tokens=12, repeats=1)
    assert p.prediction["deployment"]["drafter_kind"] == ("eagle3" if model else "ngram")
    assert p.acceptance["tau"] > 1.0  # the references were there: drafts were accepted


@pytest.mark.parametrize("acceptance, accepted", [([1.0, 1.0], 2), ([0.0, 0.0], 0), ([0.7, 0.4], None)])
def test_a_replayed_tree_accepts_along_its_first_chain(loaded, ar_tokens, acceptance, accepted):
    """A static tree of two branches: the first-child chain holds the replayed drafts, every other node a wrong id
    (verified, never accepted): the accepted depth follows the profile, and the tokens are AR's."""
    eng = Engine(loaded, parse({"drafter": {"kind": "replay", "acceptance": acceptance}, "k": 2,
                                "verification": "tree", "cuda_graphs": False,
                                "tree": {"kind": "static", "paths": [[0], [0, 0], [1], [1, 0], [0, 1]]}}))
    out = eng.generate(prompts(), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens
    steps = [n for r in out for n in r.accepted[:-1]]
    assert set(steps) == ({accepted} if accepted is not None else {0, 1, 2})


def test_rank_edges_are_cumulative_per_depth():
    edges = replay_rank_edges([0.8, 0.4], [[0.1, 0.05]])  # depth 2: 0.4 / 0.8 = 0.5, no 2nd candidate
    assert torch.allclose(torch.tensor(edges), torch.tensor([[0.8, 0.9, 0.95], [0.5, 0.5, 0.5]]))
    assert replay_rank_edges([0.6], []) == [[0.6]]


@pytest.mark.parametrize("ranks, accepted", [([[1.0], [1.0]], {2}), ([[0.0], [1.0]], {0})])
def test_a_replayed_tree_accepts_where_its_branches_hold_the_candidates(loaded, ar_tokens, ranks, accepted):
    """`drafter.ranks`: where the target's token is never the drafter's 1st candidate (a = 0) but always its 2nd,
    the branch of second children accepts the whole depth, and the first-child chain nothing; with no 2nd candidate
    at the first depth the tree accepts nothing. Tokens stay AR's."""
    paths = [[0], [0, 0], [1], [1, 0], [1, 1]]
    eng = Engine(loaded, parse({"drafter": {"kind": "replay", "acceptance": [0.0, 0.0], "ranks": ranks}, "k": 2,
                                "verification": "tree", "cuda_graphs": False,
                                "tree": {"kind": "static", "paths": paths}}))
    out = eng.generate(prompts(), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens
    assert {n for r in out for n in r.accepted[:-1]} == accepted


def test_replayed_ranks_follow_their_chances():
    """Over many rows, the depth a tree accepts follows the per-depth chances of each candidate: a 2-wide tree of
    depth 2 accepts depth 1 with a_1's chance plus the 2nd candidate's, and depth 2 with that times the next."""
    from specpilot.engine.replay import replay_tree

    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, 1000, (4000, 40), generator=g)
    lengths = torch.full((4000,), 20)
    edges = torch.tensor(replay_rank_edges([0.5, 0.3], [[0.3], [0.2]]))  # depth 1: 0.5 + 0.3; depth 2: 0.6 + 0.2
    child = torch.tensor([[0, -1], [0, 0], [0, 1], [1, -1], [1, 0], [1, 1]])
    tokens, valid = replay_tree(table, lengths, table, torch.full((4000,), 40), edges, child, torch.tensor([1]), 1000)
    truth = table[:, 20:22]
    right = tokens == truth[:, (child >= 0).sum(-1) - 1]
    depth1 = right[:, [0, 3]].any(-1).float().mean().item()
    depth2 = (right[:, [1, 2]] & right[:, [0]] | right[:, [4, 5]] & right[:, [3]]).any(-1).float().mean().item()
    assert depth1 == pytest.approx(0.8, abs=0.03) and depth2 == pytest.approx(0.8 * 0.8, abs=0.03)
    assert (right[:, [0, 3]].sum(-1) <= 1).all() and (valid == 2).all()  # one right sibling at most


def test_ranks_from_fishbone_trees_invert_what_the_replay_accepts():
    """The replay of a known rank profile on fishbone trees (the first-child chain with 2 and 3 candidates a depth)
    accepts, per depth, what `ranks_from_trees` turns back into that profile (within sampling noise)."""
    from specpilot.engine.replay import ranks_from_trees, replay_tree

    acceptance, ranks = [0.6, 0.3], [[0.2, 0.1], [0.25, 0.05]]
    g = torch.Generator().manual_seed(8)
    table = torch.randint(0, 1000, (60, 130), generator=g)  # rows: each reference at 100 lengths (draws differ)
    history, lengths = table.repeat_interleave(100, 0), torch.arange(10, 110).repeat(60)
    edges = torch.tensor(replay_rank_edges(acceptance, ranks))
    truth = history.gather(1, lengths[:, None] + torch.arange(2)[None])
    measured = {}
    for width in (1, 2, 3):
        paths = [[0] * d + [r] for d in range(2) for r in range(width)]
        child = torch.tensor([p + [-1] * (2 - len(p)) for p in paths])
        tokens, _ = replay_tree(history, lengths, table, torch.full((60,), 130), edges, child, torch.tensor([2]),
                                1000)
        right = tokens == truth[:, (child >= 0).sum(-1) - 1]
        chain_ok = right[:, 0]  # depth 2's nodes hang below the chain's first node
        depth1 = right[:, :width].any(-1)
        depth2 = chain_ok & right[:, width:].any(-1)
        measured[width] = [depth1.float().mean().item(), depth2.float().mean().item()]
    got = ranks_from_trees(measured[1], {2: measured[2], 3: measured[3]})
    want = [[0.2, 0.1], [0.25, 0.05]]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=0.04), got
    assert ranks_from_trees([0.0, 0.0], {2: [0.4, 0.1]}) == [[0.4], [0.0]]  # past where the chain reaches: 0
    with pytest.raises(ValueError):
        ranks_from_trees([0.5], {3: [0.7]})


def test_ranks_need_a_replayed_static_tree_and_room():
    tree = {"verification": "tree", "tree": {"kind": "static", "paths": [[0], [1]]}}
    for data, why in (({"drafter": {"kind": "replay", "acceptance": [0.5], "ranks": [[0.2]]}, "k": 1}, "static"),
                      ({"drafter": {"kind": "replay", "acceptance": [0.5], "ranks": [[0.6]]}, "k": 1, **tree},
                       "more than 1"),
                      ({"drafter": {"kind": "ngram", "ranks": [[0.2]]}, "k": 1, **tree}, "replay drafter")):
        with pytest.raises(RecipeError, match="drafter.ranks") as e:
            parse(data)
        assert why in str(e.value)
    parse({"drafter": {"kind": "replay", "acceptance": [0.5], "ranks": [[0.5]]}, "k": 1, **tree})


def test_a_replayed_tree_at_a_heads_cost(loaded, ar_tokens):
    """With drafter.model the head drafts the same tree shape each step (its cost), the replay fills it."""
    eng = Engine(loaded, parse({"drafter": {"kind": "replay", "acceptance": [1.0, 1.0], "model": "random-eagle3"},
                                "k": 2, "verification": "tree", "cuda_graphs": False,
                                "tree": {"kind": "static", "paths": [[0], [0, 0], [1], [1, 0]]}}))
    calls = []
    real = eng.decoder.drafter.cost.propose_tree
    eng.decoder.drafter.cost.propose_tree = lambda *a: calls.append(1) or real(*a)
    out = eng.generate(prompts(2), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens[:2] and calls
    assert all(n == 2 for r in out for n in r.accepted[:-1])


def test_the_best_static_tree_for_a_rank_profile():
    """`best_static_tree`: of every prefix-closed tree of N drafts (depth 2, 3 candidates a node), none accepts more
    on average under the profile than the one it builds (`expected_accepted` says how much); it holds every prefix,
    and without 2nd candidates it is the chain."""
    import itertools

    from specpilot.engine.replay import best_static_tree, expected_accepted

    acceptance, ranks = [0.6, 0.3], [[0.2, 0.1], [0.25, 0.05]]
    chance = [[0.6, 0.2, 0.1], [0.5, 0.25, 0.05]]  # per depth: candidate 1 (a_i / a_{i-1}), 2, 3

    def expected(paths):
        total = 0.0
        for path in paths:
            p = 1.0
            for depth, c in enumerate(path):
                p *= chance[depth][c]
            total += p
        return total

    every = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    for n in (1, 3, 5, 8):
        best = best_static_tree(acceptance, ranks, n)
        assert len(best) == n and all(tuple(p[:-1]) in {tuple(q) for q in best} | {()} for p in best)
        trees = [t for t in itertools.combinations(every, n) if all(p[:-1] in set(t) | {()} for p in t)]
        assert expected(best) == pytest.approx(max(expected(t) for t in trees))
        assert expected_accepted(acceptance, ranks, best) == pytest.approx(expected(best))
    assert best_static_tree([0.8, 0.4], [[0.0], [0.0]], 5) == [[0], [0, 0]]  # no 2nd candidate: the chain, whole


def test_the_best_static_tree_replayed_decodes_ar_tokens(loaded, ar_tokens):
    """The best tree of 6 drafts for a profile, replayed: AR's tokens, accepted as deep as the tree goes."""
    from specpilot.engine.replay import best_static_tree

    paths = best_static_tree([0.6, 0.3], [[0.2, 0.1], [0.25, 0.05]], 6)
    eng = Engine(loaded, parse({"drafter": {"kind": "replay", "acceptance": [0.6, 0.3],
                                            "ranks": [[0.2, 0.1], [0.25, 0.05]]}, "k": 2, "verification": "tree",
                                "cuda_graphs": False, "tree": {"kind": "static", "paths": paths}}))
    out = eng.generate(prompts(), 20, ignore_eos=True)
    assert [r.tokens for r in out] == ar_tokens and max(n for r in out for n in r.accepted[:-1]) == 2
