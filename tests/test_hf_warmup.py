"""The HF static-cache baseline warms up every shape a bench cell times: after `prepare`, timed calls compile nothing.

HF compiles its decoding step (static cache) per batch size and cache length; it does so on CUDA only unless the
generation config's compile config says `_compile_all_devices` (HF's switch for testing). The tiny model here says so,
with dynamo's eager backend: the same graphs, guards and recompiles as on CUDA, without inductor's code generation.
Independently of compiling, the shape of every forward (each prefill's batch size and prompt width, each decoding
step's batch size and cache length) is recorded, and every shape a timed call runs must have run in `prepare`, in the
same cache objects.
"""
from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from specpilot.engine.loader import load
from specpilot.tools.bench.hf_baselines import HFSystem, dynamo_graphs, load_hf_model, static_cache_length

MAX_NEW = 6
# One cell at batch size 3: a short last batch (a second batch size), and one prompt wide enough (300 tokens) that
# the cache HF would size for the first batch (256 slots) is too short for the second.
WIDTHS = [[5, 9, 14], [300, 7, 11], [23]]


def cell_batches() -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return [[torch.randint(1, 256, (w,), generator=gen).tolist() for w in batch] for batch in WIDTHS]


class Shapes:
    """Records the shape of each forward `generate` runs: ("prefill", batch size, prompt width) or ("step", batch
    size, cache length) for a decoding step (one new token a row, the mask spanning the cache). Read from the inputs
    `generate` prepares for each forward, outside the compiled call (whose Python does not run again once compiled)."""

    def __init__(self, model):
        self.seen: set[tuple[str, int, int]] = set()
        self.prepare_inputs = model.prepare_inputs_for_generation
        model.prepare_inputs_for_generation = self.record

    def record(self, *args, **kwargs):
        inputs = self.prepare_inputs(*args, **kwargs)
        batch, width = inputs["input_ids"].shape
        if width > 1:  # (a prefill without padding may have no mask)
            self.seen.add(("prefill", batch, width))
        else:
            self.seen.add(("step", batch, inputs["attention_mask"].shape[-1]))
        return inputs


@pytest.fixture
def hf_static(tiny_model_dir):
    torch._dynamo.reset()  # no graph left from another test: each test's compiles are its own
    target = load(str(tiny_model_dir("llama")), "fp32", "cpu")
    model = load_hf_model(target)
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    return HFSystem("hf-static", model, target)


def bench_warmup(system: HFSystem, batches) -> None:
    """What the bench decodes before `prepare` (run.py, measure_cell): the first batch and a short last one."""
    for batch in batches[:1] + batches[-1:]:
        system.run(batch, MAX_NEW, ignore_eos=True)


def test_prepared_cell_compiles_nothing_while_timed(hf_static):
    batches = cell_batches()
    shapes = Shapes(hf_static.model)
    bench_warmup(hf_static, batches)
    compiled_before = dynamo_graphs()
    hf_static.prepare(batches, MAX_NEW)
    assert dynamo_graphs() > compiled_before  # the cache grew to the cell's length: prepare recompiled, untimed
    prepared, caches = set(shapes.seen), dict(hf_static.caches)
    shapes.seen.clear()
    runs = [hf_static.run(batch, MAX_NEW, ignore_eos=True) for batch in batches]
    assert [r.captures for r in runs] == [0, 0, 0]
    length = static_cache_length(300, MAX_NEW)
    assert hf_static.cache_length == length == 512
    # every shape timed ran in prepare: each batch's prefill, the decoding step at both batch sizes
    assert shapes.seen == {("prefill", 3, 14), ("prefill", 3, 300), ("prefill", 1, 23), ("step", 3, length),
                           ("step", 1, length)}
    assert shapes.seen <= prepared
    # in the caches prepare filled (on CUDA a cache at new addresses is a new recording)
    assert hf_static.caches.keys() == caches.keys() == {3, 1}
    assert all(hf_static.caches[b] is cache for b, cache in caches.items())
    assert all(len(row) == MAX_NEW for r in runs for row in r.tokens)


def test_unprepared_cell_compiles_while_timed(hf_static):
    """The control (issue #20's `hf-static` on the H200): with the bench's warm-up alone, the wide prompt's batch
    grows the cache inside a timed call, and HF recompiles there."""
    batches = cell_batches()
    bench_warmup(hf_static, batches)
    runs = [hf_static.run(batch, MAX_NEW, ignore_eos=True) for batch in batches]
    assert runs[0].captures == 0 and runs[1].captures > 0


def test_prepared_tokens_are_unpadded_greedy(hf_static):
    """The rounded, reused cache and left padding change no token: each row is what HF's plain greedy decode (a
    dynamic cache, the prompt alone) gives."""
    batches = cell_batches()
    hf_static.prepare(batches, MAX_NEW)
    for batch in batches:
        run = hf_static.run(batch, MAX_NEW, ignore_eos=True)
        for prompt, tokens in zip(batch, run.tokens):
            with torch.inference_mode():
                alone = hf_static.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                                 pad_token_id=0, eos_token_id=None)
            assert tokens == alone[0, len(prompt):].tolist()
