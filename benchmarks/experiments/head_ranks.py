"""Where the packaged EAGLE-3 head ranks the target's token: the rank profile a replayed tree needs, measured.

What it measures (issue #24 item 3: a tree recipe at the trained head's profile on an 8B replay). A replayed tree
(engine/replay.py) accepts past its first-child chain only where the target's token is the drafter's 2nd, 3rd, ...
candidate, with the chances `drafter.ranks` gives. They are measured here: one `specpilot bench` at B = 1 on the
staged target (`--head`, the packaged one by default; bf16, 256 new tokens, the five built-in workloads) with the head's chain of depth `--depth` and its
"fishbone" trees of the same depth (the first-child chain with w = 2 .. `--width` candidates at each depth, only the
chain expanded: static trees, so each candidate's rank is its child index), all on the modular layer (what is
measured is acceptance, not speed). A fishbone of width w accepts depth d when the path to it was the chain and the
target's token is one of the head's top w there; `engine.replay.ranks_from_trees` turns the per-depth acceptance of
the chain and the fishbones into the chance of each rank at each depth. Per workload and pooled (the workloads'
acceptance averaged), the pooled one as a replay profile, {"acceptance": the chain's, "ranks": ...}, under
"pooled" in head_ranks.json: the file `replay_8b --rank-profile` reads.

Backs docs/BENCHMARKS.md's replayed-tree figure at 8B (issue #24), once run.

Device minutes: about 3 (five workloads, the chain and three fishbones).
"""
from __future__ import annotations

from pathlib import Path

import harness

MINUTES = 3
HEAD = "smollm2-135m-eagle3"


def arguments(p) -> None:
    p.add_argument("--workloads", default="code,chat,math,summarize,rag")
    p.add_argument("--limit", type=int, default=4, help="prompts a workload")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--depth", type=int, default=4, help="the chain's and the fishbones' depth (replay_8b's k: 4)")
    p.add_argument("--width", type=int, default=4, help="the widest fishbone: candidates at each depth")
    p.add_argument("--head", default=HEAD, help="the head to profile: an alias or a directory (e.g. a train_head "
                                                "run's --run-dir on the warm machine, before it ships)")


def fishbone(depth: int, width: int) -> list[list[int]]:
    """The first-child chain of `depth` with `width` candidates at each depth (children 0..width-1 of each chain
    node; only child 0 has children)."""
    return [[0] * d + [r] for d in range(depth) for r in range(width)]


def run(out_dir, args):
    from specpilot.engine.replay import ranks_from_trees

    ctx = args.ctx
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, args.limit, args.max_new_tokens)
    head = str(Path(args.head).resolve()) if Path(args.head).exists() else args.head  # the bench runs elsewhere
    drafter = {"kind": "eagle3", "model": head}
    names = {1: f"eagle3-chain-{args.depth}"}
    recipes = [ctx.recipe(names[1], {"drafter": drafter, "k": args.depth, "batch": {"max_batch_size": 1}})]
    for w in range(2, args.width + 1):
        names[w] = f"eagle3-fishbone-{args.depth}x{w}"
        recipes.append(ctx.recipe(names[w], {"drafter": drafter, "k": args.depth, "batch": {"max_batch_size": 1},
                                             "verification": "tree",
                                             "tree": {"kind": "static", "paths": fishbone(args.depth, w)}}))
    results = harness.bench_b1(ctx, recipes, workloads, limit, tokens, timeout=560)
    by = {(r["workload"], r["system"]): r["acceptance_by_position"] for r in results["runs"]}

    def profile(acceptance: dict[int, list[float]]) -> dict:
        return {"acceptance": acceptance[1],
                "ranks": ranks_from_trees(acceptance[1], {w: acceptance[w] for w in names if w > 1})}

    per_workload = {}
    for wl in workloads:
        if all((wl, n) in by for n in names.values()):
            per_workload[wl] = profile({w: by[(wl, n)] for w, n in names.items()})
    measured = [wl for wl in workloads if wl in per_workload]
    pooled = None
    if measured:  # each depth's acceptance averaged over the workloads, then turned into ranks
        pooled = profile({w: [sum(by[(wl, n)][d] for wl in measured) / len(measured) for d in range(args.depth)]
                          for w, n in names.items()})
    rows = [[wl] + [harness.fmt(p["acceptance"][d], ".3f") + " / " + ", ".join(f"{c:.3f}" for c in p["ranks"][d])
                    for d in range(args.depth)] for wl, p in {**per_workload, "pooled": pooled or {}}.items() if p]
    table = harness.md_table(["workload"] + [f"depth {d + 1}: a_d / ranks 2..{args.width}" for d in range(args.depth)],
                             rows)
    return {"head": head, "bench": results, "profiles": per_workload, "pooled": pooled}, table
