"""The isolated bench's worker: loads the target and the systems once, then measures the cells it is given, in order.

    python -m specpilot.tools.bench.worker      (started by tools/bench/run.py, WorkerRun; not by hand)

Same interpreter, environment and working directory as the bench that starts it (inside the sandbox too, when the
bench runs there). All systems of a cell run in this one process, as in the in-process bench, so the comparisons of
a cell stay in one process. docs/BENCH.md, "A bench that survives a fault", says what the parent does with the lines.

stdin: one JSON object, WorkerRun.config(): the settings the bench needs (args, device, dtype, batch sizes), the
workloads' questions, the recipes as [system name, recipe], the cells as [workload, batch size, systems left out of
that cell], and every workload's requests when an earlier worker built them (so that every worker of a run decodes
the same prompts, ar's answers to earlier turns included). stdout: one JSON line per event, in this order:

    {"event": "building", "systems": [names]}     an engine (or the HF model both HF baselines share) is being built
    {"event": "requests"}                         ar answers the earlier turns of multi-turn questions
    {"event": "ready", "header", "errors", "requests", "units"}   loaded and built; the header is the run's
    {"event": "running", "system": name | null, "workload", "batch_size"}   before (name) and after (null) each call
    {"event": "postfix", "text"}, {"event": "progress", "n"}                 the parent's progress bar
    {"event": "cell", "workload", "batch_size", "runs", "errors", "units"}   a cell is finished
    {"event": "fault", "system", "workload", "batch_size", "message"}        then exit run.FAULT_EXIT
    {"event": "failed", "message"}                the bench itself raised (a bad target, a recipe that cannot be built)
    {"event": "done"}

A fault: a system raised in a cell and then a tiny CUDA op with a synchronize raises too. CUDA errors such as an
illegal memory access or an unspecified launch failure are sticky: the context is dead and every later system would
fail here, so the worker reports the one that raised first and ends; the parent starts a fresh worker. A crash (a
signal) ends the process without a line: the parent knows from the last "running" line whose call it was. stdout
carries the protocol only: fd 1 points at stderr, and the lines go to a private duplicate of the original stdout
(as in tools/sandbox/candidate_worker.py).
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import signal
import sys
import traceback

import torch

from ...engine import loader
from ...engine.errors import SpecPilotError
from ...engine.recipe import parse
from ...engine.workloads import Question
from .env import header
from .prompt_requests import BenchRequest, build_requests
from .run import FAULT_EXIT, Bench, build_systems, cell_units, continuous, one_line, waves
from .systems import System

PR_SET_PDEATHSIG = 1


def claim_stdout():
    """A private handle on the real stdout; anything else printed (Python or C level) goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1, encoding="utf-8")


def die_with_parent(parent: int) -> None:
    """On Linux, SIGKILL when the bench that started this worker dies: a killed bench must not leave a worker
    measuring on (and holding) the GPU."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(1)


def cuda_context_error(device: torch.device) -> str | None:
    """Why no CUDA work can run in this process any more, or None when a tiny op and a synchronize still do."""
    if device.type != "cuda":
        return None
    try:
        (torch.ones(1, device=device) + 1).sum().item()
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - whatever the driver says, the context is unusable
        return one_line(f"{type(e).__name__}: {e}", 200)
    return None


class WorkerBench(Bench):
    """The in-process bench's cells, told to the parent as lines; the parent writes results.json."""

    def __init__(self, args, head: dict, send):
        super().__init__(args, None, head)
        self.send = send
        self.sent_runs = self.sent_errors = 0

    def write(self) -> None:
        """Nothing here: the parent rewrites results.json from each cell this worker sends."""

    def running(self, system: str | None, workload: str, batch_size: int) -> None:
        self.send({"event": "running", "system": system, "workload": workload, "batch_size": batch_size})

    def building(self, systems: list[str]) -> None:
        self.send({"event": "building", "systems": systems})

    def system_failed(self, system: System, workload: str, batch_size: int, message: str) -> None:
        dead = cuda_context_error(system.device)
        if dead is None:  # an ordinary failure: an error entry, the other systems go on here
            super().system_failed(system, workload, batch_size, message)
            return
        # CUDA reports a fault at a later call, often another library's (cuDNN's "mha_graph.execute ... is_good()"
        # for an illegal address): the context's own error, which names the fault, goes with the system's
        self.send({"event": "fault", "system": system.name, "workload": workload, "batch_size": batch_size,
                   "message": f"{one_line(message, 250)}; it left the CUDA context dead: {dead}"})
        os._exit(FAULT_EXIT)  # nothing more can run in this process (no cleanup: it would touch the dead context)

    def unsent(self) -> tuple[list[dict], list[dict]]:
        """The runs and errors recorded since the last call."""
        runs, errors = self.results["runs"][self.sent_runs:], self.results["errors"][self.sent_errors:]
        self.sent_runs, self.sent_errors = len(self.results["runs"]), len(self.results["errors"])
        return runs, errors


