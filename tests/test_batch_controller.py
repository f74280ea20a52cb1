"""The batch-level controller (issue #20 item 4b): before each step the host picks the kind of step k' in 0..k (0: a
plain AR step for the whole batch) with the most expected tokens per second, from the acceptance measured so far,
the drafts each row has, and each kind of step's price; whatever it picks, greedy decoding gives AR's tokens."""
from __future__ import annotations

from collections import Counter, deque

import pytest
import torch

from specpilot.engine.batch_controller import (BLIND_AR, CALIBRATION_PRIOR_STEPS, PROBE_BACKOFF, TIME_WINDOW,
                                               DraftLengthController, choose_step, expected_tokens, fraction_kinds,
                                               packed_budget, planned_drafts, step_tokens)
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import RecipeError, parse
from test_decoding import TINY_NEW, tiny_prompts, tiny_reference  # noqa: F401 (a fixture)

RISING = {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5, 4: 3.0}  # each draft verified costs half an AR step
FLAT = {k: 1.0 for k in range(5)}  # verification as cheap as an AR step


def padded(p, k_max=4, found=(4,)):
    return {k: step_tokens(list(found), p, k, False, len(found)) for k in range(k_max + 1)}


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 4, 4) == 5


def test_step_tokens_padded_and_ragged():
    p = [1.0] * 4  # every verified draft accepted: tokens count the drafts each kind verifies
    found = [0, 0, 4, 4]  # two rows without drafts, two with four
    assert step_tokens(found, p, 0, False, 4) == 4  # AR: one token a row
    assert step_tokens(found, p, 1, False, 4) == 4 + 2  # padded k'=1: one draft for each row that has one
    assert step_tokens(found, p, 1, True, 4) == 4 + 4  # ragged k'=1: a budget of 4, all to the two rows with drafts
    assert step_tokens(found, p, 2, True, 4) == 4 + 8 == step_tokens(found, p, 4, False, 4)
    assert step_tokens([4] * 4, p, 1, True, 4) == step_tokens([4] * 4, p, 1, False, 4)  # every row has drafts: same


def test_choose_ar_when_verification_costs_more_than_acceptance_pays():
    assert choose_step(padded([0.3] * 4), RISING) == 0
    assert choose_step(padded([0.0] * 4), FLAT) == 0  # nothing accepted: the tie goes to the cheaper AR step


def test_choose_max_when_acceptance_is_high_and_verification_cheap():
    assert choose_step(padded([0.9] * 4), FLAT) == 4
    assert choose_step(padded([0.9] * 4), {0: 1.0, 1: 1.02, 2: 1.04, 3: 1.06, 4: 1.08}) == 4


def test_choose_intermediate_lengths():
    prices = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    # 1.0, 1.9/1.1 = 1.73, 2.35/1.2 = 1.96, 2.44/1.3 = 1.88, 2.449/1.4 = 1.75 tokens per unit time
    assert choose_step(padded([0.9, 0.5, 0.2, 0.1]), prices) == 2
    assert choose_step(padded([0.6] * 4), RISING) == 1  # 1.6/1.5 beats AR and every longer draft
    assert choose_step(padded([0.9] * 4, k_max=2), prices) == 2  # never past k
    assert choose_step(padded([0.9] * 4), {0: 1.0, 3: 1.1}) == 3  # unpriced kinds are not candidates
    assert choose_step(padded([0.9] * 4), {}) == 4
    assert choose_step(padded([0.9] * 4, found=(1,)), prices) == 1  # a row with one draft: k' > 1 buys nothing
    with pytest.raises(ValueError):
        choose_step(padded([0.9], k_max=1), {0: 0.0, 1: 1.0})


def test_choose_ragged_where_padded_loses():
    """Half the rows have drafts, accepted 60% of the time; each draft slot costs a quarter of an AR step. Padded,
    k'=1 gives 1.3 tokens a row for 1.25 (1.04), AR 1.0, k'=4 1.74 for 2.0: k'=1 barely wins. Ragged at the same
    prices, k'=1 gives the drafting rows two drafts each: 1.48 a row for 1.25, and the controller takes it."""
    prices = {k: 1 + 0.25 * k for k in range(5)}
    found = [0, 4] * 4
    p = [0.6] * 4
    pad = {k: step_tokens(found, p, k, False, 8) for k in range(5)}
    rag = {k: step_tokens(found, p, k, True, 8) for k in range(5)}
    assert choose_step(pad, prices) == 1 and choose_step(rag, prices) == 1
    assert rag[1] / prices[1] > pad[1] / prices[1] * 1.1
    # verification priced out: AR, ragged or not; free: the kind that verifies every draft
    assert choose_step(rag, {0: 1.0, 1: 3.0, 2: 4.0, 3: 5.0, 4: 6.0}) == 0
    assert choose_step(rag, FLAT) == 2  # ragged k'=2 already verifies every found draft; ties go to the cheaper


def uncalibrated(c: DraftLengthController) -> DraftLengthController:
    """The model alone: these tests observe steps without choosing each one first, so nothing pairs a step's
    prediction with its outcome (test_calibration_turns_an_optimistic_model_to_ar pairs them)."""
    c.calibrations = lambda: {None: 1.0}  # (calibration(kind) reads it too)
    return c


def test_controller_learns_from_observed_acceptance():
    c = uncalibrated(DraftLengthController(4, probe_every=3, bucket=10))
    assert c.acceptance() == [1.0] * 4 and c.choose(RISING) == 4  # untried: optimistic
    c.observe([4] * 9, [0] * 9, [4] * 9)  # nine rows rejected their first draft
    assert c.acceptance()[0] == pytest.approx(0.1) and c.acceptance()[1:] == [1.0] * 3
    assert [c.choose(RISING) for _ in range(4)] == [0, 0, 0, 4]  # AR, and after three AR steps a probe at k
    c.observe([4] * 40, [4] * 40, [4] * 40)  # the probe finds every draft accepted: speculation resumes
    assert c.acceptance()[0] == pytest.approx(41 / 50) and c.choose(RISING) == 4
    c.observe([2] * 100, [1] * 100, [4] * 100)  # k'=2: position 1 accepted, 2 rejected, 3 and 4 not reached
    a = c.acceptance()
    assert a[0] > 0.9 and a[1] == pytest.approx(41 / 141) and a[2:] == [1.0, 1.0]
    assert c.choose(RISING) == 1
    c.observe([0] * 3, [0] * 3, [0] * 3)  # an AR step: nothing verified, and no row has drafts now
    assert c.acceptance() == a and c.choose(RISING) == 0
    c.reset()
    assert c.acceptance() == [1.0] * 4 and c.short_run == 0 and c.found is None


