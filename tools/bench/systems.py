"""The systems a benchmark compares, behind one interface: decode a batch of prompts, report what happened when.

Every system is timed the same way (`measured`): device synchronized before and after, wall clock around the whole
call (prefill, decoding, host work), process CPU time, and peak memory. Our engine runs each recipe; the HF
baselines live in hf_baselines.py.
"""
from __future__ import annotations

import resource
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ...engine.engine import Engine
from ...engine.loader import LoadedModel
from ...engine.recipe import Recipe
from . import step_events


@dataclass
class BatchRun:
    """One measured decode of one batch by one system."""

    tokens: list[list[int]]  # per row, the generated tokens (EOS included when it stopped the row)
    token_times: list[list[float]]  # per row, seconds from the call's start at which each token arrived
    accepted: list[list[int]]  # per row, drafts accepted at each verification step (0 for plain AR steps)
    finish_reasons: list[str]  # per row: eos, length
    seconds: float = 0.0  # wall time of the whole call, device synchronized
    cpu_seconds: float = 0.0  # process CPU time of the call (all threads)
    peak_memory_bytes: int = 0
    captures: int = 0  # step or prefill shapes our engine captured (compiled) inside this timed call, for an HF
    # baseline the graphs torch.compile built in it: should be 0
    step_kinds: dict[int, int] = field(default_factory=dict)  # our engine: steps run of each kind k' (0: AR steps)
    step_prices: dict[int, float] = field(default_factory=dict)  # with the batch controller: seconds of each kind of
    # step at the batch's bucket, as the warm-up's graph replays priced them
    step_loop_seconds: dict[int, float] = field(default_factory=dict)  # and as the decoding loop timed them (the
    # moving average the controller decided with at the end of the call)
    shrinks: int = 0  # our engine: times the batch moved to a smaller bucket as its requests ran out
    steps: int = 0  # our engine: decoding steps, and live rows summed over them (the batch's occupancy)
    row_steps: int = 0
    step_log: list = field(default_factory=list)  # our engine: every step as its loop read it (engine.decode.StepRecord)
    refill_prefills: int = 0  # our engine: prefills that started waiting requests, and their device seconds
    refill_prefill_s: float = 0.0
    step_events: list = field(default_factory=list)  # our engine with SPECPILOT_STEP_EVENTS=1: each step's CUDA events
    # (tools/bench/step_events), read after the timing
    cache_slots: int | None = None  # our engine: slots a row of its static KV cache held in this call


class BenchSkip(Exception):
    """A system that cannot run a cell by design (not a failure of the system): recorded as an error entry."""


