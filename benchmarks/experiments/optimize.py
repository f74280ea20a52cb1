"""One `specpilot optimize` run, then its recipe beside ar, stock and the hand-found best recipe.

What it measures. `specpilot optimize --target T --workload code --device cuda --provider policy --memory FILE`
(3 rounds / 6 minutes of work at most, 4 prompts of 128 tokens, 2 candidates an agent), then one `specpilot bench`
of the found recipe beside ar, stock and the best recipe found by hand (the adaptive min-2 n-gram with
ar_after_miss on the fused layer, with overlap) on code, chat, math, summarize and rag at B = 1 (4 prompts, 128
tokens), then tools/bench/optimize_summary.py's table: the found recipe's tok/s and its ratios per workload, and the
run's device minutes. Added here: the found recipe over the hand-found best in the same cell (issue #23's "62%"), and
over the grid's best (issue #23's yardstick) when the grid experiment ran on this machine before (or --grid-best).

Needs on the H200 the graph's wheels (.gpu/whl-graph: LangGraph, pydantic, ...; benchmarks/README.md), carried and
staged like .gpu/whl; the memory is a JSON-lines file, so chromadb is not needed.

Backs docs/BENCHMARKS.md, "Optimize vs hand-found best": the third lease's run (then optimize.sh),
docs/benchmarks/2026-11-29-third-lease.md, and issue #23's later run.

Device minutes: about 9 (optimize 360 s of work, 510 s at most with the evaluation in flight; bench about
50 s).
"""
from __future__ import annotations

import json
from pathlib import Path

import harness

MINUTES = 9
HAND_BEST = "ngram2-k4-adaptive-armiss-fused-overlap"
# 3 rounds in 6 minutes of work: an evaluation (the gate, the gate at smaller batches and long inputs, the timed
# run beside the best, ar and stock) takes about 45 s on the H200, so about 7 of them; with 4 minutes (2026-12-02)
# the run ended inside its first round.
OPT_FLAGS = ["--budget-rounds", 3, "--budget-minutes", 6, "--budget-gpu-minutes", 6, "--max-new-tokens", 128,
             "--limit", 4, "--max-candidates", 2]
# The optimize process's limit: its budget, the evaluation in flight when the budget runs out (the graph finishes
# it: about 45 s, an autotuning one over 2 minutes) and the report. (At 330 s with a 6.5-minute budget the run was
# killed in its first round, 2026-12-02.)
OPT_TIMEOUT_S = 6 * 60 + 150
# A CPU smoke run gates on long inputs too: 8.5 minutes were not enough on 2 busy cores (2026-12-02).
SMOKE_TIMEOUT_S = 20 * 60
SMOKE_FLAGS = ["--budget-rounds", 1, "--max-new-tokens", 8, "--limit", 1, "--max-candidates", 1, "--dtype", "fp32"]


def arguments(p) -> None:
    p.add_argument("--workload", default="code", help="the workload optimize runs on")
    p.add_argument("--bench-workloads", default="code,chat,math,summarize,rag")
    p.add_argument("--no-hand-best", action="store_true", help=f"leave {HAND_BEST} out of the bench")
    p.add_argument("--grid-best", default=None,
                   help="a grid's best.json to bench beside the found recipe (default: the grid experiment's "
                        "best for --workload at B = 1 of `--space smollm2`, or for synthetic:llama-3.1-8b of "
                        "`llama-3.1-8b-replay` (`llama-3.1-8b-head` with --acceptance smollm2-135m-eagle3), when an "
                        "earlier call of this machine left it)")
    p.add_argument("--memory", default=None,
                   help="start from a copy of this memory (JSON lines, an earlier run's NAME.json `memory` file): a "
                        "warm start (issue #23 item 3)")
    p.add_argument("--rounds", type=int, default=None, help="optimize's --budget-rounds (default 3)")
    p.add_argument("--minutes", type=float, default=None,
                   help="optimize's --budget-minutes and --budget-gpu-minutes (default 6)")
    p.add_argument("--acceptance", default=None,
                   help="with --target synthetic:NAME: optimize --acceptance A1,A2,...|FILE|HEAD (a drafter's "
                        "acceptance, replayed; issue #24's optimize on a synthetic 8B; add --no-hand-best, whose "
                        "n-gram drafts of random weights' text mean nothing)")


