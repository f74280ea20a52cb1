"""Continuous batching: with more requests than rows, a row whose request finishes takes the next waiting one, and
every request still decodes the tokens it decodes alone (greedy), whatever the recipe; the bench and the engine
pass the concurrency through."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB
from eagle3_head import write_head
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
    "refill-half": {"drafter": {"kind": "ngram"}, "k": 4, "overlap": True,
                    "batch": {"controller": "cost", "refill_at": 0.5}},
    "tree": {"drafter": {"kind": "ngram"}, "k": 2, "verification": "tree",
             "tree": {"kind": "static", "paths": [[0], [0, 0], [1], [1, 0]]}},
    # a drafter with per-row state that sets a started row up anew (Drafter.refills): an EAGLE-3 head (random, of
    # the family's shape: `head`), whose cache rows and pending pair follow each row's request
    "eagle3": {"drafter": {"kind": "eagle3", "model": "HEAD"}, "k": 3, "overlap": True},
    "eagle3-controller": {"drafter": {"kind": "eagle3", "model": "HEAD"}, "k": 3, "batch": {"controller": "cost"}},
}


@pytest.fixture(scope="module")
def head(tiny, tmp_path_factory):
    """A random EAGLE-3 head for the family (engine() puts its path where a recipe says HEAD)."""
    return write_head(tmp_path_factory.mktemp(f"head-{tiny.family}"), tiny.hf.config, seed=3)


def engine(tiny, spec: dict, rows: int, head=None) -> Engine:
    if spec.get("drafter", {}).get("model") == "HEAD":
        spec = {**spec, "drafter": {**spec["drafter"], "model": str(head)}}
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
def test_each_request_decodes_as_alone(tiny, alone, head, name, rows):
    eos, want = alone
    eng = engine(tiny, RECIPES[name], rows, head)
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
    """A layer-skip draft keeps a KV cache per row and cannot set a row up anew (no `refills`): its requests decode
    in batches of max_batch, in order."""
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
def test_a_draining_batch_moves_to_smaller_ready_buckets_and_keeps_every_token(tiny, alone, head, name):
    """Once no request waits, a batch whose live rows fit a smaller bucket that has run before (its steps ready)
    moves there, rows and K/V compacted (an EAGLE-3 head's rows too), and every request still decodes what it
    decodes alone."""
    eos, want = alone
    eng = engine(tiny, RECIPES[name], 4, head)
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


@pytest.mark.parametrize("name", ["ar", "controller"])
def test_step_log_accounts_for_every_step_and_the_time_between_reads(tiny, name):
    """BatchStats.step_log: one record a step read, its kind the step's, its live rows summing to row_steps, the
    intervals summing to the decode's time but for the last read's sync; the queue is empty from some step on (a
    suffix: requests only start, never arrive), and the steps behind a refill are those right after requests
    started in finished rows (more requests than rows: there are some); its tokens are the requests'. The bench's
    time_budget adds them up."""
    from specpilot.tools.bench.metrics import time_budget

    eng = engine(tiny, RECIPES[name], 3)
    out = eng.generate(prompts(), N_NEW, ignore_eos=False)
    stats = eng.decoder.last_stats
    log = stats.step_log
    # every token but the first tokens of the requests the batch began with (read with their prefill) came with a step
    assert sum(s.tokens for s in log) == sum(len(r.tokens) for r in out) - 3
    assert len(log) == stats.steps
    assert [s.kind for s in log] == stats.draft_lengths[: len(log)]
    assert sum(s.live for s in log) == stats.row_steps
    assert all(s.rows == 3 and 0 <= s.live <= 3 and s.seconds > 0 for s in log)
    assert 0 < sum(s.seconds for s in log) <= stats.decode_s
    empty = [s.queue_empty for s in log]
    assert empty == sorted(empty) and empty[-1] and not empty[0]  # 7 requests in 3 rows: some waited
    assert 0 < sum(s.behind_refill for s in log) <= stats.refills
    # the prefills that started waiting requests: 4 requests waited, prefilled together (REFILL_GROUP) or as rows
    # freed up, each prefill timed, their time inside the decode's
    assert 1 <= stats.refill_prefills <= stats.refills and 0 < stats.refill_prefill_s < stats.decode_s
    budget = time_budget(log, stats.refill_prefills, stats.refill_prefill_s)
    assert (budget["refill_prefills"], budget["refill_prefill_s"]) == (stats.refill_prefills, stats.refill_prefill_s)
    assert budget["refill_steps"] == sum(s.behind_refill for s in log)
    assert budget["drain_steps"] == sum(empty) and budget["drain_s"] <= budget["steps_s"]
    assert 0 < budget["drain_live_rows"] <= 3


def test_time_budget_prices_refills_against_the_typical_step_of_their_kind_and_bucket():
    """refill_extra_s: a refilled step's time beyond the median of the unrefilled steps of its own kind and bucket
    (never another kind's or bucket's); a kind and bucket seen only behind refills adds nothing."""
    from specpilot.engine.decode import StepRecord
    from specpilot.tools.bench.metrics import step_columns, time_budget

    def step(seconds, kind=0, rows=4, live=4, refill=False, empty=False):
        return StepRecord(seconds, kind, rows, live, 2 * live, refill, empty)

    log = [step(1.0), step(1.2), step(1.1), step(2.0, kind=3), step(2.2, kind=3),
           step(1.6, refill=True), step(2.5, kind=3, refill=True), step(9.0, kind=4, refill=True),
           step(0.5, rows=2, live=1, empty=True), step(0.7, rows=2, live=2, empty=True, refill=True)]
    b = time_budget(log)
    assert b["refill_steps"] == 4
    # 1.6 - median(1.0, 1.2, 1.1) + 2.5 - median(2.0, 2.2) + 0.7 - 0.5 (bucket 2's own) + (kind 4: nothing typical)
    assert b["refill_extra_s"] == pytest.approx(0.5 + 0.4 + 0.2)
    assert b["drain_steps"] == 2 and b["drain_s"] == pytest.approx(1.2) and b["drain_live_rows"] == 1.5
    assert b["steps_s"] == pytest.approx(sum(s.seconds for s in log))
    assert b["steady_tokens_per_s"] == pytest.approx(8 * 8 / (1.0 + 1.2 + 1.1 + 2.0 + 2.2 + 1.6 + 2.5 + 9.0))
    assert b["steady_live_rows"] == 4
    assert b["steady_by_kind"] == {"0": {"steps": 3, "ms": pytest.approx(1100.0), "live": 4, "tokens": 8},
                                   "3": {"steps": 2, "ms": pytest.approx(2100.0), "live": 4, "tokens": 8}}
    assert time_budget([]) is None
    cols = step_columns(log)
    assert cols["ms"][:2] == [1000.0, 1200.0] and cols["kind"][3] == 3 and cols["rows"][-1] == 2
    assert cols["refill"] == [0, 0, 0, 0, 0, 1, 1, 1, 0, 1] and cols["drain"] == [0] * 8 + [1, 1]
    assert sum(cols["tokens"]) == sum(s.tokens for s in log) and step_columns([]) is None


def test_refill_at_starts_requests_in_fewer_larger_groups_with_the_same_tokens(tiny, alone):
    """batch.refill_at: waiting requests start once that share of the rows is free (or all of them fit, or no row
    is live), so a batch whose rows end at different steps starts them in fewer groups; every request still decodes
    what it decodes alone, and every request after the first rows still starts in a finished row."""
    eos, _ = alone
    stop, ps = StopCondition(N_NEW, eos), prompts(16)
    ar = Engine(tiny.loaded, parse({"cuda_graphs": False})).decoder
    want = [ar.generate([p], stop)[0].tokens for p in ps]
    groups = {}
    for share in (0.0, 0.5):
        eng = engine(tiny, {"drafter": {"kind": "ngram"}, "k": 4, "batch": {"refill_at": share}}, 4)
        got = eng.decoder.generate(ps, stop, max_batch=4)
        assert [r.tokens for r in got] == want
        stats = eng.decoder.last_stats
        assert stats.refills == len(ps) - 4
        groups[share] = sum(s.behind_refill for s in stats.step_log)
    assert 0 < groups[0.5] < groups[0.0]


def test_refill_at_out_of_range_is_refused():
    from specpilot.engine.errors import SpecPilotError

    with pytest.raises(SpecPilotError, match="batch.refill_at"):
        parse({"batch": {"refill_at": 0.75}})
