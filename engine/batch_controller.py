"""The batch-level controller: each decoding step's kind k' (how many drafts a row verifies, down to a plain AR
step for the whole batch) from the acceptance measured so far, the drafts each row has, and each kind's price at the
batch's bucket (its graph replayed at warm-up, corrected by the decoding loop's own times). The decoder
(engine/decode.py) asks it before each step and tells it each step's outcome and time; it holds no tensors."""
from __future__ import annotations

import os
import statistics
from collections import Counter, deque

from .recipe import BatchSpec

# The loop times of a kind of step that price it: the median of the latest TIME_WINDOW (a median, since a single
# step can take several times its cost: the host's garbage collection, requests started or a batch moved to a smaller
# bucket while it ran; on the H200, summarize at B = 2, fifteenth lease, an AR step's moving average stood at 0.94 ms
# in the loop against 0.44 replayed, and the controller verified drafts at a loss), and how many a kind needs before
# its own median prices it (fewer: priced like the kinds timed around it; a kind run a few times, a probe, is priced
# by noise otherwise)
TIME_WINDOW = 15
MIN_TIMED_STEPS = 4
# The weight of the prior in each kind's calibration, in steps of the batch's rows: a kind's own ratio moves away from
# the batch's only over several of its steps. (At one step's weight, a chain's first two steps at B = 1 that happened
# to accept little priced k' = 4 below k' = 3 for the rest of the request, k' = 4 never being run again to correct it.)
CALIBRATION_PRIOR_STEPS = 4
# How much more a verifying step must be expected to yield per second than an AR step for the batch controller to
# run it (the recipe's batch.margin). A step that the estimates put at a tie gains nothing on average and loses
# whenever they err (acceptance and step times are measured, with noise); the H200's chat cells at B = 2 and 4 lost
# 3-4% to marginal choices.
SPECULATION_MARGIN = BatchSpec.margin
# After a probe that did not pay and did not change the model's choice (`DraftLengthController`), the steps to the
# next probe double, up to PROBE_BACKOFF times probe_every; any other probe resets them. (SPECPILOT_PROBE_BACKOFF=1
# turns the backoff off, for A/B timing.) A probe of k
# after AR steps costs 1.6 AR steps at B = 4 on the H100 (20 tokens: the modular layer), and chat at B = 4, where the
# n-gram drafter's drafts were hopeless, ran one every 17 steps (thirtieth lease: 403 of 481 steps AR, 0.95x AR).
PROBE_BACKOFF = int(os.environ.get("SPECPILOT_PROBE_BACKOFF", "8"))
# After `probe_every` steps in a row of the same verifying kind, the kind just below it is run until the loop has
# timed it MIN_TIMED_STEPS times, if it has not been: an untimed kind is priced by its replay scaled like the timed
# kinds around it, and where those run on another layer the scale is wrong. On the H100 (forty-second lease), chat
# B = 8 with the fused layer up to 32 tokens: k' = 3 replayed at 0.96 ms and ran at 1.25 in the loop, k' = 1 at 0.82
# and 0.95; k' = 2, never run, was priced at 1.15 (0.93 replayed, scaled between them) where the loop times it at
# 1.08-1.13, so the controller ran k' = 3 on 277 of 312 steps: 1.21x AR where k' = 2 made 1.25x. With B = 16 and
# fractions, k' = 2 (48 tokens, modular) was priced from the fused k' = 1/2's ratio 1.35 and never run: 1.00x where
# 1.07x was there. Upward probes (above) already time the kind above a choice below k. (SPECPILOT_PROBE_DOWN=0 turns
# these probes off, for A/B timing.)
PROBE_DOWN = os.environ.get("SPECPILOT_PROBE_DOWN", "1") == "1"
# The kind of the probe after AR steps: k (0, as shipped), or this many drafts a row (at most k). At B = 1 the choice
# between AR and speculation near break-even rests on a handful of first-draft samples, and a probe of k samples the
# first draft at the price of the longest step (summarize, the head copying up to 5: docs/benchmarks/2026-12-07-
# fiftieth-lease.md). SPECPILOT_AR_PROBE_KIND=1 probes with one draft a row (for A/B timing; not yet timed).
AR_PROBE_KIND = int(os.environ.get("SPECPILOT_AR_PROBE_KIND", "0"))
# The kind of step the batch controller runs when no draft could pay (even with k drafts for every row, an AR step
# would be faster): an AR step that does not search for drafts either (the search costs a few percent of a step)
BLIND_AR = -1


