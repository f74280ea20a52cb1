"""`specpilot bench`: every system side by side in one process, on the same prompts, in alternating order.

Systems: the same engine's AR (`ar`, the reference), the `stock` recipe, each `--recipe`, and with `--baselines hf`
HF transformers (hf_baselines.py). For each workload and batch size (a cell) the requests are split in order into
batches; every system first decodes a warm-up (not counted), then each batch is decoded by every system in an order
rotated per batch, so that drift (clocks, caches, other load) hits all systems alike. On CUDA each timed call
follows a lead-in, the system's own warm-up batch decoded again untimed for `--lead-in` seconds: a GPU's clocks
follow the load of the last few hundred milliseconds, so without it a system was timed in the state its predecessor
left (after `stock`'s light steps the next system's steps ran 2% faster for its first 0.1-0.2 s, and the rotation
kept that neighbour: forty-seventh lease). A system that fails in a cell becomes an error entry; the others are
still measured. results.json is rewritten after every cell.

Isolation (docs/BENCH.md, "A bench that survives a fault"): on CUDA this process does not load the model. A worker
process, `python -m specpilot.tools.bench.worker` (worker.py), loads the target and the systems once and measures the
cells in order (all systems of a cell in that one process), sending back one JSON line per finished cell and one
before and after each system's call. A system that leaves the CUDA context dead (the worker finds a tiny CUDA op
failing after the system raised) or kills the worker (a signal, an exit) becomes that system's error entry for that
cell; a fresh worker measures the cell again without it and goes on with the remaining cells. On CPU the bench runs
in this process unless asked otherwise (measure(isolate=True), or SPECPILOT_BENCH_ISOLATE=1; =0 turns it off on CUDA).

A recipe that names candidate kernel files (`kernels.<slot>` a .py path, not a built-in) is candidate code: this
process never imports it. The whole bench (every system, so that the comparison stays in one process) then runs in a
sandboxed child, `python -m specpilot.tools.bench.run` through tools/sandbox/process.run_python, with the same
arguments; the recipes travel in its payload with their kernel paths made absolute, and the child's last stdout
line is its results (JSON), from which this process writes results.json, the report and the summary. The sandbox is
handed in by the caller (`run_bench(args, sandbox=process)`): tools/bench may not import tools/sandbox
(tests/test_layering.py). Without one, such a recipe is refused (docs/BENCH.md, "Candidate code").
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ..argtypes import (add_device_arguments, add_target_argument, check, non_negative_float, positive_float,
                        positive_int, positive_int_list)
from ...engine import loader, packaged
from ...engine.errors import SpecPilotError
from ...engine.recipe import Recipe, load_recipe, parse, reported_name, with_absolute_paths
from ...engine.workloads import Question, absolute_spec, load_workload
from ...kernels import is_candidate_path
from . import report as bench_report
from .env import git_commit, header
from .metrics import compare_to_ar, summarize
from .prompt_requests import BenchRequest, build_requests
from .systems import BatchRun, BenchSkip, EngineSystem, System, memory_kind
from .hf_baselines import HF_SYSTEMS, HFSystem, load_hf_model

SCHEMA = "specpilot-bench/1"
BASELINES = ("hf", "hf-static", "none")
LEAD_IN_S = 0.3  # seconds of a system's own untimed decoding before each timed call on CUDA (`--lead-in`)


def hf_systems(baselines: str) -> tuple[str, ...]:
    """The HF baselines `--baselines` asks for: hf both, hf-static the static cache alone (HF's prompt lookup
    decodes one row at a time: slow to measure at large batches)."""
    return {"hf": HF_SYSTEMS, "hf-static": ("hf-static",)}.get(baselines, ())
CHILD = "specpilot.tools.bench.run"  # the sandboxed child's module (main() below)
SANDBOX_TIMEOUT_S = 3 * 3600.0  # the default wall-clock limit of a sandboxed bench
WORKER = "specpilot.tools.bench.worker"  # the isolated bench's worker (worker.py; named, not imported: it imports us)
ISOLATE_ENV = "SPECPILOT_BENCH_ISOLATE"  # 1: cells in a worker process, 0: in this process (default: 1 on CUDA only)
FAULT_EXIT = 3  # a worker's exit status after it reported a system that left the CUDA context dead
STDERR_LINES = 50  # a worker's last stderr lines kept for the message of its death


def add_arguments(b: argparse.ArgumentParser) -> None:
    """`specpilot bench`'s flags: the CLI's subcommand and `parse_args` (callers in code) share them."""
    add_target_argument(b, default="smollm2-135m")
    b.add_argument("--recipe", action="append", default=[],
                   help="recipe JSON file to measure besides ar and stock (repeatable)")
    b.add_argument("--workload", default="code",
                   help="comma-separated: code, chat, math, summarize, rag, FILE.jsonl or FILE.jsonl:category")
    b.add_argument("--batch-sizes", type=positive_int_list, default=[1],
                   help="comma-separated batch sizes, e.g. 1,8,32")
    b.add_argument("--max-new-tokens", type=positive_int, default=128)
    b.add_argument("--limit", type=positive_int, default=None, help="first K questions of each workload")
    b.add_argument("--cell-requests", type=positive_int, default=None,
                   help="each (workload, batch size) cell decodes only its first max(N, batch size) requests: "
                        "keeps B = 1 cells of slow baselines short while B = 32 still gets 32")
    b.add_argument("--waves", type=positive_int, default=1,
                   help="each cell decodes at least W x B requests (the workload's repeated where it has fewer): "
                        "with continuous batching, W waves of requests through the B rows")
    b.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous (default): a cell's requests are one timed call, B at once, a finished "
                        "request's row taking the next (HF baselines: batches of B, in order); static: each batch "
                        "of B a timed call of its own")
    b.add_argument("--repeats", type=positive_int, default=1,
                   help="times each timed call is measured per system (median kept)")
    b.add_argument("--lead-in", type=non_negative_float, default=LEAD_IN_S,
                   help="on CUDA, seconds of each system's own untimed decoding (its warm-up batch again) right "
                        "before each of its timed calls, so that it is timed in the clocks its own load leaves, not "
                        "the previous system's (0: none)")
    b.add_argument("--baselines", default="none",
                   help="hf: add HF transformers static-cache AR and prompt lookup; hf-static: only the first")
    b.add_argument("--ignore-eos", action="store_true", help="always generate exactly --max-new-tokens tokens")
    add_device_arguments(b)
    b.add_argument("--out", default=None, help="output directory (default: runs/bench-<timestamp>)")
    b.add_argument("--resume", action="store_true",
                   help="continue the bench whose results.json is in --out (one stopped at a time limit, or this "
                        "one with more batch sizes or workloads): its finished cells are kept, the others measured; "
                        "the commit and every setting of how a cell is measured must be the same (none there: a "
                        "fresh run)")
    b.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is no TTY")
    b.add_argument("--sandbox-timeout", type=positive_float, default=SANDBOX_TIMEOUT_S,
                   help="seconds before a bench of candidate kernel files, which runs in a sandboxed child, is killed")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The bench's arguments from flags, as `specpilot bench FLAGS` would parse them (for the agent tools and the
    graph, which must not import the CLI); a bad value raises SpecPilotError naming it."""
    parser = argparse.ArgumentParser(prog="specpilot bench", exit_on_error=False)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise SpecPilotError(f"bench arguments {argv}: {e}") from None
    args.argv = ["bench", *argv]
    return args


