"""n-gram trees against n-gram chains on the built-in workloads: one `specpilot bench` run at B = 1.

What it measures (issue #21 item 5). SmolLM2-135M bf16, B = 1, the five built-in workloads (4 prompts each), 256 new
tokens. Systems: `ar`, `stock`, our fastest AR (`ar-fused-overlap`), the n-gram chain (min-2, k = 4, fused layer) and
the same drafter's static trees of 2 and 3 branches of 4 drafts (9 and 13 tokens verified a row: the drafter's
latest matches as the branches, `engine/tree.py`), on the fused layer. A tree accepts at least what its first
branch, the chain, does; it pays where the chain's misses are another match's hits and its wider step costs little
more. Tok/s, τ and each system's ratio to our fastest AR in the same cell.

Backs docs/BENCHMARKS.md, n-gram trees against chains (issue #21), once run.

Device minutes: about 6 (five workloads, six systems).
"""
from __future__ import annotations

import harness

MINUTES = 6
FASTEST_AR = "ar-fused-overlap"
CHAIN = {"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4}, "k": 4, "layer": "fused"}


def arguments(p) -> None:
    p.add_argument("--workloads", default="code,chat,math,summarize,rag")
    p.add_argument("--limit", type=int, default=4, help="prompts a workload")
    p.add_argument("--max-new-tokens", type=int, default=256)


def tree(branches: int, depth: int) -> dict:
    """A static tree of `branches` chains of `depth` drafts (the n-gram drafter's latest matches)."""
    return {**CHAIN, "verification": "tree",
            "tree": {"kind": "static", "paths": [[b] + [0] * d for b in range(branches) for d in range(depth)]}}


def run(out_dir, args):
    ctx = args.ctx
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, args.limit, args.max_new_tokens)
    recipes = [ctx.recipe(FASTEST_AR, {"layer": "fused", "overlap": True}), ctx.recipe("ngram2-k4-chain", CHAIN),
               ctx.recipe("ngram2-tree-2x4", tree(2, 4)), ctx.recipe("ngram2-tree-3x4", tree(3, 4))]
    results = harness.bench_b1(ctx, recipes, workloads, limit, tokens, timeout=560)
    tau = {(r["workload"], r["system"]): r["mean_accepted"] for r in results["runs"]}
    systems = ["ngram2-k4-chain", "ngram2-tree-2x4", "ngram2-tree-3x4"]
    lines = harness.md_table(["workload"] + [f"τ {s}" for s in systems],
                             [[wl] + [harness.fmt(tau.get((wl, s)), ".2f") for s in systems] for wl in workloads])
    return {"bench": results}, harness.bench_table(results, FASTEST_AR) + "\n\n" + lines