class System(ABC):
    """One measured system: our engine under a recipe, or an HF baseline."""

    name: str
    device: torch.device
    k: int = 0  # most drafts verified per step: the accepted-count histogram has k + 1 bins

    @abstractmethod
    def decode(self, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> BatchRun:
        """Generate for one batch; `run` adds time and memory."""

    def decode_all(self, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool,
                   concurrency: int) -> BatchRun:
        """Generate for `prompts`, at most `concurrency` at once: by default in batches of that size, in order, their
        token times on the clock of this call (a system with continuous batching overrides it)."""
        t0 = time.perf_counter()
        run = BatchRun([], [], [], [])
        for i in range(0, len(prompts), concurrency):
            offset = time.perf_counter() - t0
            part = self.decode(prompts[i: i + concurrency], max_new_tokens, ignore_eos)
            run.tokens += part.tokens
            run.token_times += [[offset + t for t in times] for times in part.token_times]
            run.accepted += part.accepted
            run.finish_reasons += part.finish_reasons
            run.captures += part.captures
            run.step_kinds = dict(Counter(run.step_kinds) + Counter(part.step_kinds))
            run.shrinks += part.shrinks
            run.steps += part.steps
            run.row_steps += part.row_steps
            run.step_log += part.step_log
            run.refill_prefills += part.refill_prefills
            run.refill_prefill_s += part.refill_prefill_s
        return run

    def run(self, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool,
            concurrency: int | None = None) -> BatchRun:
        """Decode and time `prompts`, at most `concurrency` (None: all) at once."""
        n = concurrency or len(prompts)
        return measured(lambda: self.decode_all(prompts, max_new_tokens, ignore_eos, n), self.device)

    def prepare(self, batches: list[list[list[int]]], max_new_tokens: int) -> None:
        """Capture and compile every shape these batches will run, before any of them is timed (default: nothing
        beyond the bench's warm-up decode)."""


def memory_kind(device: torch.device) -> str:
    return "gpu_allocated" if device.type == "cuda" else "process_rss"


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def measured(call, device: torch.device) -> BatchRun:
    """Run `call` (which returns a BatchRun with tokens filled in) and fill in its time and memory."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    cpu0, t0 = time.process_time(), time.perf_counter()
    run = call()
    if cuda:
        torch.cuda.synchronize(device)
    run.seconds = time.perf_counter() - t0
    run.cpu_seconds = time.process_time() - cpu0
    # On CPU the peak RSS cannot be reset: it is the process's peak so far (models of every system included).
    run.peak_memory_bytes = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss_bytes()
    return run


class EngineSystem(System):
    """Our engine under one recipe, on the shared loaded target."""

    def __init__(self, name: str, target: LoadedModel, recipe: Recipe):
        self.name, self.engine, self.k = name, Engine(target, recipe), recipe.k
        self.device = target.model.device
        self.eos = set(target.eos_token_ids)

    def prepare(self, batches, max_new_tokens) -> None:
        longest = max(len(p) for batch in batches for p in batch)
        self.engine.prepare([p for batch in batches for p in batch], max_new_tokens)  # (a replay drafter's AR)
        self.engine.warmup(sorted({len(batch) for batch in batches}), longest, max_new_tokens)

    def decode(self, prompts, max_new_tokens, ignore_eos) -> BatchRun:
        return self.decode_all(prompts, max_new_tokens, ignore_eos, len(prompts))

    def decode_all(self, prompts, max_new_tokens, ignore_eos, concurrency) -> BatchRun:
        """The engine's own batching: at most `concurrency` rows (and the recipe's max_batch_size), continuous where
        the drafter allows it; token times are on the clock of the engine's call."""
        captures = self.engine.decoder.captures
        events = step_events.ENABLED and self.device.type == "cuda"
        with step_events.bracketed(self.engine.decoder) if events else nullcontext([]) as marks:
            rows = self.engine.generate(prompts, max_new_tokens, ignore_eos=ignore_eos, max_batch=concurrency)
        run = BatchRun([r.tokens for r in rows], [r.token_times for r in rows], [r.accepted for r in rows],
                       [r.finish_reason for r in rows])
        run.captures = self.engine.decoder.captures - captures
        run.step_kinds = dict(sorted(Counter(self.engine.decoder.last_stats.draft_lengths).items()))
        decoder = self.engine.decoder
        bucket = decoder.last_stats.bucket  # (where the batch started: it may have drained to smaller ones)
        run.step_prices = dict(decoder.prices.get(bucket, {}))
        run.step_loop_seconds = dict(decoder.step_seconds.get(bucket, {}))
        run.shrinks = decoder.last_stats.shrinks
        run.steps, run.row_steps = decoder.last_stats.steps, decoder.last_stats.row_steps
        run.step_log = list(decoder.last_stats.step_log)
        run.step_events = marks[: len(run.step_log)]  # (a step launched ahead and never read has no record)
        run.refill_prefills, run.refill_prefill_s = decoder.last_stats.refill_prefills, decoder.last_stats.refill_prefill_s
        run.cache_slots = decoder.cache_slots
        return run

    def answer(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        """Greedy answer texts, stopping at EOS: the assistant turns of multi-turn prompts."""
        return [row.text for row in self.engine.generate(prompts, max_new_tokens)]
