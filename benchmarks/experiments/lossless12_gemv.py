"""The 12-bit kernels against cuBLAS bf16 on Llama-3-8B shapes: the table, or an A/B of two versions.

What it measures. By default the committed kernels' table (`kernels/lossless12_linear.benchmark`, default launch,
no sweep): device time per call from CUDA graphs of calls rotating over weight copies larger than L2, at M = 1, 4,
16, 64 on 4096 x 4096, 14336 x 4096, 4096 x 14336 and the 128256 x 4096 LM head, torch timed beside each row; and
the device copy bandwidth (1 GiB, eager with CUDA events, and captured in a CUDA graph), against which "of copy"
is read. With `--against REV_OR_FILE` instead: the A/B loop (harness.alternate) of that version of
kernels/lossless12_linear.py (a git revision, or a file) against the working one, `--reps` times alternated in one
process at M = 1, torch timed each time. `--sweep` adds the sweep of launch configurations to the table.

Backs docs/BENCHMARKS.md, "12-bit kernels": the eighth lease's call H (the table, then l12_table.py) and calls
E/F (the A/B against HEAD, then l12_final.py / l12_loop.py with l12_ab.py),
docs/benchmarks/2026-11-29-eighth-lease.md.

Device minutes: about 2 for the table, 2 + 1 a repetition for `--against`.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import harness

MINUTES = 2
CUDA_ONLY = True


def arguments(p) -> None:
    p.add_argument("--against", default=None, help="a git revision or a file of kernels/lossless12_linear.py to "
                                                    "alternate with the working kernel (M = 1)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the A/B loop")
    p.add_argument("--shapes", default=None, help="NxK,... (default: the Llama-3-8B four)")
    p.add_argument("--ms", default="1,4,16,64", help="rows of x for the table")
    p.add_argument("--sweep", action="store_true", help="also sweep the launch configurations (slow)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds for the table's benchmark")


def copy_bandwidth(L) -> dict:
    """1 GiB copy, (read + write) TB/s: eager, timed with CUDA events (tools/profile/calibrate.py's way, what "of copy" is
    read against) and captured in a CUDA graph (what the benchmark reported until the eighth lease)."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    graph = 2 * n / L._graph_time(lambda i: dst.copy_(src), 1, 4)
    del src, dst
    return {"eager_tbps": L.copy_bandwidth(n) / 1e12, "graph_tbps": graph / 1e12}


def other_version(ctx, against: str):
    """kernels/lossless12_linear.py as of `against` (a file, or a git revision), imported beside the working one
    as specpilot.kernels._l12_against (its relative imports resolve in the working package)."""
    path = Path(against)
    if not path.is_file():
        path = ctx.scratch / "lossless12_linear_against.py"
        show = ["git", "-C", str(harness.ROOT), "show", f"{against}:kernels/lossless12_linear.py"]
        path.write_text(subprocess.run(show, check=True, capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("specpilot.kernels._l12_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(out_dir, args):
    from specpilot.kernels import lossless12_linear as L

    shapes = (tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")) if args.shapes
              else L.LLAMA3_8B_SHAPES)
    ms = tuple(int(m) for m in args.ms.split(","))
    if args.smoke:
        shapes, ms, args.reps = shapes[:1], (1,), 1
    if args.against:
        return ab(args, L, other_version(args.ctx, args.against), shapes)
    bandwidth = copy_bandwidth(L)
    print(f"copy bandwidth: eager {bandwidth['eager_tbps']:.2f} TB/s, in a CUDA graph {bandwidth['graph_tbps']:.2f}",
          flush=True)
    result = L.benchmark(shapes=shapes, ms=ms, sweep=args.sweep, budget_s=args.budget)
    rows = [[f"{r['n']} x {r['k']}", r["m"], f"{r['torch_us']:.2f}", f"{r['default_us']:.2f}",
             f"**{r['speedup_default']:.2f}x**" if r["m"] == 1 else f"{r['speedup_default']:.2f}x",
             f"{r['torch_tbps']:.2f}", f"{r['default_tbps']:.2f}",
             f"{r['default_tbps'] / bandwidth['eager_tbps']:.2f}", f"{r['max_rel_err']:.1e}"]
            + ([f"{r['best_us']:.2f} ({r['speedup_best']:.2f}x)"] if args.sweep else []) for r in result["rows"]]
    table = harness.md_table(["shape (N x K)", "M", "torch µs", "ours µs", "speedup", "torch TB/s", "ours TB/s",
                              "ours of copy", "max rel. err"] + (["best of sweep µs"] if args.sweep else []), rows)
    return ({"copy": bandwidth, "benchmark": result},
            table + f"\n\nDevice copy bandwidth {bandwidth['eager_tbps']:.2f} TB/s eager "
                    f"({bandwidth['graph_tbps']:.2f} in a CUDA graph); \"of copy\" is over the eager figure.")


def ab(args, working, against, shapes):
    """The A/B loop: the two kernel modules alternated `reps` times, default launch, M = 1."""
    def measure(module):
        return lambda: [{k: v for k, v in r.items() if k not in ("failed", "sweep_us")}
                        for r in module.benchmark(shapes=shapes, ms=(1,), sweep=False, budget_s=30.0)["rows"]]

    rows = harness.alternate({"against": measure(against), "working": measure(working)}, args.reps)
    table = []
    for shape in dict.fromkeys((r["n"], r["k"]) for r in rows):
        mine = {v: [r for r in rows if (r["n"], r["k"]) == shape and r["variant"] == v] for v in ("against", "working")}
        torch_us = [r["torch_us"] for rs in mine.values() for r in rs]
        cells = [f"{min(r['default_us'] for r in rs):.2f}–{max(r['default_us'] for r in rs):.2f} "
                 f"({min(r['speedup_default'] for r in rs):.3f}–{max(r['speedup_default'] for r in rs):.3f}x)"
                 for rs in mine.values()]
        table.append([f"{shape[0]} x {shape[1]}", f"{min(torch_us):.1f}–{max(torch_us):.1f}", *cells])
    md = harness.md_table(["shape (N x K)", "torch µs", f"{args.against} µs (speedup)", "working µs (speedup)"],
                          table)
    return ({"against": args.against, "reps": args.reps, "rows": rows},
            md + f"\n\nM = 1, default launch, {args.reps} alternating repetitions; ranges over the repetitions.")
