"""Bucketed shapes and the warm-up (issue #20 item 3): after `Engine.warmup`, a batch within its bounds captures and
compiles nothing; a batch padded to its bucket gives every row the tokens it gets decoded alone.

On the CPU there are no CUDA graphs, but the decoder counts a shape's first use through the same code that captures
it on CUDA (`Decoder._graph`, `Decoder._prefill_graph`), so `decoder.captures` means the same thing here."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB
from specpilot.engine.decode import BATCH_BUCKETS, batch_bucket, cache_length, prefill_width, prefill_widths
from specpilot.engine.engine import Engine
from specpilot.engine.loader import load
from specpilot.engine.recipe import parse
from test_decoding import TINY_NEW, hf_greedy, tiny_prompts

RECIPES = {
    "ar": {},
    "ngram": {"drafter": {"kind": "ngram", "adaptive": True, "ar_after_miss": True}, "k": 4},
    "model": {"drafter": {"kind": "model", "model": "draft"}, "k": 3},
    "controller": {"drafter": {"kind": "ngram"}, "k": 3, "batch": {"controller": "cost"}},
}


def five_prompts() -> list[list[int]]:
    """The three ragged tiny prompts and two more (one of a single token): a batch of 5, bucket 8."""
    g = torch.Generator().manual_seed(5)
    return tiny_prompts() + [torch.randint(0, TINY_VOCAB, (14,), generator=g).tolist(), [42]]


def bucketed_engine(loaded, name: str, draft=None) -> Engine:
    eng = Engine(loaded, parse({**RECIPES[name], "cuda_graphs": False}), draft=draft if name == "model" else None)
    eng.decoder.bucketed = True  # as with CUDA graphs
    return eng


def test_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8, 9, 33, 64, 65, 130)] == [1, 2, 4, 8, 8, 16, 64, 64, 128, 192]
    assert [prefill_width(n) for n in (1, 64, 65, 200, 256, 257, 384, 385, 600, 1000, 1025)] == \
        [64, 64, 128, 256, 256, 384, 384, 512, 768, 1024, 1536]
    assert prefill_widths(300) == [64, 128, 192, 256, 384]
    assert prefill_widths(2048) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    for n in range(1, 3000, 7):  # every width pads by less than 64 tokens or half, and is in the warmed list
        w = prefill_width(n)
        assert n <= w and (w - n < 64 or w < n * 3 / 2) and w in prefill_widths(n)
    assert BATCH_BUCKETS == (1, 2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load(str(tiny_model_dir("llama")), "fp32", "cpu")


def test_a_draft_never_doubles_the_cache_length():
    """The KV cache a batch gets holds its prompt, its new tokens and two steps of verified drafts, in steps of an
    eighth of the power of two below (few shapes to capture), so that verifying drafts costs a few slots more than AR
    and never twice the cache that AR reads (the H200's chat cells at B = 64: 512 against 1,024 slots, every kind of
    the controller's step 15% slower than AR's)."""
    seen = set()
    for prompt in range(1, 9000, 3):
        for k in (0, 1, 4, 16):
            need = prompt + 128 + 2 * (k + 1) + 1
            slots = cache_length(prompt, 128, k, overlap=True)
            assert slots >= max(need, 512) and slots % 64 == 0, (prompt, k, slots)
            seen.add(slots)
        ar, four = cache_length(prompt, 128, 0, True), cache_length(prompt, 128, 4, True)
        assert ar <= four <= ar * 9 // 8, (prompt, ar, four)
    assert cache_length(380, 128, 4, overlap=True) == 576 and cache_length(380, 128, 0, overlap=True) == 512
    # about 8 lengths a doubling: later batches reuse the cache and its captured graphs
    assert len([n for n in seen if 4096 < n <= 8192]) == 8


@pytest.mark.parametrize("name", list(RECIPES))
def test_no_capture_after_warmup(llama, tiny_draft, name):
    """Warm up for batch sizes 1, 3 and 5 and prompts of up to 300 tokens, then decode batches of those sizes with
    prompts of 1 to 300 tokens: no new shape. Without the warm-up the same batches capture, and a prompt past the
    warmed width does too, so the counter can fail."""
    batches = [five_prompts(), tiny_prompts(), [list(range(1, 256)) + [7] * 45], five_prompts()[3:4]]
    cold = bucketed_engine(llama, name, tiny_draft)
    for rows in batches:
        cold.generate(rows, 12, ignore_eos=True)
    assert cold.decoder.captures > 0

    eng = bucketed_engine(llama, name, tiny_draft)
    eng.warmup([1, 3, 5], max_prompt_tokens=300, max_new_tokens=12)
    warmed = eng.decoder.captures
    kinds = {"ar": 1, "ngram": 2, "model": 1, "controller": 5}[name]  # the controller's: k' = 3..0 and blind AR
    # three buckets (1, 4, 8): each kind of step, and prefill at every width up to 384; with continuous batching
    # also the prefill of the requests started in a running batch, in groups of 1, 2, 4 and 8, at every width, and
    # the steps of bucket 2, where a batch of 4 or 8 drains to (with the one prefill of its warm-up batch)
    continuous = eng.decoder.continuous
    groups, drains = (4, 1) if continuous else (0, 0)
    assert warmed == 3 * (kinds + len(prefill_widths(300))) + groups * len(prefill_widths(300)) + drains * (kinds + 1)
    if name == "controller":
        assert set(eng.decoder.prices) == {1, 2, 4, 8} and all(set(p) == {-1, 0, 1, 2, 3} for p in eng.decoder.prices.values())
    for rows in batches:
        out = eng.generate(rows, 12, ignore_eos=True)
        assert [len(r.tokens) for r in out] == [12] * len(rows)
    many = [p for rows in batches for p in rows]  # 10 requests through 5 rows: 5 started in a running batch
    assert [len(r.tokens) for r in eng.generate(many, 12, ignore_eos=True, max_batch=5)] == [12] * len(many)
    assert eng.decoder.last_stats.refills == (len(many) - 5 if groups else 0)
    assert eng.decoder.captures == warmed, eng.decoder.captured[warmed:]
    eng.generate([[3] * 400], 12, ignore_eos=True)  # wider than warmed: a new prefill shape (and a larger cache)
    assert eng.decoder.captures > warmed


@pytest.mark.parametrize("name", ["ngram", "model"])  # (the n-gram recipe's AR steps cover k = 0)
def test_bucket_padded_batch_decodes_each_row_as_alone(tiny, tiny_draft, name):
    """A batch of 5 runs as 8 rows, three of them dead: each real row's greedy tokens are HF's for that prompt
    alone, and stop conditions still cut each row on its own."""
    prompts = five_prompts()
    refs = [hf_greedy(tiny.hf, p, TINY_NEW, stop_at_eos=False) for p in prompts]
    eng = bucketed_engine(tiny.loaded, name, tiny_draft)
    rows = eng.generate(prompts, TINY_NEW, ignore_eos=True)
    assert eng.decoder._state.batch == 8 and len(rows) == 5
    assert [r.tokens for r in rows] == refs, tiny.family
    # the same engine, a batch of one after it (bucket 1) and of 3 (bucket 4): still each row as alone
    assert eng.generate(prompts[4:], TINY_NEW, ignore_eos=True)[0].tokens == refs[4]
    assert [r.tokens for r in eng.generate(prompts[:3], 9, ignore_eos=True)] == [r[:9] for r in refs[:3]]


def test_compiled_prefill_traces_every_width_as_one_graph(llama):
    """The compiled prefill (SPECPILOT_COMPILED_PREFILL; `compiled_dynamic`) gives eager's logits and K/V at every
    group size and width a refill or a batch prefills at, from at most three graphs (the first shape's, one
    symbolic graph for every later shape, and a batch of one's) rather than one a shape: each traced graph is counted
    by the backend (the CPU runs no Inductor here)."""
    from specpilot.engine.model import Block, compiled_dynamic

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()  # (another test's compilations of Block.forward must not count here, nor decide for it)
    layer = compiled_dynamic(Block.forward, backend=backend)
    model = llama.model
    torch.manual_seed(0)
    traced = []
    for batch, width in ((3, 64), (16, 128), (5, 192), (8, 320), (2, 448), (1, 64), (1, 256)):
        tokens = torch.randint(0, TINY_VOCAB, (batch, width))
        positions = torch.arange(width)[None].expand(batch, width)
        last = torch.randint(1, width + 1, (batch,))
        outs = []
        for fn in (None, layer):
            cache = model.new_cache(batch, 512)
            logits = model(tokens, positions, cache, logits_at=(last - 1)[:, None], layer_fn=fn)
            outs.append((logits, cache.kv.clone()))
        assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5), (batch, width)
        assert torch.allclose(outs[0][1], outs[1][1], atol=1e-5), (batch, width)
        traced.append(len(graphs))
    # at most the first shape's, a symbolic one that every later width and group reuses, and a batch of one's
    assert traced[2] == traced[3] == traced[4] and traced[-1] <= 3
