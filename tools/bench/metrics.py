"""Turn one system's measured batches of one (workload, batch size) cell into the numbers of a results.json run.

Definitions (docs/BENCH.md repeats them for readers of results.json):
- tokens_per_s = generated tokens / wall seconds of the measured batches (prefill included).
- mean_accepted (tau) = tokens emitted by verification steps / row-steps, each row-step emitting accepted + 1.
- per-token latency: a row's gaps between successive token arrivals; the n tokens of one step share its gap
  equally (gap / n each). The first token's wait is the time to first token, reported apart.
- request latency: when a row's last token arrived, from the start of its batch.
"""
from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np

from . import step_events
from .systems import BatchRun

QUANTILES = tuple(range(101))  # percentiles stored for latency CDFs


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def token_latencies(times: list[float]) -> list[float]:
    """Per-token latencies (seconds) of one row, from its token arrival times."""
    steps = sorted(Counter(times).items())  # (arrival time, tokens that arrived then)
    out = []
    for (prev, _), (now, count) in pairwise(steps):
        out += [(now - prev) / count] * count
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def accepted_histogram(accepted: list[list[int]], k: int) -> list[int]:
    counts = [0] * (k + 1)
    for row in accepted:
        for a in row:
            counts[min(a, k)] += 1
    return counts


def time_budget(steps, refill_prefills: int = 0, refill_prefill_s: float = 0.0) -> dict | None:
    """Where a continuously batched decode's step time went, from its steps as the loop read them
    (engine.decode.StepRecord), or None for a system without them (HF):
    - steps_s: the reads' intervals summed (the decode's wall time but for the first prefill and the last sync);
    - refill_steps, refill_extra_s: steps whose read also waited for host work before them (requests started in
      finished rows: their prefill and move-in; a move to a smaller bucket), and what they took beyond the median step
      of their kind and bucket not behind such work (signed: noise cancels). It grows with how often rows start, not
      with how many: a batch whose rows end together starts them in a few large groups, one that drains unevenly
      (speculation: rows accept different numbers of drafts) in many small ones;
    - refill_prefills, refill_prefill_s: the prefills that started those requests and their own device time (given by
      the caller, engine.decode.BatchStats): what of refill_extra_s is the prefills' work, the rest the loop waiting;
    - drain_steps, drain_s, drain_live_rows: steps read once no request was waiting (the batch running out), their
      time and their live rows on average: the part of a finite run where the batch cannot be kept full;
    - steady_tokens_per_s: tokens a second before the drain (what a server at this concurrency sustains while
      requests keep arriving; None without such steps). A speculative batch drains longer than AR's whose rows of
      equal length end together: a finite run of few waves pays it in full, a stream never;
    - steady_live_rows: live rows a step before the drain (None without such steps);
    - steady_by_kind: before the drain, each kind of step not behind a refill (its k' as a string): how many, their
      mean time (ms), live rows and tokens: what a kind yields for what it costs in the loop, which tells whether a
      cell's steady loss is in its steps' choice or in its rows standing idle."""
    if not steps:
        return None
    plain: dict[tuple[int, int], list[float]] = {}
    for s in steps:
        if not s.behind_refill:
            plain.setdefault((s.kind, s.rows), []).append(s.seconds)
    typical = {key: float(np.median(v)) for key, v in plain.items()}
    refill = [s for s in steps if s.behind_refill]
    drain = [s for s in steps if s.queue_empty]
    steady = [s for s in steps if not s.queue_empty]
    steady_s = sum(s.seconds for s in steady)
    return {
        "steps_s": sum(s.seconds for s in steps),
        "refill_steps": len(refill),
        # (a refilled step of a kind and bucket that never ran without a refill has no typical time: not counted)
        "refill_extra_s": sum(s.seconds - typical[s.kind, s.rows] for s in refill if (s.kind, s.rows) in typical),
        "refill_prefills": refill_prefills,
        "refill_prefill_s": refill_prefill_s,
        "drain_steps": len(drain),
        "drain_s": sum(s.seconds for s in drain),
        "drain_live_rows": sum(s.live for s in drain) / len(drain) if drain else None,
        "steady_tokens_per_s": sum(s.tokens for s in steady) / steady_s if steady_s > 0 else None,
        "steady_live_rows": sum(s.live for s in steady) / len(steady) if steady else None,
        "steady_by_kind": by_kind([s for s in steady if not s.behind_refill]),
    }


def by_kind(steps) -> dict:
    """Steps grouped by kind (k' as a string): count, mean ms, mean live rows, mean tokens."""
    groups: dict[int, list] = {}
    for s in steps:
        groups.setdefault(s.kind, []).append(s)
    return {str(kind): {"steps": len(g), "ms": sum(s.seconds for s in g) / len(g) * 1e3,
                        "live": sum(s.live for s in g) / len(g), "tokens": sum(s.tokens for s in g) / len(g)}
            for kind, g in sorted(groups.items())}


