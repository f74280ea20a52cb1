"""EAGLE-3 heads drafting static trees (issue #21): the head ranks each node's children by its draft logits, a depth
at a time, with tree attention in its own cache. Greedy decoding gives AR's tokens for every tiny family at batch
sizes 3 and 1; every node of every tree is the reference head's (tests/test_eagle3.py) ranked draft after the node's
ancestors, also after steps that accepted partial paths and other branches than the first; a head built to know the
target has its whole first branch accepted at every step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import specpilot.engine.decode as decode
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import RecipeError, parse
from specpilot.engine.tree import tree_from_paths
from test_decoding import TINY_NEW, tiny_prompts, tiny_reference  # noqa: F401 (a fixture)
from test_eagle3 import (ReferenceHead, bigram_target, check_rows, head_dir,  # noqa: F401 (fixtures)
                         head_that_knows)

# Depth 4; siblings with children of their own ([0] and [1], [0, 0] and [0, 1]: in the head they share a position,
# only the tree mask keeps them apart) and leaves above the deepest level ([2], [1, 0]: never run through the head).
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
SHAPE = tree_from_paths(TREE)


def tree_recipe(head, paths=TREE, **extra):
    return parse({"drafter": {"kind": "eagle3", "model": str(head)}, "k": max(len(p) for p in paths),
                  "verification": "tree", "tree": {"kind": "static", "paths": paths}, "cuda_graphs": False, **extra})


def record_trees(eng):
    """Every propose_tree call's (history, lengths, active rows, node tokens), from now on."""
    drafter, calls = eng.decoder.drafter, []
    real = drafter.propose_tree

    def propose_tree(history, lengths, shape):
        tokens, valid = real(history, lengths, shape)
        assert valid.all()
        calls.append((history.clone(), lengths.clone(), eng.decoder._state.active.clone(), tokens.clone()))
        return tokens, valid

    drafter.propose_tree = propose_tree
    return calls


def reference_tree(ref: ReferenceHead, states, context: list[int], shape) -> list[int]:
    """Nodes 1..N-1 as the reference head drafts them after `context`: node [..., r] is the r-th best draft of the
    head run on the chain context + the node's ancestors' tokens (each draft step reading the previous one's
    output, as ReferenceHead.propose), over the full causal sequence (no cache, no tree mask)."""
    seq = {0: (F.linear(states, ref.w["fc.weight"], ref.w.get("fc.bias")), torch.tensor(context[1:]))}
    ranked, tokens = {}, []
    for n in range(1, shape.nodes):  # breadth first: a parent's sequence is there before its children
        p = shape.parents[n]
        hidden, pairs = seq[p]
        if p not in ranked:
            out = ref.layer(pairs, hidden, torch.arange(pairs.shape[0]))
            ranked[p] = (out[-1:], ref.logits(out[-1]).argsort(descending=True))
        out, order = ranked[p]
        token = ref.target_id(int(order[shape.paths[n][-1]]))
        tokens.append(token)
        seq[n] = (torch.cat([hidden, out]), torch.cat([pairs, torch.tensor([token])]))
    return tokens


def check_trees(calls, hf, head_path, target_embed, aux_layers, shape) -> int:
    """Each active row's tree at each call is the reference head's on HF's states; returns the rows checked."""
    return check_rows(calls, hf, head_path, target_embed, aux_layers,
                      lambda ref, states, context, tokens: reference_tree(ref, states, context, shape))


def decodes_as_ar(eng, tiny_reference, family: str, width: int) -> None:
    """Three prompts of different lengths in one batch, then one at a time: HF's greedy tokens, and every step after
    the prefill verifies `width` tokens a row."""
    widths = []
    hook = eng.decoder.model.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    try:
        batched = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
        single = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True, max_batch=1)
    finally:
        hook.remove()
    assert [r.tokens for r in batched] == tiny_reference, family
    assert [r.tokens for r in single] == tiny_reference, family
    assert set(widths) == {width} | {len(p) for p in tiny_prompts()} | {max(len(p) for p in tiny_prompts())}


def record_paths(monkeypatch):
    """The accepted path (node indices by depth, up to its end) of every row at every tree step, from now on."""
    paths, real = [], decode.accept_tree_sampled

    def accept(*args):
        n_acc, emitted, path = real(*args)
        paths.extend(p[: n + 1] for p, n in zip(path.tolist(), n_acc.tolist()))
        return n_acc, emitted, path

    monkeypatch.setattr(decode, "accept_tree_sampled", accept)
    return paths