def parse_batch_sizes(value: str | list[int]) -> list[int]:
    """The CLI's --batch-sizes arrives parsed (argtypes.positive_int_list); a caller in code may give the text."""
    if isinstance(value, str):
        return check(positive_int_list, "--batch-sizes", value)
    return [check(positive_int, "--batch-sizes", b) for b in dict.fromkeys(value)]


def load_workloads(text: str, limit: int | None) -> dict[str, list[Question]]:
    """Every workload's questions, read before any model is loaded so that bad input fails at once."""
    specs = [w.strip() for w in text.split(",") if w.strip()]
    if not specs:
        raise SpecPilotError("--workload: no workload given")
    return {spec: load_workload(spec, limit) for spec in dict.fromkeys(specs)}


def recipes_to_measure(specs: list[str], target: str | None, stock: Recipe | None = None) -> list[tuple[str, Recipe]]:
    """(system name, recipe): ar and stock always (stock: the target's, engine/recipe.stock_recipe, unless given),
    then each --recipe; a repeated name gets a numeric suffix, and a replay recipe's name says `replay` (its
    acceptance is replayed from a profile, engine/replay.py)."""
    chosen = [("ar", load_recipe("ar")), ("stock", stock or load_recipe("stock", target))]
    for spec in specs:
        if spec in ("ar", "stock"):  # measured anyway
            continue
        recipe = load_recipe(spec, target)
        names = {name for name, _ in chosen}
        base = reported_name(recipe.name, recipe.drafter.kind)
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        chosen.append((name, recipe))
    return chosen


