"""The benchmark runner: named, reproducible experiments behind the figures of docs/BENCHMARKS.md.

    python3 benchmarks/run.py list                          the experiments, one line each
    python3 benchmarks/run.py stage                         staging only (the first of the two device calls)
    python3 benchmarks/run.py NAME [--out DIR] [--smoke] [--target GGUF] [NAME's own flags]
    python3 benchmarks/run.py NAME --help                   NAME's docstring and flags
    python3 benchmarks/run.py chain [--budget-s S] NAME [flags] -- NAME [flags] ...   several in one device call

A run stages once (harness.stage: the model, the carried wheels, the checkout as `specpilot`), records the
environment, runs benchmarks/experiments/NAME.py and writes exactly NAME.json and NAME.md into the out dir ($OUT
when set, else runs/benchmarks/NAME). Without CUDA only --smoke runs (1 prompt, 8 tokens, on the CPU), and the
experiments that time GPU kernels refuse; an experiment with CPU = True computes on the CPU anywhere (modeled
figures, never a speed). benchmarks/README.md has the device tool's two-call protocol.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import harness  # noqa: E402

EXPERIMENTS = HERE / "experiments"


def experiments() -> dict[str, dict]:
    """name -> its docstring's first line, device minutes and whether it needs CUDA even with --smoke, read from
    the source (nothing imported: the list works on a machine without torch)."""
    found = {}
    for path in sorted(EXPERIMENTS.glob("*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text())
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
        found[path.stem] = {"description": (ast.get_docstring(tree) or "").split("\n")[0],
                            "minutes": consts.get("MINUTES"), "cuda_only": bool(consts.get("CUDA_ONLY")),
                            "cpu": bool(consts.get("CPU")),
                            "path": path}
    return found


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def print_list() -> None:
    for name, e in experiments().items():
        tag = "CUDA only" if e["cuda_only"] else "CPU (modeled)" if e["cpu"] else "--smoke on CPU"
        print(f"{name:18s} ~{e['minutes']} device min, {tag:14s} {e['description']}")


def run_experiment(name: str, argv: list[str]) -> int:
    known = experiments()
    if name not in known:
        print(f"unknown experiment {name!r}; `python3 benchmarks/run.py list` names them", file=sys.stderr)
        return 2
    module = load(name)
    p = argparse.ArgumentParser(prog=f"benchmarks/run.py {name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="where NAME.json and NAME.md go (default: $OUT, else "
                                                "runs/benchmarks/NAME)")
    p.add_argument("--smoke", action="store_true", help="the tiny variant: 1 prompt, 8 tokens, on the CPU (or the "
                                                         "smallest CUDA run of a CUDA-only experiment)")
    p.add_argument("--target", default=None, help="a model file or directory, or synthetic:NAME (engine/synthetic.py), "
                                                   "instead of the staged SmolLM2 GGUF")
    if hasattr(module, "arguments"):
        module.arguments(p)
    args = p.parse_args(argv)
    out_dir = Path(args.out or os.environ.get("OUT") or harness.ROOT / "runs" / "benchmarks" / name)

    # A synthetic target (engine/synthetic.py) takes its text from the staged SmolLM2's tokenizer
    synthetic = (args.target or "").startswith("synthetic:")
    staged = harness.stage(model=args.target is None or synthetic)
    if synthetic and staged.model:
        os.environ.setdefault("SPECPILOT_SYNTHETIC_TOKENIZER", str(staged.model))
    for note in staged.notes:
        print(f"stage: {note}", flush=True)
    target = args.target or staged.model
    if target is None:
        print(f"{name}: no model to run on (see the stage lines above)", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and (known[name]["cuda_only"] or not (args.smoke or known[name]["cpu"])):
        hint = "" if known[name]["cuda_only"] else " (--smoke runs a tiny variant on the CPU)"
        print(f"{name}: needs CUDA{hint}", file=sys.stderr)
        return 3
    device = "cuda" if cuda and (known[name]["cuda_only"] or not args.smoke) else "cpu"
    scratch = harness.scratch_dir(name)
    args.ctx = harness.Context(name, str(target), device, args.smoke, scratch)
    env = harness.environment(device)
    command = "python3 benchmarks/run.py " + shlex.join([name, *argv])
    print(f"{name}: {harness.env_line(env)}; scratch {scratch}", flush=True)
    record = {"experiment": name, "description": known[name]["description"], "command": command,
              "args": {k: v for k, v in vars(args).items() if k != "ctx"}, "env": env, "staging": staged.notes,
              "scratch": str(scratch)}
    start = time.perf_counter()
    try:
        results, table = module.run(out_dir, args)
        status = 0 if results.get("ok", True) else 1   # an experiment that checks (gate, tests) says ok: False
    except Stopped as e:  # what the stopped run's benches had finished still lands in NAME.json and NAME.md
        partial = harness.finished_bench_cells(scratch)
        results, status = {"error": str(e), "stopped": True, "partial": partial}, e.status
        table = (f"**stopped** ({e}); the cells its benches had finished:\n\n"
                 + harness.partial_tables(partial, getattr(module, "partial_table", None)))
    except Exception as e:
        results, status = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, 1
        table = f"**failed**: {type(e).__name__}: {e}"
        traceback.print_exc()
    record.update(seconds=round(time.perf_counter() - start, 1), results=results,
                  steps=[vars(s) for s in args.ctx.steps])
    head = (f"# {name}: {known[name]['description']}\n\n{harness.env_line(env)}\n\n`{command}`"
            f"{' (smoke run: not a measurement)' if args.smoke else ''}\n\n")
    js, md = harness.write(out_dir, name, record, head + table)
    print(f"{name}: wrote {js} and {md} ({record['seconds']} s)", flush=True)
    return status


def chain(argv: list[str], budget_s: float | None = None) -> int:
    """Run experiments one after another in this call, each `NAME [flags]` (separated by `--`) into OUT/NAME (its
    NAME.json, NAME.md and its whole output in OUT/NAME.log), within `budget_s` seconds in all (default: 560, a
    device call's 600 less a margin): one whose listed device minutes no longer fit is skipped, and one that runs
    past what is left is killed, so the call ends with every finished result in OUT and a line for each.
    OUT/chain.json lists what ran, its exit status and seconds. Exit status: the first non-zero one, else 0."""
    known, out = experiments(), Path(os.environ.get("OUT") or harness.ROOT / "runs" / "benchmarks")
    budget = 560.0 if budget_s is None else budget_s
    groups, group = [], []
    for arg in argv + ["--"]:
        if arg == "--":
            if group:
                groups.append(group)
            group = []
        else:
            group.append(arg)
    if not groups:
        print("chain: no experiment given", file=sys.stderr)
        return 2
    for name, *_ in groups:
        if name not in known:
            print(f"chain: unknown experiment {name!r}; `python3 benchmarks/run.py list` names them", file=sys.stderr)
            return 2
    start, record, status, taken = time.perf_counter(), [], 0, set()
    out.mkdir(parents=True, exist_ok=True)
    for name, *flags in groups:
        label, n = name, 2
        while label in taken:
            label, n = f"{name}-{n}", n + 1
        taken.add(label)
        left = budget - (time.perf_counter() - start)
        need = 60 * (known[name]["minutes"] or 1) if "--smoke" not in flags else 0
        if left < max(need, 1):
            print(f"chain: {label} skipped: ~{need:.0f} s listed, {left:.0f} s left", flush=True)
            record.append({"experiment": label, "command": [name, *flags], "status": "skipped", "seconds": 0.0})
            continue
        command = [sys.executable, str(HERE / "run.py"), name, "--out", str(out / label), *flags]
        print(f"chain: {label} ({left:.0f} s left): {shlex.join(command[1:])}", flush=True)
        t0 = time.perf_counter()
        with open(out / f"{label}.log", "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                proc.terminate()  # its SIGTERM handler kills the steps it runs, each in a process group of its own
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # (whatever of its group outlived it)
                except ProcessLookupError:
                    pass
                proc.wait()
                rc = "killed: past the chain's budget"
        seconds = round(time.perf_counter() - t0, 1)
        print(f"chain: {label}: {'exit ' + str(rc) if isinstance(rc, int) else rc} after {seconds} s", flush=True)
        record.append({"experiment": label, "command": [name, *flags], "status": rc, "seconds": seconds})
        if rc != 0 and status == 0:
            status = rc if isinstance(rc, int) else 1
    (out / "chain.json").write_text(json.dumps({"budget_s": budget, "runs": record}, indent=1) + "\n")
    return status


class Stopped(BaseException):
    """The runner was sent SIGTERM (`chain` past its budget, a `timeout`, a person)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.status = 128 + signum


def _stopped(signum, frame):
    """SIGTERM: the running steps die with the runner, not after it, and the experiment's run ends with `Stopped`,
    which `run_experiment` records (a device call's `timeout` once cost a whole sweep's finished cells)."""
    harness.kill_steps()
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print_list()
        return 0
    if argv[0] == "list":
        print_list()
        return 0
    if argv[0] == "stage":
        staged = harness.stage()
        for note in staged.notes:
            print(f"stage: {note}")
        return 0
    if argv[0] == "chain":  # (its own flag read by hand: argparse would take the `--` that separates experiments)
        rest, budget = argv[1:], None
        if rest[:1] == ["--budget-s"] and len(rest) > 1 or rest[:1] and rest[0].startswith("--budget-s="):
            value, rest = (rest[1], rest[2:]) if rest[0] == "--budget-s" else (rest[0].split("=", 1)[1], rest[1:])
            try:
                budget = float(value)
            except ValueError:
                print(f"chain: --budget-s must be a number of seconds, got {value!r}", file=sys.stderr)
                return 2
        return chain(rest, budget)
    return run_experiment(argv[0], argv[1:])


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stopped)
    try:
        sys.exit(main())
    except Stopped as e:  # (stopped outside an experiment's run: staging, `chain` itself)
        sys.exit(e.status)
