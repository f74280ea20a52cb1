"""EAGLE-3 heads drafting EAGLE-2's dynamic trees (issue #21): each row's tree at each step is the one EAGLE-2's rule
(tests/test_tree_dynamic.py `brute_dynamic`) builds from the reference head's (tests/test_eagle3.py) draft logits;
greedy decoding gives AR's tokens for every tiny family at batch sizes 3 and 1, also when the head drafts more nodes
than the step verifies; a head sure of the target has the whole depth accepted at every step; sampled steps keep AR's
tokens at top_k = 1; bad dynamic-tree recipes are refused in one line naming the key."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specpilot.engine.engine import Engine
from specpilot.engine.recipe import RecipeError, parse
from specpilot.engine.sampling import SamplingParams
from specpilot.engine.tree import DynamicTree
from test_decoding import TINY_NEW, tiny_prompts, tiny_reference  # noqa: F401 (a fixture)
from test_eagle3 import (ReferenceHead, bigram_target, head_dir, head_that_knows,  # noqa: F401 (fixtures)
                         hf_layer_outputs)
from test_eagle3_tree import decodes_as_ar
from test_tree_dynamic import brute_dynamic

# Depth 4, the 3 best drafts after each of a level's 3 best nodes, 12 nodes verified (of 1 + 3 + 27 candidates).
DYNAMIC = DynamicTree(4, 3, 12)
# More nodes drafted than verified ((depth - 1) x topk = 12 beam nodes, 8 verified): the head's cache needs slots
# past the target's (the decoder's margin).
NARROW = DynamicTree(4, 4, 8)


def dynamic_recipe(head, spec=DYNAMIC, **extra):
    return parse({"drafter": {"kind": "eagle3", "model": str(head)}, "k": spec.depth, "verification": "tree",
                  "tree": {"kind": "dynamic", "depth": spec.depth, "topk": spec.topk, "tokens": spec.tokens},
                  "cuda_graphs": False, **extra})


def record_dynamic_trees(eng):
    """Every propose_dynamic_tree call's (history, lengths, active rows, node tokens, parents), from now on."""
    drafter, calls = eng.decoder.drafter, []
    real = drafter.propose_dynamic_tree

    def propose(history, lengths, spec):
        tokens, valid, trees = real(history, lengths, spec)
        assert valid.all()
        calls.append((history.clone(), lengths.clone(), eng.decoder._state.active.clone(), tokens.clone(),
                      trees.parents.clone()))
        return tokens, valid, trees

    drafter.propose_dynamic_tree = propose
    return calls


def reference_logits(ref: ReferenceHead, states, context: list[int]):
    """The reference head's draft logits after the root and a prefix of draft ids, over the full causal sequence
    (each draft step reading the previous one's output, as ReferenceHead.propose; no cache, no tree mask)."""
    seq = {(): (F.linear(states, ref.w["fc.weight"], ref.w.get("fc.bias")), torch.tensor(context[1:]))}
    last = {}

    def logits(prefix: tuple) -> torch.Tensor:
        if prefix not in seq:
            logits(prefix[:-1])
            hidden, pairs = seq[prefix[:-1]]
            seq[prefix] = (torch.cat([hidden, last[prefix[:-1]]]),
                           torch.cat([pairs, torch.tensor([ref.target_id(prefix[-1])])]))
        if prefix not in last:
            hidden, pairs = seq[prefix]
            last[prefix] = ref.layer(pairs, hidden, torch.arange(pairs.shape[0]))[-1:]
        return ref.logits(last[prefix][0])

    return logits


def test_eagle3_dynamic_tree_greedy_is_ar(tiny, tiny_reference, head_dir):
    """Three prompts of different lengths in one batch, then one at a time: HF's greedy tokens, every family, every
    step after the prefill verifying the tree's N nodes a row (NARROW: the head's cache with the decoder's margin)."""
    decodes_as_ar(Engine(tiny.loaded, dynamic_recipe(head_dir, NARROW)), tiny_reference, tiny.family, NARROW.tokens)


def test_dynamic_tree_nodes_are_the_reference_heads(tiny, head_dir):
    """Every row's tree at every step is the one EAGLE-2's rule (test_tree_dynamic.brute_dynamic) builds from the
    reference head's draft logits after each prefix, on HF's hidden states: the same nodes under the same parents.
    So the head ran each beam node on its parent's output at its own position, in cache slots of its own (NARROW's
    reach past the verified nodes'), and its tree attention kept the beam nodes of a level (one position) and their
    subtrees apart."""
    spec = NARROW
    eng = Engine(tiny.loaded, dynamic_recipe(head_dir, spec))
    calls = record_dynamic_trees(eng)
    eng.generate(tiny_prompts(), 10, ignore_eos=True)
    ref, checked = ReferenceHead(head_dir, tiny.loaded.model.embed.detach()), 0
    for history, lengths, active, tokens, parents in calls:
        for b in range(history.shape[0]):
            if not active[b]:
                continue
            context = history[b, : int(lengths[b])].tolist()
            states = hf_layer_outputs(tiny.hf, context[:-1], eng.decoder.drafter.needs_hidden_states)
            want = [tuple(ref.target_id(d) for d in p)
                    for p in brute_dynamic(reference_logits(ref, states, context), (), spec)]
            got = [()]
            for n in range(1, spec.tokens):
                got.append(got[int(parents[b, n])] + (int(tokens[b, n - 1]),))
            assert got[1:] == want, (b, len(context))
            checked += 1
    assert checked >= 3 * 4


