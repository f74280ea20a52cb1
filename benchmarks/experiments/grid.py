"""A grid of recipes, each gated, all measured side by side: `specpilot grid`, the yardstick `optimize` must reach.

What it measures (issue #23 item 1; issue #24 item 3 with `--space llama-3.1-8b-replay --target
synthetic:llama-3.1-8b`). One `specpilot grid` run: every recipe of the space (a shipped grid's name or a space
file) through the token-forcing gate (1 prompt of 32 tokens a workload), then every passing one in one bench run
beside ar, stock and our fastest AR (`ar-fused-overlap`, the reference), 2 prompts a workload of 128 new tokens at B
= 1, each timed call measured twice (the median kept). The table: per cell, the grid's recipes by tok/s with their
ratio to the reference, and the grid's best recipe (tools/grid/run.py `best_recipe`: the highest geometric mean of
that ratio over the cells); NAME.json keeps the grid's results.json and best.json.

Sizes: the 10-recipe 8B replay grid fits one device call; the 51-recipe SmolLM2 grid (`--space smollm2`) gates each
recipe in its own process, 4 at a time (`--gate-workers`), and is not yet timed on the H200: give it `--workload
code` and a call of its own (343 s with `--gate-workers 8`, 2026-12-03). The grid writes into
/tmp/specpilot-grid-SPACE-WORKLOADS-bB (harness.grid_dir, not the run's scratch folder), so a call killed at its limit
leaves its gate verdicts to the same command in the next call of the warm machine, which gates only the rest
(tools/grid/run.py), and the optimize experiment benches the grid's best beside its own.

Backs docs/BENCHMARKS.md, "Optimize vs hand-found best" (the grid's best, the yardstick of issue #23) and the 8B
figures (issue #24), once run.

Device minutes: the 51-recipe SmolLM2 grid with `--gate-workers 8`, 5.7 on code and 4.6 on chat (twenty-first
lease, 2026-12-03); MINUTES stays 9 as the limit a chain plans for.
"""
from __future__ import annotations

import json

import harness

MINUTES = 9
TARGET_8B = "synthetic:llama-3.1-8b"


def arguments(p) -> None:
    p.add_argument("--space", default="llama-3.1-8b-replay",
                   help="a shipped grid's name (smollm2, llama-3.1-8b-replay, llama-3.1-8b-head) or a space file")
    p.add_argument("--workload", default="code,chat")
    p.add_argument("--limit", type=int, default=2, help="prompts a workload in the bench")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--gate-tokens", type=int, default=32)
    p.add_argument("--gate-workers", type=int, default=4,
                   help="recipes gated at once (each a candidate process; 16 cores and one GPU on the H200)")


def smoke_space(ctx) -> str:
    """Two small recipes (a chain of 2 and of 4 n-gram drafts) for a CPU smoke run of the whole path."""
    path = ctx.scratch / "smoke-space.json"
    path.write_text(json.dumps({"base": {"specpilot_recipe": 1, "drafter": {"kind": "ngram"}},
                                "axes": {"k": [2, 4]}}))
    return str(path)


def run(out_dir, args):
    ctx = args.ctx
    if args.space.startswith("llama-3.1-8b") and not (args.target or args.smoke):
        ctx.target = TARGET_8B  # the 8B grid's recipes replay acceptance: they need the synthetic target
    workloads, limit, tokens = harness.smoke_sized(args, args.workload, args.limit, args.max_new_tokens)
    grid_dir = ctx.scratch / "grid" if args.smoke else harness.grid_dir(args.space, workloads, args.batch_sizes)
    step = ctx.module("grid", "specpilot.cli", [
        "grid", "--target", ctx.target, "--device", ctx.device, "--space", smoke_space(ctx) if args.smoke else args.space,
        "--workload", ",".join(workloads), "--limit", limit, "--max-new-tokens", tokens,
        "--batch-sizes", args.batch_sizes, "--repeats", 1 if args.smoke else 2, "--gate-limit", 1,
        "--gate-tokens", 8 if args.smoke else args.gate_tokens, "--gate-workers", 1 if args.smoke else args.gate_workers,
        "--out", grid_dir,
        *(["--dtype", "fp32"] if args.smoke else [])], timeout=560)
    results = json.loads(ctx.need(grid_dir / "results.json", step).read_text())
    grid = results["grid"]
    best_file = grid_dir / "best.json"
    rows = []
    for cell in grid.get("ranking", []):
        for r in cell["rows"]:
            rows.append([cell["workload"], cell["batch_size"], r["system"], r["kind"],
                         harness.fmt(r["tokens_per_s"], ",.0f"), harness.fmt(r["ratio"], ".2f"),
                         harness.fmt(r["mean_accepted"], ".2f")])
    gate = {g["name"]: g["verdict"] for g in grid.get("gate", [])}
    failed = {n: v for n, v in gate.items() if v != "pass"}
    best = grid.get("best")
    table = harness.md_table(["workload", "B", "system", "kind", "tok/s", "over ar-fused-overlap", "τ"], rows)
    table += (f"\n\nGate: {sum(v == 'pass' for v in gate.values())} of {len(gate)} recipes passed"
              + (f"; not passed: {', '.join(f'{n} ({v})' for n, v in failed.items())}" if failed else "") + ".")
    table += (f"\n\nBest: {best['name']} ({best['score_is']} {best['score']:.3f})." if best else "\n\nNo best recipe.")
    return {"grid": grid, "best": json.loads(best_file.read_text()) if best_file.is_file() else None,
            "bench_errors": results.get("errors", [])}, table
