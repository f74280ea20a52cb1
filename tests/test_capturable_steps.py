"""A step the decoder captures as a CUDA graph must not build a tensor from host data: a non-pinned host-to-device
copy is refused during capture (on the H200 every static-tree replay recipe failed its warm-up that way, through
`tree_positions` making the tree's depths from a list at each call). On the CPU nothing refuses it, so after one
decode every kind of step is run once more with `torch.tensor` and `torch.as_tensor` raising."""
from __future__ import annotations

import pytest
import torch

from eagle3_head import write_head
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import parse
from specpilot.engine.sampling import SamplingParams
from test_decoding import tiny_prompts

TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]


def recipes(head: str) -> dict[str, dict]:
    tree = {"verification": "tree", "tree": {"kind": "static", "paths": TREE}, "k": 3}
    replay = {"kind": "replay", "acceptance": [0.8, 0.6, 0.4]}
    return {
        "ngram-chain": {"drafter": {"kind": "ngram"}, "k": 3},
        "ngram-tree": {"drafter": {"kind": "ngram"}, **tree},
        "eagle3-chain": {"drafter": {"kind": "eagle3", "model": head}, "k": 3},
        "eagle3-tree": {"drafter": {"kind": "eagle3", "model": head}, **tree},
        "eagle3-dynamic-tree": {"drafter": {"kind": "eagle3", "model": head}, "k": 3, "verification": "tree",
                                "tree": {"kind": "dynamic", "depth": 3, "topk": 2, "tokens": 6}},
        "replay-chain": {"drafter": {**replay, "model": "random-eagle3"}, "k": 3},
        "replay-tree": {"drafter": {**replay, "model": "random-eagle3"}, **tree},
        "controller": {"drafter": {"kind": "ngram"}, "k": 3, "batch": {"controller": "cost"}},
    }


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    from specpilot.engine.loader import load

    return load(str(tiny_model_dir("llama")), "fp32", "cpu")


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return str(write_head(tmp_path_factory.mktemp("eagle3-capturable"), target.hf_config, seed=3))


@pytest.mark.parametrize("name", list(recipes("")))
def test_no_step_builds_a_tensor_from_host_data(target, head, name, monkeypatch):
    eng = Engine(target, parse({**recipes(head)[name], "cuda_graphs": False}))
    eng.generate(tiny_prompts(), 6, ignore_eos=True)
    dec = eng.decoder

    def refused(*args, **kwargs):
        raise AssertionError("a tensor built from host data inside a step")

    for kind in dec._step_kinds():
        monkeypatch.setattr(torch, "tensor", refused)
        monkeypatch.setattr(torch, "as_tensor", refused)
        try:
            dec._step(dec._state, SamplingParams(), kind)
        finally:
            monkeypatch.undo()