def test_calibration_turns_an_optimistic_model_to_ar():
    """Each row finds 4 drafts, but its adaptive budget lets it verify only one, always accepted: positions 2..4 are
    never reached, so the model keeps them at their optimistic prior and expects 5 tokens a row from k' = 4, where
    every step gives 2. Priced at 3 AR steps, k' = 4 wins by the model (5 / 3 > 1) and loses in fact (2 / 3 < 1).
    Paired with each step's outcome (as the decoder reads them, in order), the calibration learns the gain is a
    quarter of the model's and the batch turns to AR, probing every `probe_every` steps; the model alone never does."""
    prices = {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5, 4: 3.0}
    rows = 4

    def run(c: DraftLengthController, steps: int) -> list[int]:
        chosen = []
        for _ in range(steps):
            kind = c.choose(prices)
            chosen.append(kind)
            verified = [min(1, kind)] * rows  # a budget of one draft a row
            c.observe(verified, verified, [4] * rows)  # each verified draft accepted
        return chosen

    assert set(run(uncalibrated(DraftLengthController(4, probe_every=4, bucket=rows)), 40)) == {4}
    c = DraftLengthController(4, probe_every=4, bucket=rows)
    chosen = run(c, 120)
    assert c.calibration() < 0.4  # a quarter, pulled up by its prior (CALIBRATION_PRIOR_STEPS steps at 1)
    tail = chosen[10:]
    assert tail.count(0) >= 0.9 * len(tail) and 4 in tail[-40:]  # AR, with probes that keep measuring


def test_probes_back_off_while_speculation_stays_hopeless_and_return_when_it_pays():
    """Rows whose drafts are never accepted: after each probe the model still picks AR, so the steps between probes
    double (4, 8, 16, then PROBE_BACKOFF x probe_every); once a probe finds drafts accepted, the model verifies
    again, and the probes start over at `probe_every`. Each step is read one step late, as under overlap."""
    c, unread = DraftLengthController(4, probe_every=4, bucket=2), deque()
    prices = {BLIND_AR: 0.95, 0: 1.0, 1: 1.6, 2: 1.7, 3: 1.8, 4: 1.9}

    def run(steps: int, accept: bool) -> list[int]:
        chosen = []
        for _ in range(steps):
            kind = c.choose(prices)
            chosen.append(kind)
            unread.append(kind)
            if len(unread) > 1:
                done = max(unread.popleft(), 0)
                c.observe([done] * 2, [done if accept else 0] * 2, [4] * 2)
        return chosen

    def gaps(chosen: list[int]) -> list[int]:
        at = [i for i, kind in enumerate(chosen) if kind == 4]
        return [b - a - 1 for a, b in zip(at, at[1:])]

    hopeless = run(200, accept=False)
    assert gaps(hopeless)[:7] == [0, 4, 8, 16, 32, 32, 32]  # (0: the untried prior's second step of k)
    assert hopeless.count(4) <= 10 and set(hopeless) <= {4, BLIND_AR}
    assert c.probe_gap == PROBE_BACKOFF * c.probe_every
    paying = run(150, accept=True)  # a few probes that accept every draft outweigh the batch's rejections
    assert paying[-50:].count(4) == 50 and c.probe_gap == c.probe_every


def test_the_probe_after_ar_steps_verifies_ar_probe_kind_drafts_when_set(monkeypatch):
    """SPECPILOT_AR_PROBE_KIND (AR_PROBE_KIND, an A/B setting): the probe after a run of AR steps verifies that many
    drafts a row instead of k, the cheapest sample of the first draft's acceptance; unset (0), k as before."""
    import specpilot.engine.batch_controller as bc

    prices = {BLIND_AR: 0.95, 0: 1.0, 1: 1.6, 2: 1.7, 3: 1.8, 4: 1.9}

    def probes(kind_setting: int) -> set:
        monkeypatch.setattr(bc, "AR_PROBE_KIND", kind_setting)
        c, chosen = DraftLengthController(4, probe_every=4, bucket=2), []
        for _ in range(60):  # drafts never accepted: AR, and a probe now and then
            kind = c.choose(prices)
            chosen.append(kind)
            c.observe([max(kind, 0)] * 2, [0] * 2, [4] * 2)
        after_ar = {b for a, b in zip(chosen, chosen[1:]) if a == BLIND_AR and b != BLIND_AR}
        assert after_ar and chosen.count(BLIND_AR) > 40
        return after_ar

    assert probes(0) == {4} and probes(1) == {1} and probes(9) == {4}  # (past k: k)


def test_a_probe_at_a_tie_backs_off_unless_it_beats_ar_by_the_margin():
    """Every verifying step accepts exactly one draft a row: a probe of k yields 4 tokens for 1.9 AR steps' time,
    2.1 a unit against AR's 2.0, which the model never runs at a 10% margin (nor k' = 1 at 1.85). Judged with that
    margin the probes do not pay and back off to PROBE_BACKOFF x probe_every; at margin 0 verifying does pay (k' = 1,
    2.16 a unit), and the model verifies on every step."""
    prices = {BLIND_AR: 0.95, 0: 1.0, 1: 1.85, 2: 1.87, 3: 1.88, 4: 1.9}

    def run(margin: float) -> tuple[list[int], DraftLengthController]:
        c, unread, chosen = DraftLengthController(4, probe_every=4, bucket=2, margin=margin), deque(), []
        for _ in range(300):
            kind = c.choose(prices)
            chosen.append(kind)
            unread.append(kind)
            if len(unread) > 1:
                done = max(unread.popleft(), 0)
                c.observe([done] * 2, [min(done, 1)] * 2, [4] * 2)
        return chosen, c

    chosen, c = run(0.10)
    at = [i for i, kind in enumerate(chosen) if kind > 0]
    assert c.probe_gap == PROBE_BACKOFF * c.probe_every and set(chosen[20:]) <= {4, BLIND_AR}
    assert [b - a - 1 for a, b in zip(at, at[1:])][-3:] == [PROBE_BACKOFF * 4] * 3 and len(at) <= 20
    chosen, c = run(0.0)
    assert min(chosen[-100:]) >= 1  # no margin: verifying pays, and the model does it