def expected_tokens(acceptance_by_position, n: int) -> float:
    """Tokens a row emits in a step verifying n drafts: 1 + sum over i <= n of prod over j <= i of p_j, with p_j the
    chance that draft j is accepted once drafts 1..j-1 were."""
    total = reach = 1.0
    for p in list(acceptance_by_position)[:n]:
        reach *= p
        total += reach
    return total


def water_fill(found: list[int], budget: int) -> list[int]:
    """The drafts each row verifies in a ragged step: every row up to a common cap c (the largest whose total fits
    the budget), then one more each for the first rows that have more, while the budget lasts (what the step's
    packing computes on the device, `_pack`)."""
    cap = 0
    while sum(min(v, cap + 1) for v in found) <= budget and cap < max(found, default=0):
        cap += 1
    alloc = [min(v, cap) for v in found]
    left = budget - sum(alloc)
    for b, v in enumerate(found):
        if v > cap and left > 0:
            alloc[b] += 1
            left -= 1
    return alloc


def packed_budget(k_step: float, bucket: int) -> int:
    """The drafts a packed step of kind k_step verifies across a batch bucket at most: k_step x bucket."""
    return round(k_step * bucket)


def fraction_kinds(fractions, bucket: int) -> tuple[float, ...]:
    """The kinds below one draft a row (`batch.fractions`) a bucket can run: those whose packed budget is at least
    one draft (and, being below one a row, fewer than the bucket's rows)."""
    return tuple(sorted({f for f in fractions if 1 <= packed_budget(f, bucket) < bucket}))


def is_packed(k_step: float, ragged: bool) -> bool:
    """Whether a verifying step of kind k_step packs its drafts (ragged verification): always with `ragged`, and a
    kind below one draft a row (a fraction) in any case, since a padded step cannot verify fewer than one a row."""
    return k_step > 0 and (ragged or k_step != int(k_step))


def planned_drafts(found: list[int], k_step: float, ragged: bool, bucket: int) -> Counter:
    """How many rows a step of kind k_step verifies n drafts (n -> rows), for live rows with `found` drafts each:
    padded, at most k_step a row; packed (`is_packed`), at most k_step x bucket across the batch, water-filled over
    the rows that have them (`water_fill`, here over the count of rows with each number of drafts: the host runs
    this for every kind before every step); 0, none."""
    return _plan(Counter(found), k_step, ragged, bucket)


def _plan(rows: Counter, k_step: float, ragged: bool, bucket: int) -> Counter:
    """`planned_drafts` for `rows` (drafts found -> rows)."""
    if not is_packed(k_step, ragged):
        return _capped(rows, int(k_step))
    # the largest common cap whose drafts fit the budget (raising it by one adds a draft to each row above it), then
    # one more draft for as many of the rows above it as the budget has left
    budget, top, total, cap = packed_budget(k_step, bucket), max(rows, default=0), 0, 0
    above = [sum(c for v, c in rows.items() if v > n) for n in range(top + 1)]
    while cap < top and total + above[cap] <= budget:
        total, cap = total + above[cap], cap + 1
    plan, extra = _capped(rows, cap), min(budget - total, above[cap])
    if extra > 0:
        plan[cap] -= extra
        plan[cap + 1] += extra
    return plan


def _capped(rows: Counter, cap: int) -> Counter:
    """Rows by drafts verified when each of `rows` (drafts found -> rows) verifies at most `cap` of its drafts."""
    plan = Counter()
    for v, c in rows.items():
        plan[min(v, cap)] += c
    return plan


def step_tokens(found: list[int], acceptance_by_position, k_step: int, ragged: bool, bucket: int) -> float:
    """Expected tokens of a step of kind k_step for live rows with `found` drafts each (`planned_drafts`); 0, a
    plain AR step (one token a row)."""
    if k_step == 0:
        return float(len(found))
    return sum(c * expected_tokens(acceptance_by_position, n)
               for n, c in planned_drafts(found, k_step, ragged, bucket).items())