def summarize(system: str, workload: str, batch_size: int, runs: list[BatchRun], k: int, memory_kind: str,
              device_is_cpu: bool, repeats: int) -> dict:
    """A results.json run without the fields that need AR's run of the same cell (filled by compare_to_ar)."""
    tokens = sum(len(row) for r in runs for row in r.tokens)
    seconds = sum(r.seconds for r in runs)
    cpu_seconds = sum(r.cpu_seconds for r in runs)
    # One GPU is busy for the whole synchronized call; on CPU the busy time is what the process's threads used.
    device_seconds = cpu_seconds if device_is_cpu else seconds
    accepted = [row for r in runs for row in r.accepted]
    row_steps = sum(len(row) for row in accepted)
    histogram = accepted_histogram(accepted, k)
    per_token = [x for r in runs for times in r.token_times for x in token_latencies(times)]
    first = [times[0] for r in runs for times in r.token_times if times]
    last = [times[-1] for r in runs for times in r.token_times if times]
    return {
        "system": system, "workload": workload, "batch_size": batch_size,
        "requests": sum(len(r.tokens) for r in runs), "batches": len(runs), "repeats": repeats,
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "speedup_vs_ar": None,
        "mean_accepted": (sum(map(sum, accepted)) + row_steps) / row_steps if row_steps else 1.0,
        "draft_tokens": k,
        "accepted_histogram": histogram,
        "acceptance_by_position": [sum(histogram[i + 1:]) / row_steps if row_steps else 0.0 for i in range(k)],
        "ttft_ms": _ms(_percentile(first, 50)),
        "p50_token_ms": _ms(_percentile(per_token, 50)), "p99_token_ms": _ms(_percentile(per_token, 99)),
        "p50_request_ms": _ms(_percentile(last, 50)), "p99_request_ms": _ms(_percentile(last, 99)),
        "token_latency_quantiles_ms": [_ms(_percentile(per_token, q)) for q in QUANTILES] if per_token else [],
        "peak_memory_bytes": max(r.peak_memory_bytes for r in runs), "memory_kind": memory_kind,
        "device_seconds": device_seconds,
        "tokens_per_device_s": tokens / device_seconds if device_seconds > 0 else None,
        "identical_to_ar": None,
        "finish_reasons": dict(Counter(f for r in runs for f in r.finish_reasons)),
        "captures_while_timed": sum(r.captures for r in runs),
        # our engine's steps by kind k' (drafts a row verified at most; ragged: per row on average; 0: AR steps), as
        # "k'": count: what the batch controller chose
        "step_kinds": {str(kind): n for kind, n in sorted(sum((Counter(r.step_kinds) for r in runs),
                                                              Counter()).items())},
        # the batch controller's price of each kind of step at this batch's bucket (ms; measured at warm-up)
        "step_prices_ms": {str(kind): seconds * 1e3 for kind, seconds in sorted(runs[-1].step_prices.items())},
        # ... and as the decoding loop timed them (ms; what the controller decided with at the end of the call)
        "step_loop_ms": {str(kind): seconds * 1e3 for kind, seconds in sorted(runs[-1].step_loop_seconds.items())},
        # times a batch moved to a smaller bucket as its requests ran out (its last steps then cost what the rows
        # left cost)
        "batch_shrinks": sum(r.shrinks for r in runs),
        # our engine: slots a row of its static KV cache held (null for HF). It only grows, so a cell after one of
        # longer prompts decodes in the longer cache; a recipe that verifies drafts needs a few slots more than AR
        # (engine/decode.py, cache_length), which can put the two in caches of different lengths
        "cache_slots": max((r.cache_slots for r in runs if r.cache_slots is not None), default=None),
        # our engine: live rows a decoding step, on average (null for HF): a batch's occupancy, below B where its rows
        # end at different steps and wait for the next request, or drain at the end
        "live_rows_per_step": (sum(r.row_steps for r in runs) / sum(r.steps for r in runs)
                               if sum(r.steps for r in runs) else None),
        # our engine: where its step time went (time_budget; null for HF)
        "time_budget": time_budget([s for r in runs for s in r.step_log], sum(r.refill_prefills for r in runs),
                                   sum(r.refill_prefill_s for r in runs)),
        # our engine: every step as the loop read it, in columns (null for HF): what time_budget sums, kept for
        # questions it does not answer (which steps of a cell were slow, and what ran before them)
        "step_log": step_columns([s for r in runs for s in r.step_log], [r.step_events for r in runs]),
    }


def step_columns(steps, events=()) -> dict | None:
    """The steps (engine.decode.StepRecord, in the order read) as columns: ms (3 decimals), kind, rows (bucket),
    live, tokens, refill (1: behind host work: requests started or a move), drain (1: no request waited); None for
    none. With `events` (each run's step_events, SPECPILOT_STEP_EVENTS=1) for every step, also device_ms (4 decimals)
    and idle_us (2; null for a run's first step)."""
    if not steps:
        return None
    out = {"ms": [round(s.seconds * 1e3, 3) for s in steps], "kind": [s.kind for s in steps],
           "rows": [s.rows for s in steps], "live": [s.live for s in steps], "tokens": [s.tokens for s in steps],
           "refill": [int(s.behind_refill) for s in steps], "drain": [int(s.queue_empty) for s in steps]}
    if events and sum(map(len, events)) == len(steps):
        device, idle = [], []
        for marks in events:
            ms, us = step_events.columns(marks)
            device += [round(t, 4) for t in ms]
            idle += [None if t is None else round(t, 2) for t in us]
        out["device_ms"], out["idle_us"] = device, idle
    return out


def compare_to_ar(run: dict, runs: list[BatchRun], ar_run: dict | None, ar_runs: list[BatchRun] | None) -> None:
    """Fill speedup_vs_ar and identical_to_ar from AR's run of the same cell (left null when AR failed)."""
    if ar_run is None or ar_runs is None:
        return
    if run["tokens_per_s"] is not None and ar_run["tokens_per_s"]:
        run["speedup_vs_ar"] = run["tokens_per_s"] / ar_run["tokens_per_s"]
    mine = [row for r in runs for row in r.tokens]
    theirs = [row for r in ar_runs for row in r.tokens]
    if len(mine) == len(theirs) and mine:
        run["identical_to_ar"] = sum(a == b for a, b in zip(mine, theirs)) / len(mine)
