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


def test_compiled_bookkeeping_stores_in_place_without_passing_over_whole_buffers():
    """A step's compiled bookkeeping writes a few slots of a large buffer in place: the history's new tokens
    (`_finish_step`), an EAGLE-3 head's pended pair (`pend_pair`) and kept pairs (`keep_pairs`). Written as scatter_
    into an input, inductor ran the store on a copy of the whole buffer and copied it back (a pass of B x S elements
    each way, every step); the generated code must hold no loop of a whole buffer's size (sizes chosen to be unique),
    and the values must be those of the eager functions."""
    from torch._inductor.utils import run_and_get_code

    from specpilot.engine.decode import _finish_step
    from specpilot.engine.eagle3 import keep_pairs, pend_pair
    from specpilot.engine.model import compiled
    from specpilot.kernels.builtin import accept_torch

    def both(fn, *args):
        """(eager outputs and inputs after, compiled ones, the compiled code), on copies of the same inputs."""
        eager = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = fn(*eager)
        got, code = run_and_get_code(compiled(fn), *mine)
        return (want, eager), (got, mine), "".join(code)

    g = torch.Generator().manual_seed(0)
    B, S, k, V = 3, 4099, 3, 50
    logits = torch.randn(B, k + 1, V, generator=g)
    drafts = logits[:, :k].argmax(-1)
    drafts[1, 1] += 1  # row 1 accepts one draft, the others all three
    args = (torch.randint(0, V, (B, S), generator=g), torch.tensor([10, 4000, 4097]), torch.ones(B, dtype=torch.long),
            torch.zeros(B, k + 4, dtype=torch.long), drafts, torch.full((B,), k), logits, accept_torch,
            torch.zeros(B, dtype=torch.long))
    (want, eager), (got, mine), code = both(_finish_step, *args)
    assert got.tolist() == want.tolist() == [3, 1, 3]
    assert all(torch.equal(a, b) for a, b in zip(eager[:4], mine[:4]))
    assert str(B * S) not in code, "the history is passed over whole"

    slots, width = 23, 1733
    pending = torch.randn(B, slots, width, generator=g).to(torch.bfloat16)
    new = torch.tensor([0, 5, slots - 1])  # the last row's buffer full: its newest pair takes the last slot
    hidden = torch.randn(B, 1, width, generator=g)
    (_, eager), (_, after), code = both(pend_pair, pending, new, hidden)
    assert all(torch.equal(a, b) for a, b in zip(eager, after)) and after[1].tolist() == [1, 6, slots - 1]
    assert torch.equal(after[0][1, 6], hidden[1, 0].to(torch.bfloat16))
    assert torch.equal(after[0][2, slots - 1], hidden[2, 0].to(torch.bfloat16))
    assert str(B * slots * width) not in code, "the pending buffer is passed over whole"

    accepted = torch.tensor([0, 1, 1])
    kept = torch.randn(B, 2, width, generator=g)
    kept[0, 1] = float("nan")  # past row 0's accepted slot: anything, NaN included, leaves a zero
    (_, eager), (_, mine), code = both(keep_pairs, pending[:, : k + 1], new, kept, accepted)
    assert torch.equal(eager[0], mine[0]) and torch.equal(eager[1], mine[1]) and mine[1].tolist() == [0, 1, 1]
    assert torch.equal(mine[0][:, 2:], torch.zeros_like(mine[0][:, 2:])) and not mine[0][0, 1].any()
    assert str(B * slots * width) not in code