def sure(head: Path, factor: float = 1000.0) -> Path:
    """The head with its LM head scaled up: the same ranking of drafts, the best one's probability near 1."""
    from safetensors.torch import load_file, save_file

    file = str(head / "model.safetensors")
    weights = load_file(file)
    weights["lm_head.weight"] *= factor
    save_file(weights, file, metadata={"format": "pt"})
    return head


def test_a_head_that_knows_the_target_has_its_whole_depth_accepted(bigram_target, tmp_path):
    """head_that_knows's best draft is always the target's token; made sure of it, its chain of best drafts scores
    about 0 at every depth, so it is in every beam and kept: every step accepts the whole depth. AR's tokens. (Unsure,
    as the bigram target's flat logits leave it, a deep chain of best drafts can score below shallower nodes and
    go, as EAGLE-2's rule wants.)"""
    hf, loaded = bigram_target
    head = sure(head_that_knows(hf, tmp_path / "head"))
    rows = Engine(loaded, dynamic_recipe(head)).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    want = Engine(loaded, parse({})).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want]
    for r in rows:  # the last step may have been cut by the length limit
        assert r.accepted[:-1] == [DYNAMIC.depth] * (len(r.accepted) - 1), r.accepted


def test_sampled_dynamic_tree_steps(bigram_target, tmp_path):
    """Sampled verification of per-row trees (accept_tree_sampled; tests/test_tree_dynamic.py): with top_k = 1 the
    target's distribution is its argmax, so the tokens are AR's; at temperature 0.8 a seed fixes the tokens."""
    hf, loaded = bigram_target
    eng = Engine(loaded, dynamic_recipe(head_that_knows(hf, tmp_path / "head", noise=0.08)))
    want = Engine(loaded, parse({})).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    rows = eng.generate(tiny_prompts(), TINY_NEW, sampling=SamplingParams(temperature=1.0, top_k=1), ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want]
    warm = SamplingParams(temperature=0.8)
    first = [r.tokens for r in eng.generate(tiny_prompts(), TINY_NEW, sampling=warm, seed=3, ignore_eos=True)]
    again = [r.tokens for r in eng.generate(tiny_prompts(), TINY_NEW, sampling=warm, seed=3, ignore_eos=True)]
    assert first == again and all(len(t) == TINY_NEW for t in first)


def test_dynamic_tree_recipes_refused_in_one_line(tmp_path):
    r = dynamic_recipe(tmp_path / "head")
    assert (r.tree.kind, r.tree.depth, r.tree.topk, r.tree.tokens) == ("dynamic", 4, 3, 12)
    eagle = {"kind": "eagle3", "model": str(tmp_path / "head")}
    for drafter, k, tree, key in ((eagle, 2, {"depth": 0, "topk": 2, "tokens": 3}, "tree.depth"),
                                  (eagle, 2, {"depth": 2, "topk": 0, "tokens": 3}, "tree.topk"),
                                  (eagle, 2, {"depth": 2, "topk": 2, "tokens": 1}, "tree.tokens"),
                                  (eagle, 2, {"depth": 2, "topk": 2, "tokens": 8}, "tree.tokens"),  # 1 + 2 + 4 = 7
                                  (eagle, 3, {"depth": 2, "topk": 2, "tokens": 7}, "'k'"),
                                  (eagle, 2, {"depth": 2, "topk": 2, "tokens": 7, "paths": [[0]]}, "tree.paths"),
                                  ({"kind": "ngram"}, 2, {"depth": 2, "topk": 2, "tokens": 5}, "tree.kind")):
        with pytest.raises(RecipeError, match=key) as err:
            parse({"drafter": drafter, "k": k, "verification": "tree", "tree": {"kind": "dynamic", **tree}})
        assert "\n" not in str(err.value)
    with pytest.raises(RecipeError, match="tree.topk"):
        parse({"drafter": eagle, "k": 1, "verification": "tree", "tree": {"paths": [[0]], "topk": 2}})
    assert parse({"drafter": eagle, "k": 2, "verification": "tree",
                  "tree": {"kind": "dynamic", "depth": 2, "topk": 2, "tokens": 7}}).tree.tokens == 7
