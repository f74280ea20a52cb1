"""`specpilot bench`: every system side by side in one process, on the same prompts, in alternating order.

Systems: the same engine's AR (`ar`, the reference), the `stock` recipe, each `--recipe`, and with `--baselines hf`
HF transformers (hf_baselines.py). For each workload and batch size (a cell) the requests are split in order into
batches; every system first decodes a warm-up (not counted), then each batch is decoded by every system in an order
rotated per batch, so that drift (clocks, caches, other load) hits all systems alike. A system that fails in a cell
becomes an error entry; the others are still measured. results.json is rewritten after every cell.

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
import contextlib
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch

from ..argtypes import check, positive_float, positive_int, positive_int_list
from ...engine import loader, packaged
from ...engine.errors import SpecPilotError
from ...engine.recipe import BUILTIN as BUILTIN_RECIPES
from ...engine.recipe import Recipe, load_recipe, with_absolute_paths
from ...engine.workloads import Question, absolute_spec, load_workload
from ...kernels import is_candidate_path
from . import report as bench_report
from .env import header
from .metrics import compare_to_ar, summarize
from .prompt_requests import BenchRequest, build_requests
from .systems import BatchRun, BenchSkip, EngineSystem, System, memory_kind
from .hf_baselines import HF_SYSTEMS, HFSystem, load_hf_model

SCHEMA = "specpilot-bench/1"
BASELINES = ("hf", "none")
CHILD = "specpilot.tools.bench.run"  # the sandboxed child's module (main() below)
SANDBOX_TIMEOUT_S = 3 * 3600.0  # the default wall-clock limit of a sandboxed bench


def add_arguments(b: argparse.ArgumentParser) -> None:
    """`specpilot bench`'s flags: the CLI's subcommand and `parse_args` (callers in code) share them."""
    b.add_argument("--target", default="smollm2-135m", help="alias, GGUF file, model directory or cached hub id")
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
    b.add_argument("--repeats", type=positive_int, default=1,
                   help="times each batch is measured per system (median kept)")
    b.add_argument("--baselines", default="none", help="hf: add HF transformers static-cache AR and prompt lookup")
    b.add_argument("--ignore-eos", action="store_true", help="always generate exactly --max-new-tokens tokens")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: bf16 on cuda, fp32 on cpu)")
    b.add_argument("--out", default=None, help="output directory (default: runs/bench-<timestamp>)")
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


def recipes_to_measure(specs: list[str]) -> list[tuple[str, Recipe]]:
    """(system name, recipe): ar and stock always, then each --recipe; a repeated name gets a numeric suffix."""
    chosen = [("ar", load_recipe("ar")), ("stock", load_recipe("stock"))]
    for spec in specs:
        if spec in BUILTIN_RECIPES:  # ar and stock are measured anyway
            continue
        recipe = load_recipe(spec)
        names = {name for name, _ in chosen}
        name, n = recipe.name, 2
        while name in names:
            name, n = f"{recipe.name}-{n}", n + 1
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

    def _try(self, system: System, workload: str, batch_size: int, prompts: list[list[int]]) -> BatchRun | None:
        try:
            return system.run(prompts, self.args.max_new_tokens, self.args.ignore_eos)
        except BenchSkip as e:
            self.error(system.name, workload, batch_size, str(e))
        except Exception as e:  # one broken system must not cost the others their measurements
            self.error(system.name, workload, batch_size, f"{system.name}: {type(e).__name__}: {e}")
        return None

    def _prepare(self, system: System, workload: str, batch_size: int, batches: list[list[list[int]]]) -> bool:
        try:
            system.prepare(batches, self.args.max_new_tokens)
            return True
        except Exception as e:  # a system that cannot warm up is an error entry, like one that cannot decode
            self.error(system.name, workload, batch_size, f"{system.name}: warm-up: {type(e).__name__}: {e}")
            return False

    def measure_cell(self, systems: list[System], workload: str, batch_size: int, requests: list[BenchRequest],
                     progress) -> None:
        requests = requests[: cell_size(len(requests), batch_size, self.args.cell_requests)]
        units = len(systems) * (1 + -(-len(requests) // batch_size) * self.args.repeats)
        if batch_size > len(requests):
            self.error(None, workload, batch_size, f"batch size {batch_size} is above the {len(requests)} "
                       f"requests of workload {workload}: cell skipped")
            progress.update(units)
            self.write()
            return
        done_before = progress.n
        prompts = [r.prompt for r in requests]
        batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
        # Warm-up: compiles, captured graphs and caches for every batch shape of the cell (the last may be short).
        warm = batches[:1] + (batches[-1:] if len(batches[-1]) != batch_size else [])
        live = []
        for s in systems:
            progress.set_postfix_str(f"{workload} B={batch_size} {s.name} warm-up")
            if all(self._try(s, workload, batch_size, b) is not None for b in warm) and self._prepare(s, workload,
                                                                                                    batch_size, batches):
                live.append(s)
            progress.update(1)
        measured: dict[str, list[list[BatchRun]]] = {s.name: [[] for _ in batches] for s in live}
        for i, batch in enumerate(batches):
            for rep in range(self.args.repeats):
                shift = (i * self.args.repeats + rep) % max(len(live), 1)
                for s in live[shift:] + live[:shift]:
                    if s.name in measured:
                        progress.set_postfix_str(f"{workload} B={batch_size} {s.name}")
                        run = self._try(s, workload, batch_size, batch)
                        if run is None:
                            del measured[s.name]  # a partial set of batches would not be comparable
                        else:
                            measured[s.name][i].append(run)
                    progress.update(1)
        progress.update(units - (progress.n - done_before))
        self._add_runs(systems, workload, batch_size, measured, batches)

    def _add_runs(self, systems, workload, batch_size, measured: dict[str, list[list[BatchRun]]],
                  batches: list[list[list[int]]]) -> None:
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
            # What was timed, request by request: the optimize graph judges these tokens against the reference
            # (tools/gate/timed.py), so a candidate cannot behave only while it is being checked.
            run["outputs"] = [{"prompt": prompt, "tokens": tokens, "finish": finish}
                              for r, batch in zip(chosen[name], batches)
                              for prompt, tokens, finish in zip(batch, r.tokens, r.finish_reasons)]
        self.results["runs"] += cell.values()
        self.write()


def cell_size(n_requests: int, batch_size: int, cell_requests: int | None) -> int:
    """How many of a workload's requests one cell decodes (--cell-requests N: the first max(N, B))."""
    return n_requests if cell_requests is None else min(n_requests, max(cell_requests, batch_size))


