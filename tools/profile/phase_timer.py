"""The decoder's phase hook: the time of each phase of a decoding step, measured on the eager step.

`Decoder.phase_timer = PhaseTimer(...)` makes the decoder run greedy steps eagerly (no CUDA graph) and call
`mark(point)` at begin, draft (after propose), verify (after the target forward), bookkeeping (after acceptance and
the drafter's update), sync / synced (around the host's read of the step's tokens) and end (after the host's work
on the step). Device phases are CUDA events on the current stream on GPU and perf_counter on CPU; host sync and the
step's wall time are host clocks; idle is the rest. With `ranges=True` each phase is also a torch.profiler range
named `specpilot::<phase>`, so a profile can attribute kernels to phases.
"""
from __future__ import annotations

import time

import torch

DEVICE_PHASES = ("draft", "verify", "bookkeeping")
PHASES = DEVICE_PHASES + ("host_sync", "idle")
TRIM = 0.5  # step times are means over the fastest half of the steps
# profiler range opened at each mark (what runs until the next mark)
NEXT_RANGE = {"draft": "verify", "verify": "bookkeeping", "bookkeeping": "launch", "sync": "host_sync",
              "synced": "host", "end": None}


class PhaseTimer:
    """The decoder's phase hook: `mark(point)` at begin, draft, verify, bookkeeping, sync, synced and end."""

    def __init__(self, device: str, k: int, ranges: bool = False):
        self.cuda, self.k, self.ranges = device.startswith("cuda"), k, ranges
        self.steps: list[dict] = []
        self._t: dict = {}
        self._ev: dict = {}
        self._range = None

    def mark(self, point: str) -> None:
        now = time.perf_counter()
        if point == "begin":
            self._t, self._ev = {}, {}
        if self.cuda and point in ("begin",) + DEVICE_PHASES:
            self._ev[point] = torch.cuda.Event(enable_timing=True)
            self._ev[point].record()
        self._t[point] = now
        if self.ranges:
            if self._range is not None:
                self._range.__exit__(None, None, None)
            name = ("draft" if self.k else "verify") if point == "begin" else NEXT_RANGE[point]
            self._range = torch.profiler.record_function(f"specpilot::{name}").__enter__() if name else None
        if point == "end":
            self.steps.append(self._close())

    def _close(self) -> dict:
        t, prev, out = self._t, "begin", {}
        for phase in DEVICE_PHASES:
            if phase not in t:
                out[phase] = 0.0
                continue
            out[phase] = self._ev[prev].elapsed_time(self._ev[phase]) / 1e3 if self.cuda else t[phase] - t[prev]
            prev = phase
        out["host_sync"] = t["synced"] - t["sync"]
        out["wall"] = t["end"] - t["begin"]
        # On CUDA the host waits while the device works: host sync overlaps the device phases, idle is the rest.
        busy = sum(out[p] for p in DEVICE_PHASES) + (0.0 if self.cuda else out["host_sync"])
        out["idle"] = out["wall"] - busy
        return out

    def mean(self) -> dict:
        """Mean of each phase over the fastest TRIM of steps (by wall time), so the phases still add up."""
        steps = sorted(self.steps, key=lambda s: s["wall"])[: max(1, round(TRIM * len(self.steps)))]
        return {p: sum(s[p] for s in steps) / max(1, len(steps)) for p in PHASES + ("wall",)}


def trimmed_mean(values: list[float]) -> float:
    """Every step does the same work (static shapes): the slowest steps are other load, not the step."""
    kept = sorted(values)[: max(1, round(TRIM * len(values)))]
    return sum(kept) / max(1, len(kept))


def loop_steps(rows_by_batch: list[list]) -> list[float]:
    """Each step's time in the engine's loop: the gaps between the arrival times of successive steps' tokens."""
    out = []
    for rows in rows_by_batch:
        times = sorted({t for r in rows for t in r.token_times})  # the first is the prefill's token
        out += [b - a for a, b in zip(times, times[1:])]
    return out