class ProgressLink:
    """The progress bar measure_cell updates, which is the parent's: its updates and texts go there as lines."""

    def __init__(self, send):
        self.send, self.n = send, 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if n:
            self.send({"event": "progress", "n": n})

    def set_postfix_str(self, text: str) -> None:
        self.send({"event": "postfix", "text": text})


def measure_cells(config: dict, send) -> None:
    """Load, build, (answer earlier turns,) then every cell of `config`, each followed by its "cell" line."""
    args = argparse.Namespace(**config["args"])
    device, dtype, batch_sizes = config["device"], config["dtype"], config["batch_sizes"]
    workloads = {w: [Question(qid, category, tuple(turns)) for qid, category, turns in qs]
                 for w, qs in config["workloads"].items()}
    recipes = [(name, parse(data)) for name, data in config["recipes"]]
    target = loader.load(args.target, dtype, device)
    bench = WorkerBench(args, header(args, target.model.device, dtype, list(workloads), batch_sizes, recipes), send)
    systems = build_systems(bench, target, recipes, args.baselines)
    built_here = config["requests"] is None
    if built_here:
        send({"event": "requests"})
        reference = systems[0]  # ar: its greedy first answers go into the multi-turn prompts
        requests = {w: build_requests(qs, target.tokenizer, lambda p: reference.answer(p, args.max_new_tokens))
                    for w, qs in workloads.items()}
    else:
        requests = {w: [BenchRequest(qid, turn, prompt) for qid, turn, prompt in rs]
                    for w, rs in config["requests"].items()}
    cells = [(w, b, [s for s in systems if s.name not in left_out]) for w, b, left_out in config["cells"]]

    def units(w: str, b: int, chosen: list[System]) -> int:
        return cell_units(len(chosen), len(requests[w]), b, args.cell_requests, args.repeats, waves(args),
                          continuous(args))

    _, errors = bench.unsent()
    send({"event": "ready", "header": bench.results["header"], "errors": errors,
          "units": sum(units(w, b, chosen) for w, b, chosen in cells),
          "requests": {w: [[r.question_id, r.turn, r.prompt] for r in rs] for w, rs in requests.items()}
          if built_here else None})
    progress = ProgressLink(send)
    for w, b, chosen in cells:
        bench.measure_cell(chosen, w, b, requests[w], progress)
        runs, errors = bench.unsent()
        send({"event": "cell", "workload": w, "batch_size": b, "runs": runs, "errors": errors,
              "units": units(w, b, chosen)})


def main() -> int:
    out = claim_stdout()
    faulthandler.enable()  # a crash's Python stack on stderr, whose last lines the parent keeps

    def send(event: dict) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    config = json.load(sys.stdin)
    die_with_parent(config["parent"])
    try:
        measure_cells(config, send)
    except SpecPilotError as e:  # bad input the in-process bench would raise: the parent raises it
        send({"event": "failed", "message": str(e)})
        return 1
    except Exception as e:  # noqa: BLE001 - the bench's own failure: its traceback on stderr, one line to the parent
        traceback.print_exc()
        send({"event": "failed", "message": one_line(f"{type(e).__name__}: {e}")})
        return 1
    send({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