def choose_step(tokens_by_kind: dict[int, float], prices_by_kind: dict[int, float], margin: float = 0.0) -> int:
    """The kind of step (its k') with the most expected tokens per second, tokens / price, where a verifying step
    must beat an AR step's rate by `margin` (a share). Kinds without a price are not considered; ties go to the
    smaller k' (the cheaper step); nothing priced: the largest kind."""
    best, best_rate = max(tokens_by_kind), 0.0
    for kind in sorted(tokens_by_kind):
        price = prices_by_kind.get(kind)
        if price is None:
            continue
        if price <= 0:
            raise ValueError(f"step price for k'={kind} must be positive, got {price}")
        rate = tokens_by_kind[kind] / price * (1 + margin if kind <= 0 else 1)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = kind, rate
    return best


class DraftLengthController:
    """The host's state for one batch: what it has measured, and the choice of each next step's kind k' in 0..k.

    p_i, the chance that draft i is accepted once drafts 1..i-1 were, is (rows that accepted draft i) / (rows that
    verified draft i after accepting 1..i-1), from this batch's steps, starting from one success at each position
    (an untried length looks good, so it gets tried). Which rows have drafts, and how many, is what the drafter found
    at the latest step (every step reports it, AR steps included: the drafter still searches); a drafter that always
    proposes k (a draft model) reports k. The expected tokens of each kind of step follow (`step_tokens`), and with
    each kind's price at this batch bucket the choice (`choose_step`; a verifying step must beat AR by `margin`). A
    plain AR step verifies nothing, so after `probe_every` AR steps in a row the next step verifies k, to notice
    when acceptance comes back; after `probe_every` steps below k the next verifies one draft more than the latest
    choice, to notice that a longer step pays after all. (Without the probes after shorter steps, two early steps of
    k' = 4 at B = 1 that happened to accept nothing priced it below k' = 3 for the rest of the request: only a step
    of that kind corrects its calibration. One draft more, not k: where a long step costs much more, as on a
    launch-bound small model, a probe of k every few steps would cost a few percent.) When even k drafts for every
    row would not pay, the AR step does not search for drafts either (BLIND_AR), nor does any AR step of a drafter
    that always has k drafts (`fixed_drafts`: its search finds nothing the controller does not know; AR is then
    priced as that blind step). A probe that did not pay (its step did not beat an AR step's tokens a second by the
    margin) and after which the model chooses no longer steps than before doubles the steps to the next one (up to
    PROBE_BACKOFF times `probe_every`: where speculation stays hopeless, probes cost a fraction of a percent); any
    other probe brings them back to `probe_every`. After `probe_every` choices in a row of one verifying kind, the
    kind just below it runs until the loop has timed it, where its price was a guess from other kinds' loop times
    (PROBE_DOWN): the probes above only ever time the kind above a choice.

    The model's expected gain (tokens beyond one a row) is calibrated by what the verifying steps actually gained:
    each choice's plan (how many drafts it expected each row to verify: `allocation`) is kept until its step is read,
    and each verifying kind's expected gain is scaled by (gained + prior) / (predicted + prior) over this batch's
    steps of that kind, where `predicted` is the model's gain for those plans at the acceptance measured so far (not
    at the moment each was chosen), and the prior, CALIBRATION_PRIOR_STEPS steps' worth, weighs in the ratio over all
    verifying steps (`calibration`: a kind run rarely follows the batch's measure). (Priced with the acceptance of
    the moment they were chosen, a batch's first steps, chosen under the optimistic prior, were predicted up to four
    times what they gained, and the kinds they ran kept that ratio, never run again to correct it: on the H200 at 8B,
    B = 16-64, the controller settled on k' = 3 and AR where k' = 4 gained 1.38x and more; twenty-eighth lease.)
    The model errs where
    it cannot see: drafts found two steps back (overlap chooses a step before the previous one is read), per-row
    budgets that verify fewer drafts than were found (adaptive), rows that finish or start in between, few samples at
    deep positions (a deep kind's error is its own, hence a ratio a kind); measured tokens correct all of them at
    once, so a batch where speculation gains less than it costs turns to AR. What a step gained counts only the
    tokens its rows kept (`observe`'s `kept`): a request's last step may accept drafts past its end, which are
    dropped.

    The prices are the steps' graphs replayed at warm-up, corrected by what the steps of each kind took in the
    decoding loop itself (`observe_time`: seconds between the host's reads of consecutive steps, the median of the
    latest TIME_WINDOW per kind). That time holds what a replay does not: the host's work where it is the
    bottleneck, attention over the real context lengths. The steps that ran behind requests started in the batch,
    or while the host started them, are not timed (the decoder skips them): every kind of step would pay that
    prefill alike, and charged to whichever kind followed it, it made that kind look up to twice its cost. A kind
    not timed yet, or fewer than MIN_TIMED_STEPS times, is priced as its
    replay scaled like the timed kinds around it."""

    def __init__(self, k: int, probe_every: int = 16, ragged: bool = False, bucket: int = 1,
                 margin: float = SPECULATION_MARGIN, fixed_drafts: bool = False):
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.k, self.probe_every, self.ragged, self.bucket = k, probe_every, ragged, bucket
        # The drafter always has k drafts a row (an EAGLE-3 head): an AR step's search would tell nothing, so each
        # AR step is BLIND_AR where that is priced
        self.fixed_drafts = fixed_drafts
        self.margin = margin
        self.seconds: dict[int, float] = {}
        self.timed: dict[int, deque] = {}
        self.reset(bucket)

    def reset(self, bucket: int | None = None, seconds: dict[int, float] | None = None,
              timed: dict[int, deque] | None = None) -> None:
        """A new batch: acceptance measured afresh; `seconds`, the loop's time of each of this bucket's kinds of
        step so far, and `timed`, the latest times of each kind it is the median of (both dicts updated in place),
        carry over."""
        self.bucket = bucket or self.bucket
        self.reached = [1.0] * self.k
        self.accepted = [1.0] * self.k
        self.found: list[int] | None = None  # drafts each live row had at the latest step (None: not yet seen)
        self.short_run = 0  # steps in a row chosen below k (AR steps included), since the latest probe
        self.latest = BLIND_AR  # the latest kind chosen by the model (not a probe)
        self.probe_gap = self.probe_every  # steps below k in a row before the next probe (`choose`)
        self.settled_run = 0  # steps in a row the model chose `latest`, a verifying kind (a probe below, `choose`)
        self.below: tuple[float, int] | None = None  # the kind below being timed, and its steps still to run
        # the latest probe, once its step is read: (the model's choice before it, its kind, drafts kept, rows)
        self.probed: tuple[int, int, int, int] | None = None
        # each step chosen and not yet read: (its kind, its allocation, for a probe the model's choice before it),
        # None for an AR step
        self.predictions: deque[tuple[int, Counter] | None] = deque()
        self.planned: dict[int, Counter] = {}  # by kind, over this batch's verifying steps: drafts a row -> rows
        self.realized_gain: Counter = Counter()  # by kind: the drafts those steps' rows kept
        self.seconds = {} if seconds is None else seconds
        self.timed = {} if timed is None else timed

    def rebucket(self, bucket: int, seconds: dict[int, float], timed: dict[int, deque]) -> None:
        """The batch moved to a smaller bucket (its rows ran out): that bucket's loop times price the steps from
        now on; what was measured of the acceptance stays (a probe below, timing a kind of the old bucket, stops)."""
        self.bucket, self.seconds, self.timed = bucket, seconds, timed
        self.below, self.settled_run = None, 0

    def acceptance(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted, self.reached)]

    def observe(self, verified: list[int], accepted: list[int], found: list[int],
                kept: list[int] | None = None) -> None:
        """A step's outcome for its live rows: drafts each verified, accepted, and found (available), and of the
        accepted drafts those the row kept (default: all; fewer where the request ended inside the step). Steps are
        observed in the order they were chosen."""
        for v, n in zip(verified, accepted):
            for i in range(min(v, n + 1)):
                self.reached[i] += 1
                self.accepted[i] += n > i
        self.found = list(found)
        chosen = self.predictions.popleft() if self.predictions else None
        if chosen is not None:  # a verifying step: what it planned, and what it gained
            kind, allocation, before_probe = chosen
            gained = sum(accepted if kept is None else kept)
            if before_probe is not None:  # a probe: judged at the next choice (`choose`)
                self.probed = (before_probe, kind, gained, len(verified))
            self.planned.setdefault(kind, Counter()).update(allocation)
            self.realized_gain[kind] += gained

    def predicted_gains(self) -> dict[int, float]:
        """By kind, the model's gain (tokens beyond one a row) for this batch's steps of that kind at the acceptance
        measured so far: for each row of each step, the expected accepted drafts of the drafts it was planned to
        verify."""
        p = self.acceptance()
        gain = [expected_tokens(p, n) - 1 for n in range(self.k + 1)]
        return {kind: sum(rows * gain[n] for n, rows in plans.items()) for kind, plans in self.planned.items()}

    def allocation(self, found: list[int], kind: float) -> Counter:
        """How many rows a step of `kind` plans to verify n drafts, for rows with `found` drafts (`planned_drafts`)."""
        return self._plan(Counter(found), kind)

    def _plan(self, by_found: Counter, kind: float) -> Counter:
        """`_plan` for this batch; a drafter that always has k drafts proposes one a row for a fraction kind (the
        decoder's step drafts no deeper: `Decoder._step`), so its rows have one each there."""
        if self.fixed_drafts and 0 < kind < 1:
            by_found = Counter({min(v, 1): c for v, c in by_found.items()})
        return _plan(by_found, kind, self.ragged, self.bucket)

    def calibration(self, kind: int | None = None) -> float:
        """Gained over expected gain of this batch's verifying steps of `kind` (None: of every kind), with a prior
        of CALIBRATION_PRIOR_STEPS steps of every row's first draft at the ratio of all kinds (which has the same
        prior at 1: so the first few steps cannot swing either)."""
        ratios = self.calibrations()
        return ratios[None] if kind is None else ratios.get(kind, ratios[None])

    def calibrations(self) -> dict[int | None, float]:
        """`calibration` of every kind run so far, and of all (None), computed together: the host asks before each
        step."""
        prior = CALIBRATION_PRIOR_STEPS * max(1, self.bucket)
        predicted = self.predicted_gains()
        overall = (sum(self.realized_gain.values()) + prior) / (sum(predicted.values()) + prior)
        return {None: overall, **{kind: (self.realized_gain[kind] + prior * overall) / (gain + prior)
                                  for kind, gain in predicted.items()}}

    def observe_time(self, kind: int, seconds: float) -> None:
        """The loop's time of a step of this kind: its price becomes the median of the kind's latest TIME_WINDOW."""
        latest = self.timed.setdefault(kind, deque(maxlen=TIME_WINDOW))
        latest.append(seconds)
        self.seconds[kind] = statistics.median(latest)

    def priced(self, prices_by_k: dict[int, float]) -> dict[int, float]:
        """Each kind's price: its loop time where timed (MIN_TIMED_STEPS times at least), else its replay times the
        loop/replay ratio interpolated between the nearest timed kinds below and above it (the nearest one's
        beyond them)."""
        ratio = {kind: t / prices_by_k[kind] for kind, t in self.seconds.items()
                 if prices_by_k.get(kind) and len(self.timed.get(kind, ())) >= MIN_TIMED_STEPS}
        if not ratio:
            return prices_by_k
        out = {}
        for kind, price in prices_by_k.items():
            below = max((m for m in ratio if m <= kind), default=None)
            above = min((m for m in ratio if m >= kind), default=None)
            if below is None or above is None or below == above:
                r = ratio[below if above is None else above if below is None else below]
            else:
                r = ratio[below] + (ratio[above] - ratio[below]) * (kind - below) / (above - below)
            out[kind] = price * r
        return out

    def _tokens(self, found: list[int], ratios: dict[int | None, float] | None = None,
                kinds=None) -> dict[float, float]:
        """Expected tokens of a step of each kind (0 and `kinds`, default 1..k) for live rows with `found` drafts,
        each kind's gain calibrated (by `ratios`, `calibrations()` unless given): `step_tokens` for every kind, with
        each row's gain by drafts verified and the rows by drafts found computed once (the host runs this before
        every step)."""
        ratios = self.calibrations() if ratios is None else ratios
        p, by_found = self.acceptance(), Counter(found)
        gain = [expected_tokens(p, n) - 1 for n in range(self.k + 1)]
        out = {0: float(len(found))}
        for kind in range(1, self.k + 1) if kinds is None else kinds:
            planned = self._plan(by_found, kind)
            out[kind] = len(found) + ratios.get(kind, ratios[None]) * sum(c * gain[n] for n, c in planned.items())
        return out

    def expected(self) -> dict[float, float]:
        """Expected tokens of a step of each kind 0..k for the rows seen last (before any step: all rows, k each)."""
        return self._tokens(self.found if self.found is not None else [self.k] * self.bucket)

    def hopeless(self, priced: dict[float, float], ratios: dict[int | None, float] | None = None) -> bool:
        """Whether an AR step would beat every verifying step even if each live row had k drafts: then searching
        for drafts is wasted until the acceptance changes (a probe measures it again)."""
        rows = len(self.found) if self.found is not None else self.bucket
        kinds = [kind for kind in priced if kind > 0]
        return rows > 0 and choose_step(self._tokens([self.k] * rows, ratios, kinds), priced, self.margin) == 0

    def _probe_paid(self, priced: dict[int, float], choice: int) -> bool:
        """Whether the latest probe changed anything: its own step beat an AR step's tokens a second (at the prices)
        by the margin a chosen step must, or the model now chooses longer steps than before it. (Judged without the
        margin, a batch at a tie, whose probes beat AR about every other time, kept probing every `probe_every`
        steps: the probe said "pays" where the model, with the margin, would not verify.)"""
        before, kind, gained, rows = self.probed
        if kind in priced and 0 in priced and (rows + gained) / priced[kind] > rows / priced[0] * (1 + self.margin):
            return True
        return max(choice, 0) > max(before, 0)

    def _untimed_below(self, kind: float, kinds: list[float], prices: dict) -> float | None:
        """The verifying kind just below `kind` among `kinds` when the loop has timed it fewer than MIN_TIMED_STEPS
        times while it timed others (its price is then its replay scaled like those: `priced`), else None."""
        below = max((other for other in kinds if other < kind), default=None)
        timed = [other for other, times in self.timed.items() if len(times) >= MIN_TIMED_STEPS]
        if below is None or below not in prices or below in timed or not timed:
            return None
        return below

    def choose(self, prices_by_k: dict[float, float]) -> float:
        """The next step's kind: k' in 0..k (or a fraction of one draft a row, where `prices_by_k` prices one), or
        BLIND_AR (priced among them) when no draft could pay."""
        probe = self.short_run >= self.probe_gap
        kinds = sorted(kind for kind in prices_by_k if kind > 0) or list(range(1, self.k + 1))
        if self.below is not None and self.below[0] not in prices_by_k:  # (a bucket moved to that lacks the kind)
            self.below = None
        if not probe and PROBE_DOWN and self.below is None and self.settled_run >= self.probe_every:
            below = self._untimed_below(self.latest, kinds, prices_by_k)
            self.settled_run = 0
            if below is not None:
                self.below = (below, MIN_TIMED_STEPS - len(self.timed.get(below, ())))
        if not probe and self.below is not None:  # the kind below, until it is timed (`PROBE_DOWN`)
            choice, left = self.below
            self.below = (choice, left - 1) if left > 1 else None
            self.predictions.append((choice, self.allocation(self.found if self.found is not None
                                                             else [self.k] * self.bucket, choice), None))
            return choice
        if probe:  # k after AR steps (AR_PROBE_KIND); after shorter verifying steps, the next kind up (a step that
            # costs little more)
            after_ar = min(AR_PROBE_KIND, self.k) if AR_PROBE_KIND > 0 and AR_PROBE_KIND in kinds else self.k
            choice = after_ar if self.latest <= 0 else min((kind for kind in kinds if kind > self.latest),
                                                            default=self.k)
        else:
            ratios = self.calibrations()
            expected = self._tokens(self.found if self.found is not None else [self.k] * self.bucket, ratios, kinds)
            priced = self.priced(prices_by_k)
            searching = {kind: price for kind, price in priced.items() if kind >= 0}
            if self.fixed_drafts and BLIND_AR in priced:  # its AR steps run blind, so AR costs what they cost
                searching[0] = priced[BLIND_AR]
            choice = choose_step(expected, searching, self.margin)
            if choice == 0 and BLIND_AR in priced and (self.fixed_drafts or self.hopeless(searching, ratios)):
                choice = BLIND_AR
            if self.probed is not None:  # the first choice that knows the latest probe's outcome
                self.probe_gap = (self.probe_every if self._probe_paid(searching, choice)
                                  else min(2 * self.probe_gap, PROBE_BACKOFF * self.probe_every))
                self.probed = None
        self.short_run = 0 if probe or choice >= self.k else self.short_run + 1
        if not probe:
            self.settled_run = self.settled_run + 1 if choice == self.latest and choice > 0 else 0
            self.latest = choice
        else:
            self.settled_run = 0
        # what this step plans to verify, for the calibration once it is read (`observe`)
        had = self.found if self.found is not None else [self.k] * self.bucket
        self.predictions.append((choice, self.allocation(had, choice), self.latest if probe else None)
                                if choice > 0 else None)
        return choice
