"""The batch-level controller (issue #20 item 4b): before each step the host picks the draft length k' in 0..k with
the most expected tokens per second from the acceptance measured so far and each kind of step's price; whatever it
picks, greedy decoding gives AR's tokens."""
from __future__ import annotations

import pytest

from specpilot.engine.decode import DraftLengthController, choose_draft_length, expected_tokens
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import RecipeError, parse
from test_decoding import TINY_NEW, tiny_prompts, tiny_reference  # noqa: F401 (a fixture)

RISING = {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5, 4: 3.0}  # each draft verified costs half an AR step
FLAT = {k: 1.0 for k in range(5)}  # verification as cheap as an AR step


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 4, 4) == 5


def test_choose_ar_when_verification_costs_more_than_acceptance_pays():
    assert choose_draft_length([0.3] * 4, RISING, 4) == 0
    assert choose_draft_length([0.0] * 4, FLAT, 4) == 0  # nothing accepted: the tie goes to the cheaper AR step


def test_choose_max_when_acceptance_is_high_and_verification_cheap():
    assert choose_draft_length([0.9] * 4, FLAT, 4) == 4
    assert choose_draft_length([0.9] * 4, {0: 1.0, 1: 1.02, 2: 1.04, 3: 1.06, 4: 1.08}, 4) == 4


def test_choose_intermediate_lengths():
    prices = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    # 1.0, 1.9/1.1 = 1.73, 2.35/1.2 = 1.96, 2.44/1.3 = 1.88, 2.449/1.4 = 1.75 tokens per unit time
    assert choose_draft_length([0.9, 0.5, 0.2, 0.1], prices, 4) == 2
    assert choose_draft_length([0.6] * 4, RISING, 4) == 1  # 1.6/1.5 beats AR and every longer draft
    assert choose_draft_length([0.9] * 4, prices, 2) == 2  # never past k_max
    assert choose_draft_length([0.9] * 4, {0: 1.0, 3: 1.1}, 4) == 3  # unpriced lengths are not candidates
    assert choose_draft_length([0.9] * 4, {}, 4) == 4
    with pytest.raises(ValueError):
        choose_draft_length([0.9], {0: 0.0, 1: 1.0}, 1)


def test_controller_learns_from_observed_acceptance():
    c = DraftLengthController(4, probe_every=3)
    assert c.acceptance() == [1.0] * 4 and c.choose(RISING) == 4  # untried: optimistic
    c.observe(4, [0] * 9)  # nine rows rejected the first draft
    assert c.acceptance()[0] == pytest.approx(0.1) and c.acceptance()[1:] == [1.0] * 3
    assert [c.choose(RISING) for _ in range(4)] == [0, 0, 0, 4]  # AR, and after three AR steps a probe at k
    c.observe(4, [4] * 40)  # the probe finds every draft accepted: speculation resumes
    assert c.acceptance()[0] == pytest.approx(41 / 50) and c.choose(RISING) == 4
    c.observe(2, [1] * 100)  # a k'=2 step: position 1 accepted, 2 rejected, 3 and 4 not reached
    a = c.acceptance()
    assert a[0] > 0.9 and a[1] == pytest.approx(41 / 141) and a[2:] == [1.0, 1.0]
    assert c.choose(RISING) == 1
    c.reset()
    assert c.acceptance() == [1.0] * 4 and c.ar_run == 0


def test_recipe_key():
    r = parse({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "cost", "probe_every": 8}})
    assert (r.batch.controller, r.batch.probe_every) == ("cost", 8)
    assert parse({}).batch.controller == "none"
    for bad, key in (({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "fast"}}, "batch.controller"),
                     ({"batch": {"controller": "cost"}}, "batch.controller"),
                     ({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"probe_every": 0}}, "batch.probe_every")):
        with pytest.raises(RecipeError, match=key):
            parse(bad)


def controlled(loaded, prices=None, k=4, **batch) -> Engine:
    eng = Engine(loaded, parse({"drafter": {"kind": "ngram"}, "k": k, "cuda_graphs": False,
                                "batch": {"controller": "cost", **batch}}))
    eng.decoder.prices = prices if prices is not None else {}
    return eng


def step_widths(eng, rows, n):
    widths = []
    hook = eng.decoder.model.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    try:
        out = eng.generate(rows, n, ignore_eos=True)
    finally:
        hook.remove()
    return out, widths[1:]  # after the prefill


def test_switching_draft_length_every_step_is_exact(tiny, tiny_reference, monkeypatch):
    """A controller that cycles k' = 4, 3, 2, 1, 0, 4, ...: every kind of step follows every other, each verifies
    k' + 1 tokens, and the ragged batch's tokens are AR's."""
    eng = controlled(tiny.loaded, {3: FLAT})
    cycle = iter([4, 3, 2, 1, 0] * 100)
    monkeypatch.setattr(eng.decoder.controller, "choose", lambda prices: next(cycle))
    rows, widths = step_widths(eng, tiny_prompts(), TINY_NEW)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    lengths = eng.decoder.last_stats.draft_lengths
    assert lengths[:10] == [4, 3, 2, 1, 0] * 2 and widths == [k + 1 for k in lengths]
    assert eng.decoder.last_stats.ar_steps == lengths.count(0) > 0


def test_cost_controller_switches_and_stays_exact(tiny, tiny_reference):
    """With prices where AR wins once the first draft is accepted less than half the time (k'=1 costs 1.5 AR steps,
    longer drafts more), the n-gram drafter's acceptance on the ragged batch makes the choice flip between steps,
    with probes back to k after two AR steps; the tokens are AR's."""
    eng = controlled(tiny.loaded, {3: RISING}, probe_every=2)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    lengths = eng.decoder.last_stats.draft_lengths
    assert lengths[0] == 4 and 0 in lengths and len(set(lengths)) >= 2, lengths
    assert all(lengths[i:i + 3] != [0, 0, 0] for i in range(len(lengths)))  # never three AR steps in a row


def test_cost_controller_picks_ar_or_k_by_price(tiny, tiny_reference):
    """Verification priced out of reach: every step is AR (even at the optimistic start). As cheap as AR: always k."""
    eng = controlled(tiny.loaded, {3: {0: 1.0, 1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}}, probe_every=1000)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference
    assert eng.decoder.last_stats.draft_lengths == [0] * eng.decoder.last_stats.steps
    eng = controlled(tiny.loaded, {3: {k: 1.0 for k in range(5)}})
    assert [r.tokens for r in eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)] == tiny_reference
    assert set(eng.decoder.last_stats.draft_lengths) == {4}


def test_prices_are_measured_when_not_given(tiny_model_dir):
    from specpilot.engine.loader import load

    eng = controlled(load(str(tiny_model_dir("llama")), "fp32", "cpu"), k=2)
    eng.generate(tiny_prompts(), 6, ignore_eos=True)
    assert set(eng.decoder.prices) == {3} and set(eng.decoder.prices[3]) == {0, 1, 2}
    assert all(p > 0 for p in eng.decoder.prices[3].values())
