"""Speculative vs AR per workload: the adaptive min-2 n-gram drafter with ar_after_miss against our fastest AR.

What it measures. At B = 1 (the default): engine_bench (tools/bench/engine_bench.py) without HF, SmolLM2-135M bf16, 256
new tokens, 5 code and 5 summarization prompts, systems rotated per prompt: ar-fused-overlap (our fastest AR), the
adaptive min-2 n-gram, and the same with ar_after_miss (the shipped speculative recipe); tok/s and the ratio to our
fastest AR in the same process. `--search kernel,torch` runs it once per n-gram search (the Triton kernel, the
compiled torch search) in two processes. With `--batch-sizes 8,32`: one `specpilot bench` run instead (ar, stock,
the fused AR and the recipe side by side in each (workload, batch size) cell; 128 new tokens, 32 prompts, 8 requests
a cell, `--baselines hf` adds HF), the batched figures issue #20 measured.

Backs docs/BENCHMARKS.md, "Speculative vs AR": B = 1 from the eighth lease's call I (1.29x / 1.07x our fastest
AR with the Triton search), docs/benchmarks/2026-11-29-eighth-lease.md; earlier the seventh lease's E and G
(ar_after_miss.sh, final_seventh.sh). Batched: the second lease's five-workload table (bench_costmodel.sh).

Device minutes: about 5 for one search, 9 for `--search kernel,torch`; about 6 for `--batch-sizes 8,32`.
"""
from __future__ import annotations

import harness

MINUTES = 5
FASTEST_AR = "ar-fused-overlap"
RECIPE = "ngram2-k4-adaptive-armiss-fused-overlap"
SYSTEMS = f"{FASTEST_AR},ngram2-k4-adaptive-fused-overlap,{RECIPE}"


def arguments(p) -> None:
    harness.engine_bench_arguments(p, SYSTEMS)
    p.add_argument("--search", default="kernel", help="n-gram search(es) to run, one process each: kernel, torch")
    p.add_argument("--batch-sizes", default=None, help="e.g. 8,32: a `specpilot bench` run at these batch sizes "
                                                       "(then 32 prompts a workload, 128 new tokens)")
    p.add_argument("--baselines", default=None, help="batched: `hf` adds HF's static cache and prompt lookup")


def run(out_dir, args):
    if args.batch_sizes:
        return batched(args)
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, args.limit, args.max_new_tokens)
    results = {search: harness.engine_bench(args.ctx, f"engine_bench_{search}", args.systems.split(","), workloads,
                                            limit, tokens, hf=args.hf, search=search, timeout=270)
               for search in args.search.split(",")}
    per_prompt = {}
    for search, r in results.items():   # the recipe's ratio to our fastest AR prompt by prompt
        base = {(x["workload"], x["prompt"]): x["tokens"] / x["seconds"]
                for x in r["rows"] if x["system"] == FASTEST_AR}
        per_prompt[search] = {wl: [round(x["tokens"] / x["seconds"] / base[(wl, x["prompt"])], 2) for x in r["rows"]
                                   if x["system"] == RECIPE and x["workload"] == wl and (wl, x["prompt"]) in base]
                              for wl in workloads}
    notes = [f"{RECIPE} over {FASTEST_AR} per prompt ({s} search): "
             + "; ".join(f"{wl} {', '.join(map(str, v))}" for wl, v in pp.items()) for s, pp in per_prompt.items()]
    return ({"engine_bench": results, "per_prompt_over_fastest_ar": per_prompt},
            harness.tok_s_table(results, FASTEST_AR) + "\n\n" + "\n\n".join(notes))


def batched(args):
    """`specpilot bench` of the fused AR and the recipe beside ar and stock, at the given batch sizes."""
    from specpilot.tools.bench.engine_bench import SYSTEMS as S

    ctx = args.ctx
    sizes = args.batch_sizes.split(",")
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, 32, 128)
    if args.smoke:
        sizes, limit = sizes[:1], int(sizes[0])
    recipes = [ctx.recipe(name, S[name]) for name in (FASTEST_AR, RECIPE)]
    argv = ["--workload", ",".join(workloads), "--batch-sizes", ",".join(sizes), "--max-new-tokens", tokens,
            "--limit", limit, "--cell-requests", 1 if args.smoke else 8]
    for r in recipes:
        argv += ["--recipe", r]
    if args.baselines:
        argv += ["--baselines", args.baselines]
    results = harness.specpilot_bench(ctx, "bench", argv, timeout=560)
    return {"bench": results}, harness.bench_table(results, FASTEST_AR)
