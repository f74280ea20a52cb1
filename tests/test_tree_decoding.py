"""Tree verification end to end (issue #21 item 2, n-gram trees): the n-gram drafter's several matches fill a static
tree's branches, the target verifies every node of every row in one forward, and greedy decoding gives AR's tokens
for every family, on the modular layer and with `layer: fused` (whose kernels mask each node to its ancestors);
sampled tree steps run too."""
from __future__ import annotations

import pytest
import torch

from specpilot.engine.engine import Engine
from specpilot.engine.recipe import RecipeError, parse
from specpilot.engine.sampling import SamplingParams
from specpilot.engine.tree import chains
from test_decoding import TINY_NEW, tiny_prompts, tiny_reference  # noqa: F401 (a fixture)

CHAINS = [list(p) for p in chains(3, 4).paths[1:]]  # three branches of four drafts
MIXED = [[0], [0, 0], [0, 0, 0], [1], [1, 0], [2], [0, 1]]  # [0, 1]: no n-gram continuation, always empty


def tree_recipe(paths, **extra):
    depth = max(len(p) for p in paths)
    return parse({"drafter": {"kind": "ngram"}, "k": depth, "verification": "tree", "cuda_graphs": False,
                  "tree": {"kind": "static", "paths": paths}, **extra})


@pytest.mark.parametrize("paths", [CHAINS, MIXED], ids=["chains", "mixed"])
def test_tree_greedy_is_ar(tiny, tiny_reference, paths):
    eng = Engine(tiny.loaded, tree_recipe(paths))
    widths = []
    hook = eng.decoder.model.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    try:
        rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    finally:
        hook.remove()
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    assert set(widths[1:]) == {len(paths) + 1}  # every step after the prefill verifies the whole tree


def test_tree_accepts_what_its_first_branch_misses(tiny_model_dir):
    """A target whose layers add nothing (their output projections zeroed): its next token depends only on the
    current one, f(t). A prompt ends with [a, b, x], whose first new token is f(x); an older occurrence of
    [b, x, f(x)] is followed by the true continuation f(f(x)), ..., the latest by junk. The chain drafter proposes
    what follows the latest match (junk: nothing accepted); the tree's second branch proposes the older one, all
    four accepted at the first step.
    Both decode AR's tokens, the tree in fewer target steps."""
    from specpilot.engine.loader import load

    loaded = load(str(tiny_model_dir("llama")), "fp32", "cpu")
    with torch.no_grad():
        for block in loaded.model.layers:
            block.wo.zero_()
            block.w2.zero_()
    ar = Engine(loaded, parse({}))

    def follow(t, n):
        return ar.generate([[t]], n, ignore_eos=True)[0].tokens

    a, b, x = 11, 12, 13
    truth = follow(x, 5)  # the prefill's token, then the four the drafts should be
    junk = [t for t in range(100, 140) if t != truth[1]][:4]
    prompt = [a, b, x] + truth + [7, 8] + [a, b, x, truth[0]] + junk + [9] + [a, b, x]
    want = ar.generate([prompt], 12, ignore_eos=True)[0].tokens
    assert want[:5] == truth
    chain = Engine(loaded, parse({"drafter": {"kind": "ngram"}, "k": 4, "cuda_graphs": False}))
    tree = Engine(loaded, tree_recipe(CHAINS))
    (c,), (t,) = chain.generate([prompt], 12, ignore_eos=True), tree.generate([prompt], 12, ignore_eos=True)
    assert c.tokens == want == t.tokens
    assert c.accepted[0] == 0 and t.accepted[0] == 4
    assert len(t.accepted) < len(c.accepted)


