"""Continuous batching: with more requests than rows, a row whose request finishes takes the next waiting one, and
every request still decodes the tokens it decodes alone (greedy), whatever the recipe; the bench and the engine
pass the concurrency through."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB
from specpilot.engine.decode import Decoder, StopCondition
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import parse

N_NEW = 24


def prompts(n: int = 7) -> list[list[int]]:
    """Prompts of different lengths, each a repeated random motif (so that the n-gram drafter finds drafts)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        motif = torch.randint(0, TINY_VOCAB, (5 + i % 4,), generator=g).tolist()
        out.append((motif * (1 + i % 3))[: 4 + 3 * i])
    return out


RECIPES = {
    "ar": {},
    "ngram": {"drafter": {"kind": "ngram"}, "k": 4},
    "ngram-overlap": {"drafter": {"kind": "ngram"}, "k": 4, "overlap": True},
    "armiss-adaptive": {"drafter": {"kind": "ngram", "min_ngram": 2, "adaptive": True, "ar_after_miss": True},
                        "k": 4, "overlap": True},
    "controller": {"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "cost"}},
    "ragged": {"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "cost", "ragged": True},
               "overlap": True},
    "tree": {"drafter": {"kind": "ngram"}, "k": 2, "verification": "tree",
             "tree": {"kind": "static", "paths": [[0], [0, 0], [1], [1, 0]]}},
}


def engine(tiny, spec: dict, rows: int) -> Engine:
    return Engine(tiny.loaded, parse({"cuda_graphs": False, **spec, "batch": {"max_batch_size": rows,
                                                                                **spec.get("batch", {})}}))


@pytest.fixture(scope="module")
def alone(tiny):
    """Each prompt decoded on its own by AR, stopping at EOS: the first token of the second prompt's continuation
    (that request ends at its first token) and the token whose first occurrences are spread over the most
    positions of the others' (so that requests end at different steps)."""
    ar = Engine(tiny.loaded, parse({"cuda_graphs": False}))
    free = [r.tokens for r in ar.generate(prompts(), N_NEW, ignore_eos=True)]
    spread = max(range(TINY_VOCAB), key=lambda t: len({c.index(t) for c in free if t in c}))
    eos = (free[1][0], spread)
    stop = StopCondition(N_NEW, eos)
    return eos, [ar.decoder.generate([p], stop)[0].tokens for p in prompts()]


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("rows", (1, 3))
def test_each_request_decodes_as_alone(tiny, alone, name, rows):
    eos, want = alone
    eng = engine(tiny, RECIPES[name], rows)
    got = eng.decoder.generate(prompts(), StopCondition(N_NEW, eos), max_batch=rows)
    assert [r.tokens for r in got] == want
    assert len({len(t) for t in want}) > 2 and min(len(t) for t in want) == 1  # ends at different steps
    stats = eng.decoder.last_stats
    assert stats.refills == len(prompts()) - rows  # every request after the first `rows` took a finished row
    # ... with at most `rows` at once: the batch never grew
    assert all(key[1] == rows for key in eng.decoder.captured if key[0] == "step")


def test_engine_generate_batches_continuously_up_to_max_batch_size(tiny):
    free = Engine(tiny.loaded, parse({"cuda_graphs": False})).generate(prompts(), N_NEW, ignore_eos=True)
    eng = engine(tiny, RECIPES["ngram"], 4)
    for max_batch, rows in ((None, 4), (2, 2), (8, 4)):  # the recipe's max_batch_size, or a smaller max_batch
        got = eng.generate(prompts(), N_NEW, ignore_eos=True, max_batch=max_batch)
        assert [r.tokens for r in got] == [r.tokens for r in free]
        assert eng.decoder.last_stats.refills == len(prompts()) - rows


def test_drafter_with_per_row_state_decodes_in_batches(tiny, alone, tiny_draft):
    """A layer-skip draft keeps a KV cache per row: its requests decode in batches of max_batch, in order."""
    eos, want = alone
    eng = Engine(tiny.loaded, parse({"cuda_graphs": False, "drafter": {"kind": "layerskip", "layers": 1}, "k": 3}))
    assert not eng.decoder.continuous
    got = eng.decoder.generate(prompts(), StopCondition(N_NEW, eos), max_batch=3)
    assert [r.tokens for r in got] == want
    stats = eng.decoder.last_stats
    assert stats.refills == 0 and stats.steps > 0
    assert 3 in {key[1] for key in eng.decoder.captured if key[0] == "step"} <= {3, 1}  # 3 + 3 + 1 rows


def test_warmup_covers_the_requests_started_in_a_running_batch(tiny):
    """After warm-up no call at that concurrency prefills or steps a new shape, started requests included."""
    eng = engine(tiny, RECIPES["ngram"], 4)
    ps = prompts()
    eng.warmup([4], max(len(p) for p in ps), N_NEW)
    before = eng.decoder.captures
    eng.generate(ps, N_NEW, ignore_eos=True)
    assert eng.decoder.last_stats.refills == len(ps) - 4
    assert eng.decoder.captures == before, eng.decoder.captured[before:]


def test_bad_max_batch_is_refused(tiny):
    eng = engine(tiny, RECIPES["ar"], 2)
    with pytest.raises(ValueError, match="max_batch"):
        eng.decoder.generate(prompts(), StopCondition(4), max_batch=0)


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "ar"] + ["ar"])
def test_a_draining_batch_moves_to_smaller_ready_buckets_and_keeps_every_token(tiny, alone, name):
    """Once no request waits, a batch whose live rows fit a smaller bucket that has run before (its steps ready)
    moves there, rows and K/V compacted, and every request still decodes what it decodes alone."""
    eos, want = alone
    eng = engine(tiny, RECIPES[name], 4)
    eng.warmup([1, 2, 4], max(len(p) for p in prompts()), N_NEW)  # the smaller buckets' steps (and prices)
    got = eng.decoder.generate(prompts(), StopCondition(N_NEW, eos), max_batch=4)
    assert [r.tokens for r in got] == want
    stats = eng.decoder.last_stats
    assert stats.shrinks >= 1 and stats.refills == len(prompts()) - 4
    assert eng.decoder.batch_rows < 4  # it ended in a smaller bucket


def test_a_batch_does_not_move_to_a_bucket_that_never_ran(tiny, alone):
    """Without a smaller bucket ready (nothing warmed there), the batch keeps its rows: moving would capture, compile
    and price steps in the middle of a timed decode."""
    eos, want = alone
    eng = engine(tiny, RECIPES["controller"], 4)
    got = eng.decoder.generate(prompts(), StopCondition(N_NEW, eos), max_batch=4)
    assert [r.tokens for r in got] == want
    assert eng.decoder.last_stats.shrinks == 0 and eng.decoder.batch_rows == 4


@pytest.mark.parametrize("name", ["ar", "controller"])
def test_occupancy_counts_every_live_row_of_every_step(tiny, name):
    """BatchStats.row_steps (the bench's live_rows_per_step x steps) is the live rows summed over the steps: each row
    of each step that emitted tokens for a request, so exactly the requests' step records together; a mean of at
    most the rows, and below them as requests end at different steps."""
    eng = engine(tiny, RECIPES[name], 3)
    out = eng.generate(prompts(), N_NEW, ignore_eos=False)
    stats = eng.decoder.last_stats
    assert stats.row_steps == sum(len(r.accepted) for r in out)
    assert 0 < stats.row_steps / stats.steps <= 3