def test_a_drafter_that_always_has_k_drafts_never_searches_on_ar_steps():
    """Acceptance where AR wins at these prices but k drafts for every row would not be hopeless: an n-gram-like
    drafter (whose search says which rows have drafts) runs AR steps that search; a head (`fixed_drafts`: its search
    would report k for every row, which the controller knows) runs them blind."""
    prices = {BLIND_AR: 0.95, 0: 1.0, 1: 1.5, 2: 1.6, 3: 1.7, 4: 1.8}
    for fixed, ar_kind in ((False, 0), (True, BLIND_AR)):
        c = uncalibrated(DraftLengthController(4, probe_every=1000, bucket=4, fixed_drafts=fixed))
        c.observe([4] * 40, [4] * 20 + [0] * 20, [1, 1, 0, 0])  # p1 ~ 0.5, then all; two rows have one draft
        assert not c.hopeless({k: v for k, v in prices.items() if k >= 0})
        assert {c.choose(prices) for _ in range(5)} == {ar_kind}


# The packaged head's chain of 3 under the controller at chat B = 4 on the H100 (thirty-first lease, A, ead20fd):
# each kind's replayed price and the loop's times of the kinds it ran (ms), and the share of rows that accepted at
# least 1, 2, 3 drafts
H100_HEAD_CHAT_B4 = dict(replayed={BLIND_AR: 0.5525, 0: 0.6315, 1: 0.9972, 2: 1.0577, 3: 1.0766},
                         loop={BLIND_AR: 0.6357, 3: 1.1962}, reached=[0.526, 0.247, 0.116])


def test_a_head_weighs_verification_against_its_blind_ar_step():
    """A head's AR step skips its search (`fixed_drafts`), so the controller weighs verification against the blind
    step's price. On the H100's figures for the packaged head at chat B = 4, k' = 3 (7.6 tokens in 1.196 ms) beats
    the AR step that searches (priced from its replay, 0.72 ms with the 5% margin) and loses to the blind one the head
    runs (0.636 ms): priced as the former, the head verified 3 drafts on 210 of 211 steady steps there and ran 0.92x
    our fastest AR."""
    data = H100_HEAD_CHAT_B4
    rows, (a1, a2, a3) = 4, [round(1000 * r) for r in data["reached"]]  # rows of 1,000 that accepted >= 1, 2, 3

    def measured(fixed: bool) -> DraftLengthController:
        c = DraftLengthController(3, probe_every=1000, bucket=rows, fixed_drafts=fixed)
        c.observe([3] * 1000, [0] * (1000 - a1) + [1] * (a1 - a2) + [2] * (a2 - a3) + [3] * a3, [3] * rows)
        for kind, ms in data["loop"].items():
            for _ in range(TIME_WINDOW):
                c.observe_time(kind, ms / 1e3)
        return c

    replayed = {kind: ms / 1e3 for kind, ms in data["replayed"].items()}
    head, searching = measured(True), measured(False)
    assert head.acceptance() == pytest.approx([0.526, 0.247 / 0.526, 0.116 / 0.247], abs=0.01)
    assert head.choose(replayed) == BLIND_AR
    assert searching.choose(replayed) == 3  # a drafter whose AR steps search pays the searching price


def test_a_verifying_step_must_beat_ar_by_the_margin():
    """Two rows with drafts accepted 30% of the time: k' = 1 yields 2.6 tokens to AR's 2 for 1.25 of its price,
    1.04 times AR's rate: taken without a margin, not with the default 5% one, taken again when cheaper."""
    tokens = {k: step_tokens([4, 4], [0.3] * 4, k, False, 2) for k in range(2)}
    assert choose_step(tokens, {0: 1.0, 1: 1.25}) == 1
    assert choose_step(tokens, {0: 1.0, 1: 1.25}, margin=0.05) == 0
    assert choose_step(tokens, {0: 1.0, 1: 1.2}, margin=0.05) == 1


def test_each_kind_is_calibrated_by_its_own_steps():
    """Every verified draft is accepted, but steps of k' = 4 keep one a row (their requests end inside them, say):
    k' = 1 gains what the model says, k' = 4 a quarter of it. Each kind's ratio follows its own steps (the prior pulls
    it toward the batch's), and a kind never run takes the batch's ratio."""
    c = DraftLengthController(4, bucket=4)
    for kind in (1, 4):
        for _ in range(50):
            c.predictions.append((kind, c.allocation([4] * 4, kind), None))  # (as `choose` leaves it)
            c.observe([kind] * 4, [kind] * 4, [4] * 4, kept=[1] * 4)
    assert c.acceptance() == pytest.approx([1.0] * 4, abs=0.01)
    gains = c.predicted_gains()
    assert gains[1] == pytest.approx(200) and gains[4] == pytest.approx(800, rel=0.01)
    prior = CALIBRATION_PRIOR_STEPS * 4
    overall = (400 + prior) / (1000 + prior)  # gained over the model's gain, all verifying steps, with the prior
    assert c.calibration() == pytest.approx(overall, rel=0.01)
    assert c.calibration(1) == pytest.approx(1.0, abs=0.05)
    assert c.calibration(4) == pytest.approx(0.25, abs=0.01)
    assert c.calibration(2) == pytest.approx(c.calibration())


def test_drafts_past_a_requests_end_do_not_count_as_gained():
    """Rows whose requests end inside the step keep fewer of their accepted drafts: the calibration counts those."""
    c = DraftLengthController(4, bucket=4)
    for _ in range(100):
        c.predictions.append((4, c.allocation([4] * 4, 4), None))
        c.observe([4] * 4, [4] * 4, [4] * 4, kept=[1] * 4)  # every draft accepted, one of four kept
    assert c.acceptance() == pytest.approx([1.0] * 4, abs=0.01)  # acceptance itself is what the target did
    assert c.calibration(4) == pytest.approx(0.25, abs=0.01)