def test_tree_with_the_fused_layer_and_ar_after_miss(tiny_model_dir):
    from specpilot.engine.loader import load

    # one layer: a tree step's masks are every layer's, and each interpreted fused-layer call costs seconds
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    want = Engine(loaded, parse({})).generate(tiny_prompts(), 16, ignore_eos=True)
    recipe = tree_recipe(CHAINS, layer="fused", overlap=True)
    recipe.drafter.ar_after_miss = True
    got = Engine(loaded, recipe).generate(tiny_prompts(), 16, ignore_eos=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_tree_steps_run_on_the_fused_layer(tiny_model_dir, monkeypatch, paths=MIXED):
    """With `layer: fused` a tree step's layers run the fused kernels, the attention masking each node to the slots
    before its tree and its ancestors' (one int64 of ancestor bits a node), and greedy decoding gives AR's tokens:
    three rows of a tree of 8 nodes with an empty branch, 24 tokens a step (two of the tensor-core path's token
    blocks)."""
    from specpilot.engine.loader import load
    from specpilot.kernels import triton_fused_layer as fused

    monkeypatch.setattr(fused, "MAX_TOKENS", 64)
    calls, real = [], fused.fused_layer

    def counted(*args, tree=None, **kwargs):
        calls.append(tree is not None)
        return real(*args, tree=tree, **kwargs)

    monkeypatch.setattr(fused, "fused_layer", counted)
    # one layer: a tree step's masks are every layer's, and each interpreted fused-layer call costs seconds
    loaded = load(str(tiny_model_dir("llama", num_hidden_layers=1)), "fp32", "cpu")
    want = Engine(loaded, parse({})).generate(tiny_prompts(), 8, ignore_eos=True)
    got = Engine(loaded, tree_recipe(paths, layer="fused")).generate(tiny_prompts(), 8, ignore_eos=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert calls.count(True) >= loaded.model.cfg.n_layers  # every layer of the tree steps, fused


def test_ancestor_bits():
    from specpilot.engine.tree import ancestor_bits, tree_from_paths

    shape = tree_from_paths(MIXED)
    bits = ancestor_bits(shape.ancestors()).tolist()
    for n in range(shape.nodes):
        assert [m for m in range(shape.nodes) if bits[n] >> m & 1] == \
            [m for m in range(shape.nodes) if shape.ancestors()[n, m]]
    full = torch.ones(64, 64, dtype=torch.bool).tril()  # a chain of 64: node 63 sees all, bit 63 the sign bit
    assert ancestor_bits(full)[63].item() == -1 and ancestor_bits(torch.ones(65, 65, dtype=torch.bool)) is None


def test_tree_recipes_refused_in_one_line():
    for data, key in (({"k": 4, "drafter": {"kind": "ngram"}, "verification": "tree"}, "tree.paths"),
                      ({"k": 3, "drafter": {"kind": "ngram"}, "verification": "tree",
                        "tree": {"paths": CHAINS}}, "'k'"),
                      ({"k": 1, "drafter": {"kind": "layerskip", "layers": 1}, "verification": "tree",
                        "tree": {"paths": [[0]]}}, "verification"),
                      ({"k": 1, "drafter": {"kind": "ngram", "adaptive": True}, "verification": "tree",
                        "tree": {"paths": [[0]]}}, "drafter.adaptive"),
                      ({"k": 1, "drafter": {"kind": "ngram"}, "verification": "tree",
                        "tree": {"kind": "dynamic", "paths": [[0]]}}, "tree.kind"),
                      ({"k": 1, "drafter": {"kind": "ngram"}, "verification": "tree",
                        "tree": {"paths": [[0, -1]]}}, "tree.paths")):
        with pytest.raises(RecipeError, match=key):
            parse(data)


def test_sampled_tree_steps(tiny, tiny_reference):
    """Sampled tree verification (accept_tree_sampled; its distribution is tests/test_tree_sampling.py's): with
    top_k = 1 the target's distribution is its argmax, so the tokens are AR's; at temperature 0.8 a seed fixes the
    tokens and the steps verify the whole tree."""
    eng = Engine(tiny.loaded, tree_recipe(MIXED))
    rows = eng.generate(tiny_prompts(), TINY_NEW, sampling=SamplingParams(temperature=1.0, top_k=1), ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    warm = SamplingParams(temperature=0.8)
    first = [r.tokens for r in eng.generate(tiny_prompts(), TINY_NEW, sampling=warm, seed=3, ignore_eos=True)]
    again = [r.tokens for r in eng.generate(tiny_prompts(), TINY_NEW, sampling=warm, seed=3, ignore_eos=True)]
    assert first == again and all(len(t) == TINY_NEW for t in first)