def build_systems(bench: Bench, target, recipes: list[tuple[str, Recipe]], baselines: str) -> list[System]:
    systems: list[System] = [EngineSystem(name, target, recipe) for name, recipe in recipes]
    if baselines == "hf":
        try:
            hf_model = load_hf_model(target)
        except Exception as e:  # e.g. an architecture HF cannot build from this directory
            for name in HF_SYSTEMS:
                bench.error(name, None, None, f"{name}: cannot run on this target: {type(e).__name__}: {e}")
        else:
            systems += [HFSystem(name, hf_model, target) for name in HF_SYSTEMS]
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
    recipes = recipes_to_measure(args.recipe or [])
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/bench-{stamp}")

    if any(candidate_files(r) for _, r in recipes):
        results = bench_in_sandbox(args, list(workloads), recipes, device, dtype, sandbox)
        out.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, out, results["header"])
        bench.results = results
        for e in results["errors"]:
            print(f"specpilot: warning: {e['message']}", file=sys.stderr)
        bench.write()
        bench_report.write_report(out, results)
    else:
        bench = measure(args, batch_sizes, workloads, recipes, device, dtype, out)
    print(bench_report.summary_text(bench.results))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}" + (" and plots" if (out / bench_report.PLOTS[0]).is_file()
                                                                 else ""))
    return 0


def measure(args, batch_sizes, workloads, recipes, device, dtype, out: Path, report: bool = True) -> Bench:
    """The bench in this process: load, measure every cell, results.json after each (and the report at the end)."""
    from tqdm import tqdm

    target = loader.load(args.target, dtype, device)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, out, header(args, target.model.device, dtype, list(workloads), batch_sizes))
    systems = build_systems(bench, target, recipes, args.baselines)
    reference = systems[0]  # ar: its greedy first answers go into the multi-turn prompts
    requests = {w: build_requests(qs, target.tokenizer, lambda p: reference.answer(p, args.max_new_tokens))
                for w, qs in workloads.items()}
    total = sum(len(systems) * (1 + -(-cell_size(len(rs), b, args.cell_requests) // b) * args.repeats)
                for rs in requests.values() for b in batch_sizes)
    bench.write()
    try:
        with tqdm(total=total, desc="bench", unit="decode", file=sys.stderr,
                  disable=not (args.progress or sys.stderr.isatty())) as progress:
            for workload, reqs in requests.items():
                for b in batch_sizes:
                    bench.measure_cell(systems, workload, b, reqs, progress)
    finally:
        bench.write()
        if report:
            bench_report.write_report(out, bench.results)
    return bench


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
    argv += ["--ignore-eos"] if args.ignore_eos else []
    # ar and stock come first and the child adds them itself (recipes_to_measure); the rest go as JSON
    payload = {"argv": argv, "recipes": [recipe_for_child(r) for _, r in recipes[2:]],
               "command": list(getattr(args, "argv", None) or sys.argv[1:])}
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
    """The sandboxed child: the payload {"argv", "recipes", "command"} on stdin, the results as the last stdout line."""
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
                            recipes_to_measure(args.recipe), args.device, args.dtype, work / "out", report=False)
        answer = {"results": bench.results}
    except Exception as e:  # noqa: BLE001 - the parent reports it as one line
        answer = {"error": one_line(f"{type(e).__name__}: {e}")}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