def test_eagle3_tree_greedy_is_ar(tiny, tiny_reference, head_dir):
    """Three prompts of different lengths in one batch, then one at a time: HF's greedy tokens, every family, every
    step after the prefill verifying the whole tree."""
    decodes_as_ar(Engine(tiny.loaded, tree_recipe(head_dir)), tiny_reference, tiny.family, SHAPE.nodes)


def test_eagle3_tree_nodes_are_the_reference_heads(tiny, head_dir):
    """Every node of every row's tree at every step is the reference head's ranked draft after the node's
    ancestors, on HF's hidden states: the ranking by draft logits and d2t, each node fed its parent's output at
    its own position, and the tree attention in the head's cache (a sibling seen would change the drafts)."""
    eng = Engine(tiny.loaded, tree_recipe(head_dir))
    calls = record_trees(eng)
    eng.generate(tiny_prompts(), 10, ignore_eos=True)
    assert check_trees(calls, tiny.hf, head_dir, tiny.loaded.model.embed.detach(),
                       eng.decoder.drafter.needs_hidden_states, SHAPE) >= 3 * 4


def test_a_head_that_knows_the_target_has_its_first_branch_accepted(bigram_target, tmp_path, monkeypatch):
    """head_that_knows is always right, so its rank-0 children are the target's tokens: every step accepts the
    whole depth along path [0, 0, 0, 0] (its attention is sharp on the query's own position: a node that saw its
    sibling, at the same position, would draft a mix of both). AR's tokens, k + 1 tokens a step."""
    hf, loaded = bigram_target
    head = head_that_knows(hf, tmp_path / "head")
    eng = Engine(loaded, tree_recipe(head))
    paths = record_paths(monkeypatch)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    want = Engine(loaded, parse({})).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want]
    first_branch = [0] + [SHAPE.paths.index((0,) * d) for d in range(1, SHAPE.depth + 1)]
    for r in rows:  # the last step may have been cut by the length limit
        assert r.accepted[:-1] == [SHAPE.depth] * (len(r.accepted) - 1), r.accepted
        assert r.mean_accepted > 4
    assert paths.count(first_branch) >= 3 * (TINY_NEW // (SHAPE.depth + 1))


def test_tree_after_partial_acceptance_and_other_branches(bigram_target, tmp_path, monkeypatch):
    """A noisy head_that_knows is right some of the time: steps accept paths of depths 0 to 3, through other ranks
    than 0 too, and every tree after any of them is still the reference head's (the head's cache keeps the
    accepted path's target states, whichever branch it took). AR's tokens; more than one token a step on average,
    and more than a chain of the same head verifying the tree's depth gets."""
    hf, loaded = bigram_target
    head = head_that_knows(hf, tmp_path / "head", noise=0.08)  # rank 0 often wrong, rank 1 often right
    eng = Engine(loaded, tree_recipe(head))
    calls, paths = record_trees(eng), record_paths(monkeypatch)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    want = Engine(loaded, parse({})).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want]
    assert {len(p) - 1 for p in paths} >= {0, 1, 2, 3}, paths
    assert any(any(SHAPE.paths[n][-1] > 0 for n in p[1:]) for p in paths), "no accepted path left branch 0"
    assert check_trees(calls, hf, head, loaded.model.embed.detach(), (0, 1, 1), SHAPE) > 10
    chain = Engine(loaded, parse({"drafter": {"kind": "eagle3", "model": str(head)}, "k": SHAPE.depth,
                                  "cuda_graphs": False})).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    tree_steps, chain_steps = sum(len(r.accepted) for r in rows), sum(len(r.accepted) for r in chain)
    assert sum(r.mean_accepted for r in rows) / len(rows) > 1.5
    assert tree_steps < chain_steps, (tree_steps, chain_steps)


def test_tree_recipe_with_an_eagle3_head(tmp_path):
    r = tree_recipe(tmp_path / "head")
    assert r.verification == "tree" and r.drafter.kind == "eagle3"
    with pytest.raises(RecipeError, match="n-gram drafter, an EAGLE-3 head or the replay drafter") as err:
        parse({"drafter": {"kind": "layerskip", "layers": 1}, "k": 1, "verification": "tree",
               "tree": {"paths": [[0]]}})
    assert "\n" not in str(err.value)
