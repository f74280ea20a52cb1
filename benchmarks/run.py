"""The benchmark runner: named, reproducible experiments behind the figures of docs/BENCHMARKS.md.

    python3 benchmarks/run.py list                          the experiments, one line each
    python3 benchmarks/run.py stage                         staging only (the first of the two device calls)
    python3 benchmarks/run.py NAME [--out DIR] [--smoke] [--target GGUF] [NAME's own flags]
    python3 benchmarks/run.py NAME --help                   NAME's docstring and flags

A run stages once (harness.stage: the model, the carried wheels, the checkout as `specpilot`), records the
environment, runs benchmarks/experiments/NAME.py and writes exactly NAME.json and NAME.md into the out dir ($OUT
when set, else runs/benchmarks/NAME). Without CUDA only --smoke runs (1 prompt, 8 tokens, on the CPU), and the
experiments that time GPU kernels refuse. benchmarks/README.md has the device tool's two-call protocol.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import shlex
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
                            "path": path}
    return found


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def print_list() -> None:
    for name, e in experiments().items():
        tag = "CUDA only" if e["cuda_only"] else "--smoke on CPU"
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
    if not cuda and (known[name]["cuda_only"] or not args.smoke):
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
    return run_experiment(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