def test_shorter_steps_are_followed_by_a_probe_one_draft_longer():
    """Where the model prefers k' = 2 (k' = 3 and 4 priced far above it), every `probe_every` steps below k the next
    verifies one draft more: only a step of a kind measures what it gains, and a kind priced low by a few unlucky
    steps is measured again, at the price of one more draft, not of k (after AR steps the probe is k)."""
    c = uncalibrated(DraftLengthController(4, probe_every=3, bucket=2))
    prices = {0: 1.0, 1: 1.1, 2: 1.2, 3: 5.0, 4: 6.0}
    assert [c.choose(prices) for _ in range(8)] == [2, 2, 2, 3, 2, 2, 2, 3]
    c.observe([0, 0], [0, 0], [0, 0])  # no row has drafts now: AR steps, then a probe of k
    assert [c.choose(prices) for _ in range(4)] == [0, 0, 0, 4]


# The loop's step prices (ms) of the 8B target with a replayed head on the H200 by kind (AR without search, k' = 0..4),
# at B = 2, 16 and 64 (twenty-eighth lease, A: `replay-ranks-cost`'s step_prices_ms)
H200_8B_PRICES = {2: {-1: 4.81, 0: 5.78, 1: 5.84, 2: 5.89, 3: 5.88, 4: 5.91},
                  16: {-1: 5.10, 0: 6.13, 1: 6.30, 2: 6.54, 3: 6.57, 4: 6.68},
                  64: {-1: 6.46, 0: 7.84, 1: 8.37, 2: 9.39, 3: 10.24, 4: 11.67}}
HEAD_CHAIN = [0.565, 0.330, 0.191, 0.130]  # the packaged head's measured chain (twenty-seventh lease, A)


def simulate(batch: int, seed: int, fixed: int | None = None, steps: int = 60):
    """A batch whose rows accept like the head at the H200's 8B prices, each step read one step late (overlap), its
    kind chosen by the controller or `fixed`: (the controller, the kinds run, tokens a millisecond)."""
    import random

    prices, rng = H200_8B_PRICES[batch], random.Random(seed)
    keep = [HEAD_CHAIN[0]] + [HEAD_CHAIN[i] / HEAD_CHAIN[i - 1] for i in range(1, 4)]  # once the parent held
    c, unread, chosen, tokens, ms = DraftLengthController(4, bucket=batch), deque(), [], 0, 0.0
    for _ in range(steps):
        kind = c.choose(prices) if fixed is None else fixed
        chosen.append(kind)
        accepted = []
        for _ in range(batch):
            n = 0
            while n < max(kind, 0) and rng.random() < keep[n]:
                n += 1
            accepted.append(n)
        tokens, ms = tokens + batch + sum(accepted), ms + prices[kind]
        unread.append(([max(kind, 0)] * batch, accepted))
        if len(unread) > 1:
            c.observe(*unread.popleft(), [4] * batch)
    return c, chosen, tokens / ms


def test_a_batchs_first_steps_do_not_price_a_kind_for_good():
    """The H200's step prices at 8B, B = 16 (twenty-eighth lease: AR 5.10 ms, a searching step 6.13, verifying 1-4
    drafts 6.30-6.68) and rows accepting like the packaged head (its measured chain: 0.565, 0.33, 0.19, 0.13; each
    step read one step late, as with overlap). The batch's first steps are chosen under the optimistic prior (every
    draft accepted); priced by what was expected then, k' = 4 gained a quarter of its prediction and kept that ratio,
    and the batch settled on k' = 3 for good (on the H200: 63 of 68 steps, 1.37x where the fixed k = 4 made 1.38x;
    at B = 64 AR, 0.97x). Priced by the acceptance measured when each is read, k' = 4, the fastest, is chosen."""
    c, chosen, _ = simulate(16, seed=0, steps=120)
    tail = chosen[20:]
    assert tail.count(4) >= 0.9 * len(tail), Counter(tail)
    # the model is right about these rows, so its ratio stays near 1 for the kind it runs
    assert c.calibration(4) == pytest.approx(1.0, abs=0.15)


def test_the_decoder_counts_what_each_row_kept(tiny):
    """Requests of 7 new tokens decoded verifying 4 drafts a step: each step the controller observes is credited with
    the drafts its rows kept, so one token a row-step plus those kept is every token after each request's first
    (the prefill's), none past a request's end."""
    eng = controlled(tiny.loaded, {2: {k: 1.0 for k in range(5)}})  # every kind at one price: k' = 4 wins
    seen = []
    observe = eng.decoder.controller.observe
    eng.decoder.controller.observe = lambda v, a, f, kept=None: (seen.append((a, kept)), observe(v, a, f, kept))
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    out = eng.generate(prompts, 7, ignore_eos=True)
    assert all(len(r.tokens) == 7 for r in out)
    assert sum(k + 1 for _, kept in seen for k in kept) == sum(len(r.tokens) - 1 for r in out)
    assert all(k <= a for accepted, kept in seen for a, k in zip(accepted, kept))


def test_recipe_key():
    r = parse({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "cost", "probe_every": 8, "margin": 0}})
    assert (r.batch.controller, r.batch.probe_every, r.batch.margin) == ("cost", 8, 0.0)
    assert parse({}).batch.controller == "none" and parse({}).batch.margin == 0.05
    for bad, key in (({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "fast"}}, "batch.controller"),
                     ({"batch": {"controller": "cost"}}, "batch.controller"),
                     ({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"probe_every": 0}}, "batch.probe_every"),
                     ({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"margin": -0.1}}, "batch.margin"),
                     ({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"margin": "high"}}, "batch.margin")):
        with pytest.raises(RecipeError, match=key):
            parse(bad)


def test_the_recipes_margin_reaches_the_controller(tiny):
    assert controlled(tiny.loaded, margin=0.2).decoder.controller.margin == 0.2
    assert controlled(tiny.loaded).decoder.controller.margin == 0.05


