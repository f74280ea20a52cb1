"""Every measurement the graph makes, through the tools only: the token-forcing gate (tools/gate/check.check), the
side-by-side benchmark (tools/bench/run.run_bench), the sandboxed kernel check (tools/agent_tools.benchmark_kernel)
and the profiler (tools/profile/profiler.profile). Each returns a plain dict (state and checkpoints hold JSON) and the
seconds it held the device.

The orchestrator never imports candidate code: a bench or a profile of a recipe that names candidate kernel files
runs in a sandboxed child (tools/sandbox/process.run_python, handed to run_bench and profile as `sandbox=`), and only
its JSON comes back; recipes of built-in kernels only are measured in this process, as before.

One measurement at a time on the device: a lock in this process (parallel nodes, threads) and, on CUDA, the
sandbox's GPU flock across processes around what runs in this process (bench, profile of package code). Around the
kernel check, the gate and a sandboxed bench or profile only the in-process lock is held: their candidates run in
child processes, and a sandbox child takes the flock itself (the parent holding it too would deadlock the child; the
gate's worker is the next candidate for the same sandbox).
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from ..engine.errors import SpecPilotError
from ..engine.recipe import load_recipe
from ..kernels import is_candidate_path
from ..tools.sandbox import process as sandbox
from ..tools.sandbox.process import gpu_lock

_DEVICE = threading.Lock()


@contextlib.contextmanager
def device_turn(settings: dict, flock: bool = True):
    with _DEVICE, gpu_lock(flock and str(settings["device"]).startswith("cuda")):
        yield


def gate(settings: dict, recipe: str, out_dir: Path, batch_size: int) -> tuple[dict, float]:
    """The candidate's greedy tokens against the stock system's on the run's salted prompts (docs/GATE.md).
    A check that cannot run for this recipe (e.g. a draft model that is not there) is a failed check: the
    candidate has not shown the stock system's tokens."""
    from ..tools.gate.check import check

    t0 = time.perf_counter()
    with device_turn(settings, flock=False):
        try:
            rep = check(settings["target"], recipe, settings["workload"], settings["limit"],
                        settings["max_new_tokens"], settings["device"], settings["dtype"], Path(out_dir),
                        salt=settings["salt"], batch_size=batch_size, timeout_s=settings["gate_timeout_s"])
        except Exception as e:  # SpecPilotError for this recipe's inputs; anything the check itself raised
            return ({"ran": False, "passed": False, "reason": f"the gate could not run: {type(e).__name__}: {e}",
                     "salt": settings["salt"], "report": None}, time.perf_counter() - t0)
    failure = rep.failure or {}
    return ({"ran": True, "passed": rep.passed, "reason": rep.reason, "salt": rep.salt, "epsilon": rep.epsilon,
             "tokens_checked": rep.tokens_checked, "exact_matches": rep.exact_matches, "ties": len(rep.ties),
             "failure_kind": failure.get("kind"), "batch_size": batch_size,
             "report": str(Path(out_dir) / "report.json")}, time.perf_counter() - t0)


def candidate_code(recipe: str) -> bool:
    """Whether a recipe (built-in name or file) names candidate kernel files: then it runs only in the sandbox."""
    if recipe in ("ar", "stock"):
        return False
    try:
        return any(is_candidate_path(impl) for impl in load_recipe(recipe).kernels.values())
    except SpecPilotError:
        return False  # the tool itself reports the bad recipe


def bench(settings: dict, recipes: list[str], out_dir: Path) -> tuple[dict, float]:
    """`specpilot bench` of the given recipe files next to ar and stock, in one process (a sandboxed child when one
    names candidate kernel files), on the deployment's workload and batch size. Systems are named after their
    recipes' `name`; speedups over stock are derived from the same cell's tok/s.
    {"ok", "error", "systems": {name: run}, "errors", "dir"}."""
    from ..tools.bench.run import parse_args, recipes_to_measure, run_bench

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = ["bench", f"--target={settings['target']}", f"--workload={settings['workload']}",
            f"--batch-sizes={settings['batch_size']}", f"--max-new-tokens={settings['max_new_tokens']}",
            f"--repeats={settings['bench_repeats']}", f"--device={settings['device']}",
            f"--dtype={settings['dtype']}", f"--out={out_dir}"]
    argv += [f"--limit={settings['limit']}"] if settings["limit"] else []
    argv += [f"--recipe={r}" for r in recipes]
    args = parse_args(argv[1:])
    t0 = time.perf_counter()
    with device_turn(settings, flock=not any(candidate_code(r) for r in recipes)):
        try:
            with open(out_dir / "bench.log", "w") as log, contextlib.redirect_stdout(log):
                # its summary table goes to bench.log: the progress line owns the terminal
                run_bench(args, sandbox=sandbox)
            results = json.loads((out_dir / "results.json").read_text())
        except Exception as e:  # a recipe the engine cannot build, a decode that raised outside a cell
            return ({"ok": False, "error": f"{type(e).__name__}: {e}", "systems": {}, "errors": [],
                     "dir": str(out_dir)}, time.perf_counter() - t0)
    # The bench names a replay recipe's system NAME-replay (tools/bench/run.py); the graph knows its recipes by NAME.
    named = {system: recipe.name
             for system, recipe in recipes_to_measure([str(r) for r in recipes], settings["target"])}
    runs = {named.get(r["system"], r["system"]): r for r in results["runs"]}
    stock = (runs.get("stock") or {}).get("tokens_per_s")
    systems = {}
    for name, r in runs.items():
        systems[name] = {k: r.get(k) for k in ("tokens_per_s", "speedup_vs_ar", "mean_accepted", "identical_to_ar",
                                              "p50_token_ms", "p99_token_ms", "ttft_ms", "peak_memory_bytes")}
        systems[name]["speedup_vs_stock"] = r["tokens_per_s"] / stock if stock else None
    return ({"ok": True, "error": None, "systems": systems, "errors": results["errors"], "dir": str(out_dir)},
            time.perf_counter() - t0)


def kernel_check(settings: dict, slot: str, source: str, out_path: Path) -> tuple[dict, float]:
    """The slot's contract in the sandbox (docs/TOOLS.md): values, the anti-cheating defenses, timing on CUDA."""
    from ..tools.agent_tools import benchmark_kernel

    t0 = time.perf_counter()
    with device_turn(settings, flock=False):
        result = benchmark_kernel(slot, source, settings["device"], settings["dtype"]).to_dict()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
    return result, time.perf_counter() - t0


def profile(settings: dict, recipe: str, out_dir: Path) -> tuple[dict, float]:
    """tools.profile.profiler.profile of a recipe on the deployment (in a sandboxed child when it names candidate
    kernel files): phases, floors and gaps ranked by end-to-end gain."""
    from ..tools.profile.profiler import profile as run_profile

    t0 = time.perf_counter()
    with device_turn(settings, flock=not candidate_code(recipe)):
        try:
            run_profile(settings["target"], recipe, settings["workload"], settings["limit"],
                        settings["max_new_tokens"], settings["batch_size"], settings["device"], settings["dtype"],
                        out_dir, repeats=settings["profile_repeats"], sandbox=sandbox)
        except SpecPilotError:
            raise
        except Exception as e:  # the graph cannot route without a profile: the run stops, resumable
            raise SpecPilotError(f"profiling {recipe} failed: {type(e).__name__}: {e}") from e
    return json.loads((Path(out_dir) / "profile.json").read_text()), time.perf_counter() - t0