def run(out_dir, args):
    from specpilot.engine.recipe import reported_name
    from specpilot.tools.bench import optimize_summary
    from specpilot.tools.bench.engine_bench import SYSTEMS

    ctx = args.ctx
    run_dir, bench_dir, memory = ctx.scratch / "optimize", ctx.scratch / "bench", ctx.scratch / "memory.jsonl"
    if args.memory:
        memory.write_bytes(Path(args.memory).read_bytes())
    flags, timeout = (SMOKE_FLAGS, SMOKE_TIMEOUT_S) if args.smoke else (OPT_FLAGS, OPT_TIMEOUT_S)
    if not args.smoke and (args.rounds or args.minutes):
        minutes = args.minutes or 6
        flags = ["--budget-rounds", args.rounds or 3, "--budget-minutes", minutes, "--budget-gpu-minutes", minutes,
                 *OPT_FLAGS[6:]]
        timeout = minutes * 60 + 150
    opt = ctx.module("optimize", "specpilot.cli", [
        "optimize", "--target", ctx.target, "--workload", args.workload, "--device", ctx.device, "--provider",
        "policy", "--memory", memory, *flags,
        *(["--acceptance", args.acceptance] if args.acceptance else []), "--out", run_dir], timeout=timeout)
    recipe = run_dir / "recipe.json"
    if not recipe.is_file():  # stopped by the time limit: the best adopted so far, if any
        recipe = max(run_dir.glob("recipes/best-r*.json"), key=lambda p: p.stat().st_mtime, default=None)
        ctx.need(recipe or run_dir / "recipe.json", opt)
    found = json.loads(recipe.read_text())
    argv = ["bench", "--target", ctx.target, "--recipe", recipe, "--workload",
            "code,chat" if args.smoke else args.bench_workloads, "--batch-sizes", 1, "--max-new-tokens",
            8 if args.smoke else 128, "--limit", 1 if args.smoke else 4, "--device", ctx.device, "--out", bench_dir]
    if not args.no_hand_best:
        argv += ["--recipe", ctx.recipe(HAND_BEST, SYSTEMS[HAND_BEST])]
    # the grid experiment's shipped space for this target and profile (the synthetic 8B's at issue #22's aim or at
    # the packaged head's measured profile, or SmolLM2's)
    space = "smollm2" if ctx.target != "synthetic:llama-3.1-8b" else (
        "llama-3.1-8b-head" if args.acceptance == "smollm2-135m-eagle3" else "llama-3.1-8b-replay")
    grid_best = Path(args.grid_best) if args.grid_best else harness.grid_dir(space, [args.workload], "1") / "best.json"
    grid = json.loads(grid_best.read_text()) if not args.smoke and grid_best.is_file() else None
    if grid:
        argv += ["--recipe", grid_best]
    bench = ctx.module("bench", "specpilot.cli", argv, timeout=240)
    ctx.need(bench_dir / "results.json", bench)
    summary = optimize_summary.summarize(recipe, bench_dir)
    table = optimize_summary.markdown(summary)
    results = json.loads((bench_dir / "results.json").read_text())
    against = {"hand-found best": None if args.no_hand_best else HAND_BEST,
               "grid best": grid and grid.get("name")}
    system = reported_name(found.get("name") or "", (found.get("drafter") or {}).get("kind", "none"))
    versus = {what: vs(system, other, results) for what, other in against.items() if other}
    for what, rows in versus.items():
        other = against[what]
        table += "\n\n" + harness.md_table(["workload", "B", "found tok/s", f"{other} ({what}) tok/s",
                                             f"found / {what}"],
                                            [[r["workload"], r["batch_size"], harness.fmt(r["found"], ",.0f"),
                                              harness.fmt(r["other"], ",.0f"), harness.fmt(r["ratio"], ".0%")]
                                             for r in rows])
    report = run_dir / "report.md"
    return ({"recipe": found, "summary": summary, "vs_hand_best": versus.get("hand-found best"),
             "vs_grid_best": versus.get("grid best"), "grid_best": grid and {"file": str(grid_best), "recipe": grid},
             "run_dir": str(run_dir), "report": report.read_text() if report.is_file() else None,
             "memory": str(memory), "memory_lines": memory.read_text().splitlines() if memory.is_file() else None,
             "evaluations": evaluation_times(run_dir)}, table)


def evaluation_times(run_dir: Path) -> list[dict]:
    """Each finished evaluation's device seconds and where they went (graph/evaluate.py phase_s), oldest first."""
    rows = []
    for path in sorted((run_dir / "evaluations").glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            ev = json.loads(path.read_text())
        except ValueError:
            continue
        rows.append({"key": ev.get("key"), "device_s": ev.get("device_s"), "phase_s": ev.get("phase_s"),
                     "failure": ev.get("failure"), "beats_best": ev.get("beats_best")})
    return rows


def vs(name: str | None, other: str, results: dict) -> list[dict]:
    """The found recipe's tok/s over another system's, cell by cell, in the same bench."""
    cells = {cell: {s: r.get("tokens_per_s") for s, r in systems.items()}
             for cell, systems in harness.bench_cells(results).items()}
    return [{"workload": wl, "batch_size": b, "found": c.get(name), "other": c.get(other),
             "ratio": c[name] / c[other] if c.get(name) and c.get(other) else None}
            for (wl, b), c in cells.items() if other in c]