def controlled(loaded, prices=None, k=4, loop_times=False, overlap=False, **batch) -> Engine:
    """An n-gram engine with the cost controller at these step prices; without `loop_times` the controller keeps
    them as given (the CPU's own step times do not enter its choices)."""
    eng = Engine(loaded, parse({"drafter": {"kind": "ngram"}, "k": k, "cuda_graphs": False, "overlap": overlap,
                                "batch": {"controller": "cost", **batch}}))
    eng.decoder.prices = prices if prices is not None else {}
    if not loop_times:
        eng.decoder.controller.observe_time = lambda kind, seconds: None
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
    with probes back to k after two AR steps (more after probes that did not pay: at most PROBE_BACKOFF x 2); the
    tokens are AR's."""
    eng = controlled(tiny.loaded, {3: RISING}, probe_every=2)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    lengths = eng.decoder.last_stats.draft_lengths
    assert lengths[0] == 4 and 0 in lengths and len(set(lengths)) >= 2, lengths
    runs = "".join("a" if n == 0 else "v" for n in lengths).split("v")
    assert max(map(len, runs)) <= PROBE_BACKOFF * 2 and lengths.count(4) >= 2, lengths  # AR runs end in probes


def test_cost_controller_picks_ar_or_k_by_price(tiny, tiny_reference):
    """Verification priced out of reach: every step is AR (even at the optimistic start). As cheap as AR: always k."""
    eng = controlled(tiny.loaded, {3: {0: 1.0, 1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}}, probe_every=1000)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference
    assert eng.decoder.last_stats.draft_lengths == [0] * eng.decoder.last_stats.steps
    # As cheap as AR: each step verifies every draft the rows had at the step before (ties go to the shorter step,
    # so a step verifies fewer only when no row has more). The model alone: no margin over AR, no calibration
    eng = controlled(tiny.loaded, {3: {k: 1.0 for k in range(5)}})
    uncalibrated(eng.decoder.controller).margin = 0.0
    found = []
    real = eng.decoder.controller.observe
    eng.decoder.controller.observe = lambda v, a, f, kept=None: found.append(max(f, default=0)) or real(v, a, f, kept)
    assert [r.tokens for r in eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)] == tiny_reference
    lengths = eng.decoder.last_stats.draft_lengths
    assert lengths[0] == 4 and lengths[1:] == [min(f, 4) for f in found[:len(lengths) - 1]] and 4 in lengths[1:]


def test_prices_are_measured_when_not_given(tiny_model_dir):
    from specpilot.engine.loader import load

    eng = controlled(load(str(tiny_model_dir("llama")), "fp32", "cpu"), k=2)
    eng.generate(tiny_prompts(), 6, ignore_eos=True)
    assert set(eng.decoder.prices) == {3} and set(eng.decoder.prices[3]) == {BLIND_AR, 0, 1, 2}
    assert all(p > 0 for p in eng.decoder.prices[3].values())


def test_prices_are_timed_warm_and_in_turns(tiny_model_dir):
    """Every kind is replayed untimed first, then the kinds are timed in turns, and a kind's price is its median
    round: a GPU that speeds up during the measurement (clocks rising) biases no kind, and one slow round none."""
    from specpilot.engine import decode
    from specpilot.engine.loader import load

    eng = controlled(load(str(tiny_model_dir("llama")), "fp32", "cpu"), k=2)
    calls, clock = [], iter(range(1000, 0, -1))  # every replay a little faster than the one before

    def timed(st, kind, replays, ahead=0):
        calls.append((kind, replays))
        return 10.0 if len(calls) == 20 else next(clock) / 1000  # one slow round

    eng.decoder._time_step = timed
    eng.generate(tiny_prompts(), 4, ignore_eos=True)
    kinds = [2, 1, 0, BLIND_AR]
    warm = [(kind, decode.PRICE_WARM_REPLAYS) for kind in kinds]
    assert calls == warm + [(kind, decode.PRICE_REPLAYS) for kind in kinds] * decode.PRICE_ROUNDS
    prices = eng.decoder.prices[3]
    assert prices[2] < 1.0 and all(p < 1.0 for p in prices.values())  # the slow round left out
    # the kinds' prices differ by one replay's speed-up a turn at most: time order did not rank them
    assert max(prices.values()) - min(prices.values()) <= 0.004


def test_prices_are_timed_at_the_middle_of_what_the_loop_decodes(tiny, tiny_reference, monkeypatch):
    """Warm-up prices each kind with every row past its length by half the longest prompt and half the new tokens
    (a step's attention on the fused layer grows with its context: priced at the warm-up's one-token prompts, the
    loop's fused steps took up to 1.43x their price on the H100), as far as the cache has room; a call that prices
    a bucket itself, half its new tokens past the prompts. Afterwards the state is as before: the next call decodes
    AR's tokens."""
    eng = controlled(tiny.loaded, k=2)
    dec, timing, seen = eng.decoder, [], []
    time_step, step = dec._time_step, dec._step

    def timed(st, kind, replays, ahead=0):
        timing.append((st.lengths.clone(), ahead))
        try:
            return time_step(st, kind, replays, ahead)
        finally:
            timing[-1] = None

    def spied(st, sampling, drafts_k=None):
        if timing and timing[-1] is not None:
            seen.append((timing[-1][0].tolist(), timing[-1][1], st.lengths.tolist()))
        return step(st, sampling, drafts_k)

    dec._time_step, dec._step = timed, spied
    dec.warmup([3], max_prompt_tokens=10, max_new_tokens=30)
    assert seen and all(ahead == (10 + 30) // 2 for _, ahead, _ in seen)
    assert all(during == [n + ahead for n in before] for before, ahead, during in seen)
    seen.clear()
    dec.prices.clear()
    out = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in out] == tiny_reference
    assert seen and all(ahead == TINY_NEW // 2 and during == [n + ahead for n in before]
                        for before, ahead, during in seen)
    # near the cache's end a row is timed as far as two steps more fit
    st = dec._state
    room = st.history.shape[1] - 2 * dec.verify_width - 1
    seen.clear()
    dec._time_step(st, 2, 1, ahead=10 * st.history.shape[1])
    assert seen[0][2] == [max(room, n) for n in seen[0][0]]
    # SPECPILOT_PRICE_AHEAD=0: at the rows' lengths as they are
    from specpilot.engine import decode

    monkeypatch.setattr(decode, "PRICE_AHEAD", False)
    seen.clear()
    dec.prices.clear()
    eng.generate(tiny_prompts(), 4, ignore_eos=True)
    assert seen and all(during == before for before, _, during in seen)


