"""Each decoding step of our engine between two CUDA timing events: its time on the device and the device's idle
before it, step by step. The loop's own record of a step (engine.decode.StepRecord) is the interval between two host
reads, where a longer step and a device that waited for the host's launch look alike; these tell them apart. On in a
bench with SPECPILOT_STEP_EVENTS=1 (the step log then carries device_ms and idle_us columns), and in
benchmarks' `loop_overhead --timeline`. Off by default: the two events (and the host's work to record them) are
the same for every system, but they are not free, so a figure with them on is compared only with figures with them on.
(Forty-fifth lease: the batch controllers' AR steps took 1-3% longer in the bench's loop than our AR's, their graphs'
replays level.)"""
from __future__ import annotations

import os
import statistics
from contextlib import contextmanager

import torch

ENABLED = os.environ.get("SPECPILOT_STEP_EVENTS", "0") == "1"
# A device idle longer than this before a step: it waited for the host, beyond the copy of the last step's outputs
IDLE_US = 5.0


@contextmanager
def bracketed(decoder):
    """Within it, each step the decoder launches (`Decoder._run_step`: a backlog's absorb it needs, then the step)
    runs between two CUDA timing events; yields the list of (kind, start, end) filled in launch order."""
    marks: list = []
    run_step = decoder._run_step

    def step(st, sampling, drafts_k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_step(st, sampling, drafts_k)
        end.record()
        marks.append((drafts_k, start, end))

    decoder._run_step = step
    try:
        yield marks
    finally:
        del decoder._run_step


def columns(marks) -> tuple[list[float], list[float | None]]:
    """(device ms, idle µs before it) a step, the device synchronized first; a first step has no idle (None)."""
    torch.cuda.synchronize()
    device = [start.elapsed_time(end) for _, start, end in marks]
    idle = [None] + [marks[i - 1][2].elapsed_time(marks[i][1]) * 1e3 for i in range(1, len(marks))]
    return device, idle


def summary(kinds, device_ms, idle_us, keep) -> dict:
    """Per kind of step (kinds[i]), over the steps i with keep[i] and an idle figure: how many, the median device
    ms, the median and mean idle µs before them, and the share idle past IDLE_US."""
    by_kind: dict = {}
    for kind, ms, idle, kept in zip(kinds, device_ms, idle_us, keep):
        if kept and idle is not None:
            by_kind.setdefault(kind, []).append((idle, ms))
    return {kind: {"steps": len(v), "device_ms": statistics.median(ms for _, ms in v),
                   "idle_us_median": statistics.median(i for i, _ in v),
                   "idle_us_mean": statistics.fmean(i for i, _ in v),
                   "idle_over_5us": sum(i > IDLE_US for i, _ in v) / len(v)}
            for kind, v in sorted(by_kind.items(), key=lambda kv: str(kv[0]))}


def steady(step_log) -> list[bool]:
    """The steps whose time is their kind's own: not behind host work (requests started, a move) and not in the
    drain (rows standing idle)."""
    return [not s.behind_refill and not s.queue_empty for s in step_log]