class Bench:
    def __init__(self, args, out: Path, head: dict):
        self.args, self.out = args, out
        self.results = {"schema": SCHEMA, "header": head, "runs": [], "errors": []}

    def error(self, system: str | None, workload: str | None, batch_size: int | None, message: str) -> None:
        self.results["errors"].append({"system": system, "workload": workload, "batch_size": batch_size,
                                       "message": message})
        print(f"specpilot: warning: {message}", file=sys.stderr)

    def write(self) -> None:
        """Atomic rewrite, so that an interrupted run leaves the last complete file."""
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1) + "\n")
        os.replace(tmp, self.out / "results.json")

    # What a bench worker (worker.py) tells its parent; in this process they do nothing more than the lines say.
    def running(self, system: str | None, workload: str, batch_size: int) -> None:
        """`system`'s call (warm-up, prepare or a timed decode) starts; None: it has ended."""

    def building(self, systems: list[str]) -> None:
        """These systems are being built (an engine, or the HF model both HF baselines share)."""

    def system_failed(self, system: System, workload: str, batch_size: int, message: str) -> None:
        """`system` raised in this cell: its error entry."""
        self.error(system.name, workload, batch_size, message)

    def _try(self, system: System, workload: str, batch_size: int, prompts: list[list[int]]) -> BatchRun | None:
        self.running(system.name, workload, batch_size)
        try:
            return system.run(prompts, self.args.max_new_tokens, self.args.ignore_eos, concurrency=batch_size)
        except BenchSkip as e:
            self.error(system.name, workload, batch_size, str(e))
        except Exception as e:  # one broken system must not cost the others their measurements
            self.system_failed(system, workload, batch_size, f"{system.name}: {type(e).__name__}: {e}")
        finally:
            self.running(None, workload, batch_size)
        return None

    def _lead_in(self, system: System, workload: str, batch_size: int, prompts: list[list[int]]) -> bool:
        """Untimed decodes of `prompts` by `system` for at least the lead-in's seconds (at least one) right before a
        timed call of it, on CUDA: what the device does just before a call (its clocks, its power) is then this
        system's own load, whichever system ran before. False when one of them failed (its error entry made)."""
        seconds = lead_in_seconds(self.args)
        if seconds <= 0 or system.device.type != "cuda":
            return True
        t0 = time.perf_counter()
        while True:
            if self._try(system, workload, batch_size, prompts) is None:
                return False
            if time.perf_counter() - t0 >= seconds:
                return True

    def _prepare(self, system: System, workload: str, batch_size: int, batches: list[list[list[int]]]) -> bool:
        self.running(system.name, workload, batch_size)
        try:
            system.prepare(batches, self.args.max_new_tokens)
            # a fault of its warm-up work surfaces here, charged to it, not at the next system's first synchronize
            if system.device.type == "cuda":
                torch.cuda.synchronize(system.device)
            return True
        except Exception as e:  # a system that cannot warm up is an error entry, like one that cannot decode
            self.system_failed(system, workload, batch_size, f"{system.name}: warm-up: {type(e).__name__}: {e}")
            return False
        finally:
            self.running(None, workload, batch_size)

    def measure_cell(self, systems: list[System], workload: str, batch_size: int, requests: list[BenchRequest],
                     progress) -> None:
        units = cell_units(len(systems), len(requests), batch_size, self.args.cell_requests, self.args.repeats,
                           waves(self.args), continuous(self.args))
        # A cell larger than the workload takes its requests again, in order: each row decodes on its own, so a
        # repeated prompt is load like any other. The cell's runs say how many requests repeated.
        n_cell = cell_size(len(requests), batch_size, self.args.cell_requests, waves(self.args))
        repeated = max(0, n_cell - len(requests))
        requests = [requests[i % len(requests)] for i in range(n_cell)]
        done_before = progress.n
        prompts = [r.prompt for r in requests]
        batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
        # What is timed: continuous, the cell's requests in one call, B at once (each system batches them its own
        # way: our engine continuously, HF in batches of B); static, each batch of B a call of its own.
        timed = [prompts] if continuous(self.args) else batches
        # Warm-up: compiles, captured graphs and caches for every batch shape of the cell (the last may be short):
        # the system's own preparation first (it fixes shapes, e.g. HF's static cache length, so that the decodes
        # after it compile nothing new), then a decode of each batch shape.
        warm = batches[:1] + (batches[-1:] if len(batches[-1]) != batch_size else [])
        live, warmup_seconds = [], {}
        for s in systems:
            progress.set_postfix_str(f"{workload} B={batch_size} {s.name} warm-up")
            t0 = time.perf_counter()
            if self._prepare(s, workload, batch_size, batches) and all(
                    self._try(s, workload, batch_size, b) is not None for b in warm):
                live.append(s)
                warmup_seconds[s.name] = time.perf_counter() - t0
            progress.update(1)
        measured: dict[str, list[list[BatchRun]]] = {s.name: [[] for _ in timed] for s in live}
        for i, batch in enumerate(timed):
            for rep in range(self.args.repeats):
                shift = (i * self.args.repeats + rep) % max(len(live), 1)
                for s in live[shift:] + live[:shift]:
                    if s.name in measured:
                        progress.set_postfix_str(f"{workload} B={batch_size} {s.name}")
                        run = self._try(s, workload, batch_size, batch) \
                            if self._lead_in(s, workload, batch_size, warm[0]) else None
                        if run is None:
                            del measured[s.name]  # a partial set of batches would not be comparable
                        else:
                            measured[s.name][i].append(run)
                    progress.update(1)
        progress.update(units - (progress.n - done_before))
        self._add_runs(systems, workload, batch_size, measured, timed, repeated, warmup_seconds)

    def _add_runs(self, systems, workload, batch_size, measured: dict[str, list[list[BatchRun]]],
                  batches: list[list[list[int]]], repeated: int = 0, warmup_seconds: dict | None = None) -> None:
        # Per batch, the repeat of median time (the lower median for an even count), so that every figure of a
        # run comes from one actual decode.
        chosen = {name: [sorted(reps, key=lambda r: r.seconds)[(len(reps) - 1) // 2] for reps in per_batch]
                  for name, per_batch in measured.items()}
        ar_runs = chosen.get("ar")
        cell = {}
        for s in systems:
            if s.name in chosen:
                cell[s.name] = summarize(s.name, workload, batch_size, chosen[s.name], s.k, memory_kind(s.device),
                                         s.device.type == "cpu", self.args.repeats)
        for name, run in cell.items():
            compare_to_ar(run, chosen[name], cell.get("ar"), ar_runs)
            run["repeated_requests"] = repeated
            # what this cell's new shapes cost the system before its timing (its preparation and warm decodes; the
            # cells before it warmed theirs): a first request of this batch size and prompt width pays it
            run["warmup_seconds"] = (warmup_seconds or {}).get(name)
            run["tokens_per_s_repeats"] = repeat_throughputs(measured[name])
            # What was timed, request by request: the optimize graph judges these tokens against the reference
            # (tools/gate/timed.py), so a candidate cannot behave only while it is being checked.
            run["outputs"] = [{"prompt": prompt, "tokens": tokens, "finish": finish}
                              for r, batch in zip(chosen[name], batches)
                              for prompt, tokens, finish in zip(batch, r.tokens, r.finish_reasons)]
        self.results["runs"] += cell.values()
        self.write()


def repeat_throughputs(per_batch: list[list[BatchRun]]) -> list[float] | None:
    """A system's tok/s in each repeat of a cell (its timed calls of that repeat together), in the repeats' order:
    the systems ran each repeat one after another (the order rotated), so repeat r of two systems pair up, and the
    spread of their ratio over the repeats is the noise of the ratio the cell reports (issue #20: speculation is to
    hold 1.0x AR within it). None with one repeat, or where a call's repeats are missing."""
    counts = {len(reps) for reps in per_batch}
    if len(counts) != 1 or counts.pop() < 2:
        return None
    rounds = zip(*per_batch)
    return [sum(len(row) for r in runs for row in r.tokens) / sum(r.seconds for r in runs) for runs in rounds]


def lead_in_seconds(args) -> float:
    """`--lead-in`'s seconds (callers that build their own args may leave it out: the default)."""
    value = getattr(args, "lead_in", None)
    return LEAD_IN_S if value is None else float(value)


def continuous(args) -> bool:
    return getattr(args, "batching", "continuous") == "continuous"


def waves(args) -> int:
    return getattr(args, "waves", 1) or 1


def cell_size(n_requests: int, batch_size: int, cell_requests: int | None, waves: int = 1) -> int:
    """How many requests one cell decodes: all of the workload's, with --cell-requests N the first max(N, B); at
    least `waves` x B, the workload's requests repeated where it has fewer."""
    n = n_requests if cell_requests is None else min(n_requests, max(cell_requests, batch_size))
    return max(n, waves * batch_size)


def cell_units(n_systems: int, n_requests: int, batch_size: int, cell_requests: int | None, repeats: int,
               waves: int = 1, continuous: bool = False) -> int:
    """The progress bar's units of one cell: per system a warm-up and every timed call's repeats."""
    calls = 1 if continuous else -(-cell_size(n_requests, batch_size, cell_requests, waves) // batch_size)
    return n_systems * (1 + calls * repeats)


def build_systems(bench: Bench, target, recipes: list[tuple[str, Recipe]], baselines: str) -> list[System]:
    systems: list[System] = []
    for name, recipe in recipes:
        bench.building([name])
        systems.append(EngineSystem(name, target, recipe))
    names = hf_systems(baselines)
    if names:
        bench.building(list(names))
        try:
            hf_model = load_hf_model(target)
        except Exception as e:  # e.g. an architecture HF cannot build from this directory
            for name in names:
                bench.error(name, None, None, f"{name}: cannot run on this target: {type(e).__name__}: {e}")
        else:
            systems += [HFSystem(name, hf_model, target) for name in names]
    return systems


def candidate_files(recipe: Recipe) -> list[str]:
    """The candidate kernel source files a recipe names (empty: it runs package code only)."""
    return [impl for impl in recipe.kernels.values() if is_candidate_path(impl)]


def run_bench(args, sandbox=None) -> int:
    """`specpilot bench`. `sandbox`: tools/sandbox/process (the module), in which a bench of candidate code runs."""
    # Everything the user typed is checked before the (slow) model load.
    if args.baselines not in BASELINES:
        raise SpecPilotError(f"--baselines {args.baselines!r}: expected one of {', '.join(BASELINES)}")
    # The CLI's parser has checked these already; a caller that builds `args` in code gets the same words and exit.
    for flag in ("--max-new-tokens", "--repeats", "--limit", "--cell-requests"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            check(positive_int, flag, value)
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    workloads = load_workloads(args.workload, args.limit)
    recipes = recipes_to_measure(args.recipe or [], args.target)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/bench-{stamp}")
    resume = getattr(args, "resume", False)
    if resume and not args.out:
        raise SpecPilotError("--resume needs --out: the directory of the bench to continue")
    if resume and any(candidate_files(r) for _, r in recipes):
        raise SpecPilotError("--resume: a bench of candidate kernel files runs whole in its sandbox; run it again")
    carried = carried_cells(out, measurement_settings(args, dtype, recipes)) if resume else None

    if any(candidate_files(r) for _, r in recipes):
        results = bench_in_sandbox(args, list(workloads), recipes, device, dtype, sandbox)
        out.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, out, results["header"])
        bench.results = results
        for e in results["errors"]:
            print(f"specpilot: warning: {e['message']}", file=sys.stderr)
        bench.write()
        bench_report.write_report(out, results)
    elif carried is not None and all((w, b) in carried.cells for w in workloads for b in batch_sizes):
        print(f"specpilot: --resume: every cell asked for is in {out / 'results.json'}: nothing to measure",
              file=sys.stderr)
        bench = Bench(args, out, carried.header)
        bench.results = json.loads((out / "results.json").read_text())
        bench.write()
        bench_report.write_report(out, bench.results)
    else:
        bench = measure(args, batch_sizes, workloads, recipes, device, dtype, out, carried=carried)
    print(bench_report.summary_text(bench.results))
    plots = " and plots" if (out / bench_report.PLOTS[0]).is_file() else ""
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}{plots}")
    return 0


def isolation_wanted(device: str, isolate: bool | None = None) -> bool:
    """Whether measure() runs the cells in worker processes: `isolate` when given, else SPECPILOT_BENCH_ISOLATE (1 or
    0), else on CUDA only (a fault there is sticky: the context is dead for every later system; a CPU has none)."""
    if isolate is not None:
        return bool(isolate)
    value = os.environ.get(ISOLATE_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise SpecPilotError(f"{ISOLATE_ENV}={value!r}: expected 1 (cells in a worker process) or 0 (in this process)")
    return device.startswith("cuda")


def measure(args, batch_sizes, workloads, recipes, device, dtype, out: Path, report: bool = True,
            isolate: bool | None = None, carried: "Carried | None" = None) -> Bench:
    """The bench: every cell measured (but those `carried` from the run it resumes), results.json rewritten after
    each, the report at the end (`report`). In worker processes when isolation is on (isolation_wanted: by default
    on CUDA), else in this process."""
    if isolation_wanted(device, isolate):
        return measure_in_workers(args, batch_sizes, workloads, recipes, device, dtype, out, report, carried)
    return measure_in_process(args, batch_sizes, workloads, recipes, device, dtype, out, report, carried)


# -- resuming a bench ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Carried:
    """What a resumed bench keeps of the results.json it continues: its finished cells (the bench writes a cell's
    runs together, after its last system), their runs and error entries, and that run's header."""

    cells: set[tuple[str, int]]
    runs: list[dict]
    errors: list[dict]
    header: dict

    def into(self, bench: "Bench") -> None:
        """The carried cells into a new run's results, first; its header names the run it continues and lists the
        workloads and batch sizes of both."""
        head = bench.results["header"]
        head["workloads"] = list(dict.fromkeys([*self.header.get("workloads", []), *head["workloads"]]))
        head["batch_sizes"] = list(dict.fromkeys([*self.header.get("batch_sizes", []), *head["batch_sizes"]]))
        head["resumed"] = {"date": self.header.get("date"), "device_name": self.header.get("device_name"),
                           "cells": [[w, b] for w, b in sorted(self.cells)]}
        bench.results["runs"] = self.runs + bench.results["runs"]
        bench.results["errors"] = self.errors + bench.results["errors"]


def measurement_settings(args, dtype: str, recipes) -> dict:
    """The header's fields that say how a cell is measured (env.header's names and values): a resumed bench must
    match the run it continues in each, its commit included; which cells it has may differ."""
    commit, dirty = git_commit()
    return json.loads(json.dumps({
        "git_commit": commit, "git_dirty": dirty, "target": args.target, "dtype": dtype,
        "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos, "repeats": args.repeats,
        "limit": args.limit, "cell_requests": getattr(args, "cell_requests", None), "waves": waves(args),
        "batching": getattr(args, "batching", "continuous"), "lead_in_s": lead_in_seconds(args),
        "recipes": {name: dataclasses.asdict(r) for name, r in recipes}}))


def carried_cells(out: Path, settings: dict) -> "Carried | None":
    """The finished cells of `out`/results.json, for a bench with these `measurement_settings`; None where there is
    no such file (the run starts fresh); SpecPilotError naming the first setting that differs."""
    path = out / "results.json"
    if not path.is_file():
        print(f"specpilot: --resume: no {path} yet: a fresh run", file=sys.stderr)
        return None
    try:
        previous = json.loads(path.read_text())
        head, runs, errors = previous["header"], previous["runs"], previous["errors"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecPilotError(f"--resume: {path} is not a bench's results ({type(e).__name__}: {e})") from None
    for key, value in settings.items():
        if head.get(key) != value:
            if key == "recipes":
                names = sorted(n for n in {*value, *head.get(key, {})} if value.get(n) != head.get(key, {}).get(n))
                raise SpecPilotError(f"--resume: {path} measured other recipes (differing: {', '.join(names)}); "
                                     "give another --out")
            raise SpecPilotError(f"--resume: {path} was measured with {key} {head.get(key)!r}, this run has "
                                 f"{value!r}; give another --out")
    cells = {(r["workload"], r["batch_size"]) for r in runs}
    kept = [e for e in errors if (e.get("workload"), e.get("batch_size")) in cells]
    print(f"specpilot: --resume: {len(cells)} finished cells kept from {path}", file=sys.stderr)
    return Carried(cells, runs, kept, head)


def measure_in_process(args, batch_sizes, workloads, recipes, device, dtype, out: Path, report: bool = True,
                       carried: Carried | None = None) -> Bench:
    """The bench in this process: load, measure every cell (but the `carried` ones), results.json after each (and the
    report at the end)."""
    from tqdm import tqdm

    done = carried.cells if carried else set()
    workloads = {w: qs for w, qs in workloads.items() if any((w, b) not in done for b in batch_sizes)}
    target = loader.load(args.target, dtype, device)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, out, header(args, target.model.device, dtype, list(workloads), batch_sizes, recipes))
    if carried:
        carried.into(bench)
    systems = build_systems(bench, target, recipes, args.baselines)
    reference = systems[0]  # ar: its greedy first answers go into the multi-turn prompts
    requests = {w: build_requests(qs, target.tokenizer, lambda p: reference.answer(p, args.max_new_tokens))
                for w, qs in workloads.items()}
    total = sum(cell_units(len(systems), len(rs), b, args.cell_requests, args.repeats, waves(args),
                           continuous(args))
                for w, rs in requests.items() for b in batch_sizes if (w, b) not in done)
    bench.write()
    try:
        with tqdm(total=total, desc="bench", unit="decode", file=sys.stderr,
                  disable=not (args.progress or sys.stderr.isatty())) as progress:
            for workload, reqs in requests.items():
                for b in batch_sizes:
                    if (workload, b) not in done:
                        bench.measure_cell(systems, workload, b, reqs, progress)
    finally:
        bench.write()
        if report:
            bench_report.write_report(out, bench.results)
    return bench


# -- isolation: the cells in worker processes ----------------------------------------------------------------------

@dataclasses.dataclass
class WorkerEnd:
    """How one worker process ended, as far as its lines and its exit status tell."""

    how: str  # done | fault (a system left the CUDA context dead) | failed (the bench itself raised) | died
    phase: str  # what it was doing: load, build (systems), requests (ar's answers for later turns), cells
    systems: list[str]  # whose code was running: the systems being built, or the one whose call was in progress
    message: str  # one line, for an end other than done


def exit_description(status: int | None) -> str:
    """'killed by SIGSEGV' for a signal, else the exit status."""
    if status is not None and status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"ended with exit status {status} before it had finished"


def last_words(lines) -> str:
    """The line of a worker's stderr that says most about its end: Python's fatal error line (faulthandler, which
    the worker enables, writes a traceback after it), else the last line it wrote."""
    lines = [line.strip() for line in lines if line.strip()]
    fatal = [line for line in lines if line.startswith("Fatal Python error")]
    return one_line((fatal or lines or ["no output on stderr"])[-1], 300)


def forward_stderr(stream, tail: collections.deque, write) -> None:
    """The worker's stderr goes on to ours as it comes (warnings, tracebacks), its last lines kept for messages."""
    for line in stream:
        tail.append(line)
        write(line.rstrip("\n"))


class WorkerRun:
    """The parent's side of an isolated bench: starts a worker (normally one for the whole run), writes results.json
    from its lines, and after a worker's fault or death decides what the next one measures. Every restart either
    leaves one more system out of one cell, leaves a cell or a system out of the run, or stops it, so there are
    finitely many."""

    def __init__(self, args, batch_sizes, workloads, recipes, device, dtype, out: Path, progress,
                 carried: Carried | None = None):
        self.carried = carried
        done = carried.cells if carried else set()
        self.cells = [(w, b) for w in workloads for b in batch_sizes if (w, b) not in done]
        workloads = {w: qs for w, qs in workloads.items() if any(w == c for c, _ in self.cells)}
        self.args, self.batch_sizes, self.workloads, self.recipes = args, batch_sizes, workloads, recipes
        self.device, self.dtype, self.out, self.progress = device, dtype, out, progress
        self.next_cell = 0  # the first cell no worker has finished
        self.skip: dict[int, set[str]] = {}  # cell -> the systems left out of it: each faulted there once
        self.left_out: set[str] = set()  # systems left out of the run: building them killed a worker
        self.requests: dict | None = None  # every cell's prompts, built once by the first worker, handed to the next
        self.bench: Bench | None = None  # made when the first worker reports its header
        self.early_errors: list[dict] = []  # errors recorded before any header
        self.units_done = 0  # progress units of the finished cells
        self.workers = 0

    def error(self, system: str | None, workload: str | None, batch_size: int | None, message: str) -> None:
        if self.bench is not None:
            self.bench.error(system, workload, batch_size, message)
        else:
            self.early_errors.append({"system": system, "workload": workload, "batch_size": batch_size,
                                      "message": message})
            print(f"specpilot: warning: {message}", file=sys.stderr)

    def config(self) -> dict:
        """What the next worker measures: the cells from next_cell on, each without the systems that faulted there."""
        hf = bool(hf_systems(self.args.baselines)) and not self.left_out & set(HF_SYSTEMS)
        return {
            "parent": os.getpid(), "device": self.device, "dtype": self.dtype, "batch_sizes": self.batch_sizes,
            "args": {"target": self.args.target, "max_new_tokens": self.args.max_new_tokens,
                     "ignore_eos": self.args.ignore_eos, "repeats": self.args.repeats, "limit": self.args.limit,
                     "cell_requests": getattr(self.args, "cell_requests", None), "waves": waves(self.args),
                     "lead_in": lead_in_seconds(self.args),
                     "batching": getattr(self.args, "batching", "continuous"),
                     "baselines": self.args.baselines if hf else "none",
                     "argv": list(getattr(self.args, "argv", None) or sys.argv[1:])},
            "workloads": {w: [[q.question_id, q.category, list(q.turns)] for q in qs]
                          for w, qs in self.workloads.items()},
            "recipes": [[name, dataclasses.asdict(r)] for name, r in self.recipes if name not in self.left_out],
            "cells": [[w, b, sorted(self.skip.get(i, ()))] for i, (w, b) in enumerate(self.cells)
                      if i >= self.next_cell],
            "requests": self.requests,
        }

    def run(self) -> None:
        """Workers until every cell is measured, skipped, or the run is stopped by a worker that cannot start."""
        while self.next_cell < len(self.cells):
            end = self.run_worker()
            if end.how == "done" or self.next_cell == len(self.cells):  # an end after the last cell costs nothing
                return
            if end.how == "failed":  # the bench's own error, as the in-process bench would raise it
                raise SpecPilotError(end.message)
            if end.phase == "cells":
                w, b = self.cells[self.next_cell]
                if end.systems:
                    [name] = end.systems
                    what = end.message if end.how == "fault" else f"{name}: {end.message}"  # a fault's names it
                    self.error(name, w, b, f"{what}; the cell is measured again without {name} in a fresh worker")
                    self.skip.setdefault(self.next_cell, set()).add(name)
                else:
                    self.error(None, w, b, f"{end.message}, between systems' calls: cell not measured")
                    self.next_cell += 1
            elif end.phase == "build" and "ar" not in end.systems:
                # ar is every comparison's reference and answers the earlier turns: without it the run stops (below)
                for name in end.systems:
                    self.error(name, None, None, f"{name}: {end.message} while {', '.join(end.systems)} "
                                                 f"{'was' if len(end.systems) == 1 else 'were'} being built: left out "
                                                 "of the run")
                self.left_out.update(end.systems)
            else:
                doing = {"load": "while loading the target", "requests": "while ar answered the earlier turns",
                         "build": "while building ar"}[end.phase]
                for w, b in self.cells[self.next_cell:]:
                    self.error(None, w, b, f"{end.message} {doing}: not measured")
                self.next_cell = len(self.cells)

    def run_worker(self) -> WorkerEnd:
        """One worker, from its start to its end; its lines update results.json and the progress bar as they come."""
        from tqdm import tqdm

        self.workers += 1
        tail: collections.deque = collections.deque(maxlen=STDERR_LINES)
        # same interpreter, environment and working directory: relative paths in recipes and workloads still hold
        proc = subprocess.Popen([sys.executable, "-m", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace")
        forwarder = threading.Thread(target=forward_stderr, args=(proc.stderr, tail,
                                                                  lambda s: tqdm.write(s, file=sys.stderr)),
                                     daemon=True)
        forwarder.start()
        phase, systems, end = "load", [], None
        try:
            try:
                proc.stdin.write(json.dumps(self.config()))
                proc.stdin.close()
            except OSError:  # it died before reading: its exit status says how
                pass
            for line in proc.stdout:
                try:
                    event = json.loads(line)
                    kind = event["event"]
                except (ValueError, TypeError, KeyError):  # not a protocol line (printed before the worker took
                    tqdm.write(line.rstrip("\n"), file=sys.stderr)  # its stdout): shown, not obeyed
                    continue
                if kind == "building":
                    phase, systems = "build", event["systems"]
                elif kind == "requests":
                    phase, systems = "requests", ["ar"]
                elif kind == "ready":
                    phase, systems = "cells", []
                    self.on_ready(event)
                elif kind == "running":
                    systems = [event["system"]] if event["system"] else []
                elif kind == "postfix":
                    self.progress.set_postfix_str(event["text"])
                elif kind == "progress":
                    self.progress.update(event["n"])
                elif kind == "cell":
                    self.on_cell(event)
                elif kind == "fault":
                    end = WorkerEnd("fault", "cells", [event["system"]], event["message"])
                elif kind == "failed":
                    end = WorkerEnd("failed", phase, systems, event["message"])
                elif kind == "done":
                    end = WorkerEnd("done", phase, [], "")
            status = proc.wait()
            forwarder.join(timeout=10)
        finally:
            if proc.poll() is None:  # this process is leaving (an exception, ^C): the worker goes with it
                proc.kill()
                proc.wait()
        if end is None:
            end = WorkerEnd("died", phase, systems, f"the bench worker was {exit_description(status)} "
                                                    f"(stderr: {last_words(tail)})")
        return end

    def on_ready(self, event: dict) -> None:
        """The worker has loaded the target and built its systems; the first one's header is the run's."""
        if self.bench is None:
            self.out.mkdir(parents=True, exist_ok=True)
            # every system's recipe, those the first worker to report left out after a fault included
            head = {**event["header"], "recipes": {name: dataclasses.asdict(r) for name, r in self.recipes}}
            self.bench = Bench(self.args, self.out, head)
            # the worker printed its own errors (an HF baseline that cannot be built); later workers repeat them
            self.bench.results["errors"] = self.early_errors + event["errors"]
            if self.carried:
                self.carried.into(self.bench)
        if self.requests is None:
            self.requests = event["requests"]
        self.progress.total = self.units_done + event["units"]
        self.progress.n = self.units_done
        self.progress.refresh()
        self.bench.write()

    def on_cell(self, event: dict) -> None:
        w, b = self.cells[self.next_cell]
        if (event["workload"], event["batch_size"]) != (w, b):
            raise SpecPilotError(f"the bench worker answered cell {event['workload']} B={event['batch_size']} where "
                                 f"{w} B={b} was next")
        self.bench.results["runs"] += event["runs"]
        self.bench.results["errors"] += event["errors"]  # printed by the worker already
        self.units_done += event["units"]
        self.progress.n = self.units_done
        self.progress.refresh()
        self.next_cell += 1
        self.bench.write()

    def finish_without_header(self) -> None:
        """No worker reported a header (each ended before loading): a results.json all the same, with the errors, its
        header built here from the settings. This process does not touch the GPU: the device is named as given."""
        if self.bench is not None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        head = header(self.args, torch.device("cpu"), self.dtype, list(self.workloads), self.batch_sizes,
                      self.recipes)
        if self.device != "cpu":
            head.update(device=self.device, device_name=f"unknown (no bench worker reached the {self.device} device)",
                        cuda=torch.version.cuda)
        self.bench = Bench(self.args, self.out, head)
        self.bench.results["errors"] = self.early_errors
        if self.carried:
            self.carried.into(self.bench)


def measure_in_workers(args, batch_sizes, workloads, recipes, device, dtype, out: Path, report: bool = True,
                       carried: Carried | None = None) -> Bench:
    """The bench with its cells in worker processes (WorkerRun): results.json after each cell, the report at the end,
    as measure_in_process writes them."""
    from tqdm import tqdm

    with tqdm(total=0, desc="bench", unit="decode", file=sys.stderr,
              disable=not (getattr(args, "progress", False) or sys.stderr.isatty())) as progress:
        run = WorkerRun(args, batch_sizes, workloads, recipes, device, dtype, out, progress, carried)
        try:
            run.run()
            run.finish_without_header()
        finally:
            if run.bench is not None:
                run.bench.write()
                if report:
                    bench_report.write_report(out, run.bench.results)
    return run.bench


# -- candidate code: the bench in a sandboxed child -----------------------------------------------------------------

def absolute_workload(spec: str) -> str:
    """A --workload spec as the child (another cwd) must see it."""
    return absolute_spec(spec)


def recipe_for_child(recipe: Recipe) -> dict:
    """The recipe as JSON with its kernel files and draft model made absolute (the child runs in its own temp dir)."""
    return dataclasses.asdict(with_absolute_paths(recipe))


def child_caches() -> dict[str, str]:
    """HOME is the child's temp dir: where the models and the caches live, named explicitly."""
    hf = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return {"SPECPILOT_CACHE": str(loader.cache_root()), "SPECPILOT_MODELS": str(packaged.models_dir()),
            "HF_HOME": hf}


def child_memory_bytes(cuda: bool) -> int | None:
    """No address-space cap on CUDA (the driver reserves huge virtual ranges); on CPU the machine's memory."""
    if cuda:
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def sandbox_failure(r) -> str:
    """One line: how the child ended without a result, and the last line it wrote on stderr."""
    tail = (r.stderr_tail or "").strip()
    last = tail.splitlines()[-1][-300:] if tail else "no output on stderr"
    if r.kind == "timeout":
        how = f"killed after {r.seconds:.0f} s (its wall-clock limit)"
    elif r.kind in ("crash", "signal"):
        how = f"killed by {r.signal}"
    elif r.kind == "oom":
        how = "out of memory" + (f" (killed by {r.signal})" if r.signal else "")
    elif r.kind == "exception":
        how = f"exit status {r.returncode}"
    else:
        how = "no JSON result on its last stdout line"
    return f"{how}: {last}"


def one_line(text: str, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def child_result(r, what: str) -> dict:
    """The child's JSON result, or SpecPilotError naming how it failed."""
    if r.kind == "ok" and isinstance(r.output, dict):
        if "error" in r.output:
            raise SpecPilotError(f"{what} in the sandbox: {one_line(r.output['error'])}")
        return r.output
    raise SpecPilotError(f"{what} in the sandbox failed: {sandbox_failure(r)}")


def bench_in_sandbox(args, workloads: list[str], recipes: list[tuple[str, Recipe]], device: str, dtype: str,
                     sandbox) -> dict:
    """The bench of `recipes` in a sandboxed child; its results (data only: no candidate module is imported here)."""
    files = [f for _, r in recipes for f in candidate_files(r)]
    if sandbox is None:
        raise SpecPilotError(f"recipe names candidate kernel files ({', '.join(files)}): they run only in the sandbox, "
                             "and none was given (run_bench(args, sandbox=specpilot.tools.sandbox.process))")
    names = {absolute_workload(w): w for w in workloads}  # the child's name of each workload -> the one given
    # the model's directory is found (a GGUF dequantized into the cache) here, on package code only: the child's
    # filesystem may be read-only outside its temp dir, and a candidate must not write the shared cache
    argv = [f"--target={loader.source_dir(args.target).resolve()}", f"--workload={','.join(names)}",
            f"--batch-sizes={','.join(str(b) for b in parse_batch_sizes(args.batch_sizes))}",
            f"--max-new-tokens={args.max_new_tokens}", f"--repeats={args.repeats}", f"--baselines={args.baselines}",
            f"--device={device}", f"--dtype={dtype}"]
    argv += [f"--limit={args.limit}"] if args.limit else []
    argv += [f"--cell-requests={args.cell_requests}"] if args.cell_requests else []
    argv += [f"--waves={waves(args)}", f"--batching={getattr(args, 'batching', 'continuous')}"]
    argv += ["--ignore-eos"] if args.ignore_eos else []
    # ar and stock come first and the child adds them itself (recipes_to_measure), with the target's stock as
    # resolved here (the child sees the target's directory, not the name a packaged head is known by); the rest go
    # as JSON
    # isolation as decided here (SPECPILOT_BENCH_ISOLATE is not in the sandbox's environment): on CUDA the child's
    # cells run in a worker process of its own, inside the same sandbox
    payload = {"argv": argv, "recipes": [recipe_for_child(r) for _, r in recipes[2:]],
               "stock": recipe_for_child(recipes[1][1]),
               "command": list(getattr(args, "argv", None) or sys.argv[1:]), "isolate": isolation_wanted(device)}
    cuda = device.startswith("cuda")
    limits = sandbox.SandboxLimits(wall_s=float(getattr(args, "sandbox_timeout", None) or SANDBOX_TIMEOUT_S),
                                   memory_bytes=child_memory_bytes(cuda), gpu=cuda)
    print(f"specpilot: bench: a recipe names candidate kernel files ({', '.join(files)}): running in the sandbox",
          file=sys.stderr)
    r = sandbox.run_python([CHILD], payload, limits, env=child_caches())
    results = child_result(r, "the bench")
    import jsonschema

    try:  # the child's answer is data from a process that ran candidate code: its shape is checked before any use
        jsonschema.validate(results.get("results"), json.loads((Path(__file__).parent / "schema.json").read_text()),
                            cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError as e:
        raise SpecPilotError(f"the bench in the sandbox returned results that do not match schema.json: "
                             f"{one_line(e.message, 200)}") from None
    results = results["results"]
    # as given, not as the child saw them: the target, not the directory it resolved to; relative workload files
    if isinstance(results.get("header"), dict):
        results["header"]["target"] = args.target
        results["header"]["workloads"] = workloads
    for entry in results["runs"] + results["errors"]:
        if isinstance(entry, dict) and entry.get("workload") in names:
            entry["workload"] = names[entry["workload"]]
    return results


def main() -> int:
    """The sandboxed child: the payload {"argv", "recipes", "stock", "command", "isolate"} on stdin, the results as
    the last stdout line."""
    payload = json.load(sys.stdin)
    work = Path.cwd()  # the sandbox's temp dir
    try:
        paths = []
        for i, data in enumerate(payload["recipes"]):
            paths.append(work / f"recipe-{i}.json")
            paths[-1].write_text(json.dumps(data))
        args = parse_args([*payload["argv"], *[f"--recipe={p}" for p in paths], f"--out={work / 'out'}"])
        args.argv = payload["command"]
        with contextlib.redirect_stdout(sys.stderr):
            bench = measure(args, parse_batch_sizes(args.batch_sizes), load_workloads(args.workload, args.limit),
                            recipes_to_measure(args.recipe, args.target, parse(payload["stock"])), args.device,
                            args.dtype, work / "out", report=False,
                            isolate=payload.get("isolate"))
        answer = {"results": bench.results}
    except Exception as e:  # noqa: BLE001 - the parent reports it as one line
        answer = {"error": one_line(f"{type(e).__name__}: {e}")}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