def test_loop_times_correct_the_replayed_prices():
    """Replays say a k = 4 step costs 1.2 AR steps; the loop measures AR steps at their replay and k = 4 steps at
    twice AR. With each draft accepted about half the time, verifying three or four wins by the replays and four
    loses by the loop; k' = 1..3, not timed, are priced at their replays times the loop/replay ratio interpolated
    between the timed kinds, and k' = 1 wins."""
    replay = {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15, 4: 1.2}
    c = DraftLengthController(4, probe_every=1000, bucket=16)
    accepted = [0] * 9 + [1] * 4 + [2] * 2 + [3]  # 16 rows verified 4 drafts: p_i close to 1/2 each
    c.observe([4] * 16, accepted, [4] * 16)
    assert c.priced(replay) == replay and c.choose(replay) >= 3  # by the replays: the longest steps
    for _ in range(40):
        c.observe_time(0, 1.0)
        c.observe_time(4, 2.0)
    priced = c.priced(replay)
    assert priced[0] == pytest.approx(1.0) and priced[4] == pytest.approx(2.0)
    assert priced[2] == pytest.approx(1.1 * (1 + (2.0 / 1.2 - 1) / 2))
    tokens = c.expected()
    assert tokens[4] / priced[4] < tokens[0] / priced[0] < tokens[1] / priced[1]
    assert c.choose(replay) == 1
    c.observe_time(4, 1.0)  # the median of the latest TIME_WINDOW: one fast step does not move it
    assert c.priced(replay)[4] == pytest.approx(2.0)
    for _ in range(TIME_WINDOW // 2 + 1):
        c.observe_time(4, 1.0)  # most of the window: now it does
    assert c.priced(replay)[4] == pytest.approx(1.0)
    assert DraftLengthController(4).priced(replay) == replay  # nothing timed: the replays
    shared = {}
    c.reset(1, shared)
    c.observe_time(2, 0.5)
    assert shared == {2: 0.5}  # the decoder's per-bucket record, carried to the next call


def test_a_kind_timed_a_few_times_is_priced_like_its_neighbours():
    """A kind's price is the median of its latest loop times (one slow step, a refill or the host's garbage
    collection, does not move it); a kind timed fewer than MIN_TIMED_STEPS times (a probe, once) is priced from the
    kinds timed around it."""
    from specpilot.engine.batch_controller import MIN_TIMED_STEPS

    replay = {0: 1.0, 1: 1.1, 2: 1.2}
    c = DraftLengthController(2, bucket=4)
    for seconds in (1.5, 9.0, 1.5, 1.5):
        c.observe_time(0, seconds)
    assert c.seconds[0] == pytest.approx(1.5)  # the median: the 9.0 outlier does not count
    for _ in range(MIN_TIMED_STEPS - 1):
        c.observe_time(2, 6.0)  # a kind timed too few times: five times its replay, noise
    assert c.priced(replay)[2] == pytest.approx(1.2 * 1.5)  # priced like AR, the timed kind: x1.5
    c.observe_time(2, 6.0)
    assert c.priced(replay)[2] == pytest.approx(6.0)  # now its own


# The H100's replayed step prices at chat B = 8 with the fused layer up to 32 tokens (forty-second lease, ms), and
# what the loop timed: k' = 1 and 3 run, k' = 2 timed in the same cell at the limit of 24 (ratio 1.18)
H100_B8_REPLAY = {-1: 0.734, 1: 0.817, 2: 0.936, 3: 0.964}
H100_B8_LOOP = {1: 1.10, 2: 1.10, 3: 1.249}


def test_a_settled_kind_has_the_kind_below_it_timed_when_that_ones_price_is_a_guess():
    """Rows accepting the first draft 55% of the time, the second 50%, the third 42% (1.83 tokens a row at k' = 2,
    1.94 at 3). The loop has timed k' = 1 and 3; k' = 2's price is its replay scaled between theirs (x1.32: 1.24 ms),
    where k' = 3 wins; at what the loop times it (1.10 ms) k' = 2 wins. After `probe_every` steps of k' = 3 the
    controller runs k' = 2 until it is timed MIN_TIMED_STEPS times, and then chooses it. Before any kind is timed, or
    once the kind below is, nothing is probed: the replays price every kind alike, or the kind below is its own."""
    from specpilot.engine import batch_controller as bc

    def controller():
        c = uncalibrated(DraftLengthController(3, probe_every=4, bucket=8, fixed_drafts=True))
        # 1000 rows: 450 rejected the first draft, 275 the second, 160 the third, 115 accepted all three
        c.observe([3] * 1000, [0] * 450 + [1] * 275 + [2] * 160 + [3] * 115, [3] * 8)
        return c

    c = controller()
    assert [c.choose(H100_B8_REPLAY) for _ in range(6)] == [3] * 6  # nothing timed: no probe below
    c = controller()
    for kind in (1, 3):
        for _ in range(bc.MIN_TIMED_STEPS):
            c.observe_time(kind, H100_B8_LOOP[kind])
    assert c.priced(H100_B8_REPLAY)[2] == pytest.approx(0.936 * (1.10 / 0.817 + 1.249 / 0.964) / 2)
    chosen = []
    for _ in range(5 + bc.MIN_TIMED_STEPS + 3):
        kind = c.choose(H100_B8_REPLAY)
        chosen.append(kind)
        c.observe_time(kind, H100_B8_LOOP[kind])
    # four steps of k' = 3 settle it (the first sets `latest`), then k' = 2 until timed, then k' = 2 by its own price
    assert chosen == [3] * 5 + [2] * bc.MIN_TIMED_STEPS + [2] * 3
    # a kind below that the prices no longer list (a bucket without it) is not run
    c = controller()
    for kind in (1, 3):
        for _ in range(bc.MIN_TIMED_STEPS):
            c.observe_time(kind, H100_B8_LOOP[kind])
    assert [c.choose(H100_B8_REPLAY) for _ in range(6)] == [3] * 5 + [2]
    without = {kind: ms for kind, ms in H100_B8_REPLAY.items() if kind != 2}
    assert [c.choose(without) for _ in range(3)] == [3] * 3
    # off (SPECPILOT_PROBE_DOWN=0): k' = 3 for good
    c = controller()
    for kind in (1, 3):
        for _ in range(bc.MIN_TIMED_STEPS):
            c.observe_time(kind, H100_B8_LOOP[kind])
    old, bc.PROBE_DOWN = bc.PROBE_DOWN, False
    try:
        assert [c.choose(H100_B8_REPLAY) for _ in range(12)] == [3] * 12
    finally:
        bc.PROBE_DOWN = old


def test_the_decoder_feeds_loop_times_to_the_controller(tiny_model_dir):
    from specpilot.engine.loader import load

    eng = controlled(load(str(tiny_model_dir("llama")), "fp32", "cpu"), k=2, loop_times=True)
    eng.generate(tiny_prompts(), 8, ignore_eos=True)
    times = eng.decoder.step_seconds[3]
    # the kinds timed are those the steps ran (which, on real timings, vary: a blind AR step too)
    ran = set(eng.decoder.last_stats.draft_lengths)
    assert times and set(times) <= ran <= {BLIND_AR, 0, 1, 2} and all(t > 0 for t in times.values())
    assert eng.decoder.controller.seconds is times


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_behind_a_refill_are_not_timed(tiny_model_dir, overlap):
    """Requests started in a running batch are prefilled between two steps; the step launched behind them waits for
    that too, and with overlap so does the step in flight (its read comes after the host started them), which no
    kind of step costs by itself: their loop times are not fed to the controller. Here each prefill sleeps 0.2 s
    (far above a step of the tiny model), and no time the controller saw holds one."""
    import time as time_module

    from specpilot.engine.loader import load

    eng = controlled(load(str(tiny_model_dir("llama")), "fp32", "cpu"), k=2, loop_times=True, overlap=overlap,
                     max_batch_size=2)
    prefill, prefills = eng.decoder._prefill_requests, []

    def slow_prefill(*args, **kwargs):
        prefills.append(1)
        time_module.sleep(0.2)
        return prefill(*args, **kwargs)

    eng.decoder._prefill_requests = slow_prefill
    seen = []
    observe_time = eng.decoder.controller.observe_time
    eng.decoder.controller.observe_time = lambda kind, seconds: (seen.append(seconds), observe_time(kind, seconds))
    out = eng.generate(tiny_prompts() * 2, 6, ignore_eos=True, max_batch=2)
    assert all(len(r.tokens) == 6 for r in out) and len(prefills) >= 2  # refills, two requests each
    assert seen and max(seen) < 0.1


def test_blind_ar_when_no_draft_could_pay():
    """An AR step searches for drafts (the controller must see when they come back) unless even k drafts for every
    live row would lose to AR at the measured acceptance: then it skips the search too (BLIND_AR), until a probe."""
    prices = {-1: 0.9, 0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2}
    c = DraftLengthController(4, probe_every=3, bucket=4)
    c.observe([4] * 4, [4] * 4, [0] * 4)  # every draft accepted, and now no row has drafts
    assert c.choose(prices) == 0  # drafts would pay were they found: keep searching
    c.observe([4] * 40, [0] * 40, [4] * 40)  # drafts everywhere, all rejected: p_1 = 1/45
    assert c.hopeless({k: v for k, v in prices.items() if k >= 0})
    assert [c.choose(prices) for _ in range(3)] == [BLIND_AR, BLIND_AR, 4]  # three AR steps in a row, then a probe
    assert DraftLengthController(4, bucket=4).choose({0: 1.0, 4: 2.2}) in (0, 4)  # no blind price: never blind


def test_blind_ar_steps_decode_ar_tokens(tiny, tiny_reference):
    """Verification priced out of reach, a blind AR step cheaper than a searching one: the batch runs blind AR steps
    (probes aside) with the tokens of AR, and no drafter search runs in them."""
    prices = {-1: 0.5, 0: 1.0, 1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}
    eng = controlled(tiny.loaded, {3: prices}, probe_every=8)
    searches = []
    real = eng.decoder.drafter.propose
    eng.decoder.drafter.propose = lambda *a, **kw: searches.append(1) or real(*a, **kw)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    lengths = eng.decoder.last_stats.draft_lengths
    assert set(lengths) <= {BLIND_AR, 0, 4} and lengths.count(BLIND_AR) > len(lengths) // 2, lengths
    assert len(searches) == len(lengths) - lengths.count(BLIND_AR)
    assert eng.decoder.last_stats.ar_steps == lengths.count(BLIND_AR) + lengths.count(0)


def test_timing_a_step_never_writes_past_the_cache(tiny_model_dir):
    """Replaying a step more times than a row has free cache slots (each replay appends at least one token) would
    write past the cache (on the H200, 20 replays of k = 16 hit a device-side assert in the KV write); each replay
    starts from the row's real length, and the lengths are as before afterwards."""
    from specpilot.engine.loader import load

    eng = Engine(load(str(tiny_model_dir("llama")), "fp32", "cpu"),
                 parse({"drafter": {"kind": "ngram"}, "k": 8, "cuda_graphs": False}))
    eng.generate(tiny_prompts(), 24, ignore_eos=True)
    dec = eng.decoder
    st, lengths = dec._state, dec._state.lengths.clone()
    room = dec._base_cache.max_len - int(lengths.min())
    assert dec._time_step(st, 8, room + 8) > 0
    assert torch.equal(st.lengths, lengths)


@pytest.mark.parametrize("batch,seeds", [(2, 40), (16, 10), (64, 10)])
def test_the_controller_keeps_up_with_the_best_fixed_draft_length(batch, seeds):
    """At the H200's measured prices for the 8B target and rows accepting like the packaged head, the controller's
    choices yield at least 97.5% of the best fixed k's tokens a millisecond (B = 2 and 16: k = 4; B = 64: k = 3),
    averaged over seeded batches. Before its calibration priced each step at the acceptance measured so far and
    probed a longer step after shorter ones, it reached 96% / 95% / 96%: its first steps, chosen under the prior,
    priced k' = 4 low for good (on the H200: k' = 3 at B = 16, AR at 64, 0.97x)."""
    rate = sum(simulate(batch, s)[2] for s in range(seeds))
    best = max(sum(simulate(batch, s, fixed=k)[2] for s in range(seeds)) for k in (-1, 1, 2, 3, 4))
    assert rate >= 0.975 * best


# Steps below one draft a row (`batch.fractions`): a kind f packs f x B drafts across the batch. The H200's step times
# at B = 16 (ms, thirty-ninth lease): AR 16 tokens 0.71, 24 tokens on the fused layer 0.77-0.79, k' = 1 (32 tokens,
# the modular layer) 1.15-1.29; longer kinds priced above k' = 1 here
H200_B16 = {0: 0.71, 0.5: 0.78, 1: 1.15, 2: 1.35, 3: 1.55, 4: 1.75}


def test_fraction_kinds_and_their_plans():
    """A fraction's budget is f x B drafts, rounded, at least one and fewer than the rows; its plan water-fills that
    budget over the rows that have drafts, padded or ragged alike (a padded step cannot verify under one a row)."""
    assert fraction_kinds((0.25, 0.5), 1) == ()
    assert fraction_kinds((0.25, 0.5), 2) == (0.5,)
    assert fraction_kinds((0.5, 0.25), 16) == (0.25, 0.5)
    assert [packed_budget(f, 16) for f in (0.25, 0.5)] == [4, 8]
    found = [3, 0, 2, 0, 1, 0, 0, 0]
    for ragged in (False, True):  # budget 4: one each, then the row with the most one more
        assert planned_drafts(found, 0.5, ragged, 8) == Counter({0: 5, 1: 2, 2: 1})
    assert planned_drafts(found, 1, False, 8) == Counter({0: 5, 1: 3})  # padded k' = 1: one a row that has one


def test_a_fraction_verifies_where_k1_would_lose():
    """At the H200's B = 16 prices, each draft accepted 40% of the time: k' = 1 yields 22.4 tokens in 1.15 ms,
    fewer a second than AR's 16 in 0.71, so without fractions the controller runs AR; half a draft a row (8 drafts,
    19.2 tokens in 0.78 ms, 24.6 a ms against AR's 22.5) beats AR by more than the margin and is chosen. A head,
    whose fraction steps draft one token a row, plans at most one draft a row there."""
    def controller(fixed=False):
        c = uncalibrated(DraftLengthController(4, probe_every=1000, bucket=16, fixed_drafts=fixed))
        c.observe([4] * 1000, [0] * 600 + [1] * 240 + [2] * 96 + [3] * 38 + [4] * 26, [4] * 16)
        return c

    without = {kind: ms for kind, ms in H200_B16.items() if kind == int(kind)}
    assert controller().choose(without) == 0
    assert controller().choose(H200_B16) == 0.5
    head = controller(fixed=True)
    assert head.allocation([4] * 4, 0.5) == Counter({1: 4})  # (bucket 16: a budget of 8 over 4 rows, one each)
    assert controller().allocation([4] * 4, 0.5) == Counter({2: 4})


def test_a_probe_after_fraction_steps_tries_the_next_kind_up():
    """After `probe_every` fraction steps the probe verifies the next kind up (one draft a row), as after k' = 2 it
    verifies 3."""
    c = uncalibrated(DraftLengthController(4, probe_every=3, bucket=16))
    c.observe([4] * 1000, [0] * 600 + [1] * 240 + [2] * 96 + [3] * 38 + [4] * 26, [4] * 16)
    assert [c.choose(H200_B16) for _ in range(8)] == [0.5, 0.5, 0.5, 1, 0.5, 0.5, 0.5, 1]


def test_fraction_steps_decode_ar_tokens(tiny, tiny_reference):
    """A padded controller with fractions, forced through every kind in turn (half a draft a row, a quarter, AR,
    one a row, four): a fraction step packs B + f x B tokens into one row of the target's forward (three rows: 2
    and 1 drafts), the others are padded, and the tokens are AR's for every family."""
    eng = controlled(tiny.loaded, {3: {**FLAT, 0.25: 1.0, 0.5: 1.0}}, fractions=[0.25, 0.5])
    assert eng.decoder._step_kinds(3) == (4, 3, 2, 1, 0.5, 0.25, 0, BLIND_AR)
    assert eng.decoder._step_kinds(3, greedy=False) == (4, 3, 2, 1, 0, BLIND_AR)
    assert eng.decoder._step_kinds(1) == (4, 3, 2, 1, 0, BLIND_AR)  # (no fraction of one row's drafts)
    cycle = iter([0.5, 0.25, 0, 1, 4] * 100)
    eng.decoder.controller.choose = lambda prices: next(cycle)
    rows, widths = step_widths(eng, tiny_prompts(), TINY_NEW)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    lengths = eng.decoder.last_stats.draft_lengths
    assert lengths[:5] == [0.5, 0.25, 0, 1, 4]
    assert widths == [3 + packed_budget(k, 3) if k != int(k) else k + 1 for k in lengths]


def test_sampled_steps_never_choose_a_fraction(tiny):
    """Fractions pack their drafts, which only greedy verification does: a sampled call under the controller is
    offered the integral kinds only, and decodes."""
    from specpilot.engine.sampling import SamplingParams

    eng = controlled(tiny.loaded, {3: {**FLAT, 0.25: 0.1, 0.5: 0.1}}, fractions=[0.25, 0.5])
    offered = []
    real = eng.decoder.controller.choose
    eng.decoder.controller.choose = lambda prices: offered.append(set(prices)) or real(prices)
    rows = eng.generate(tiny_prompts(), TINY_NEW, SamplingParams(temperature=0.8), seed=1, ignore_eos=True)
    assert all(len(r.tokens) == TINY_NEW for r in rows)
    assert offered and all(kinds == set(range(5)) for kinds in offered)
    assert all(k == int(k) for k in eng.decoder.last_stats.draft_lengths)


def test_fractions_recipe_key():
    r = parse({"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "cost", "fractions": [0.25, 0.5]}})
    assert r.batch.fractions == [0.25, 0.5] and parse({}).batch.fractions == []
    for batch, why in (({"controller": "cost", "fractions": [1.0]}, "strictly between 0 and 1"),
                       ({"fractions": [0.5]}, "controller 'cost'")):
        with pytest.raises(RecipeError, match=why):
            parse({"drafter": {"kind": "ngram"}, "k": 4, "batch": batch})
