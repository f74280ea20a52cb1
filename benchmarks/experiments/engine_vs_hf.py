"""Our engine beside HF transformers at B = 1: our AR and drafters against HF's caches and prompt lookup.

What it measures: one engine_bench process (tools/bench/engine_bench.py), SmolLM2-135M bf16, B = 1, 256 new tokens (EOS
ignored), 5 code and 5 summarization prompts; median tok/s of each system, each prompt timed from the call to the
last token (prefill included), systems rotated per prompt: our modular AR (cuBLAS), our fastest AR (fused layer with
host/device overlap), chain decoding with the n-gram drafter (stock; adaptive min-2; with ar_after_miss), the
layer-skip and fp16 self-drafts, and HF. Also the weight-read floor (weights over the measured copy bandwidth).

Backs docs/BENCHMARKS.md, "Engine vs HF" ("our fastest AR is 7.2x HF's static cache"): the seventh lease's call G,
docs/benchmarks/2026-11-29-seventh-lease.md (then the H200 script final_seventh.sh).

Device minutes: about 9 (the engine_bench process has 560 s).
"""
from __future__ import annotations

import harness

MINUTES = 9
SYSTEMS = ("ar,ar-fused-overlap,ngram-k4,ngram2-k4-adaptive-fused-overlap,ngram2-k4-adaptive-armiss-fused-overlap,"
           "layerskip8-k4-fused,selfdraft-fp16-k4-fused")
FASTEST_AR = "ar-fused-overlap"


def arguments(p) -> None:
    harness.engine_bench_arguments(p, SYSTEMS, hf="dynamic,static,prompt-lookup")


def run(out_dir, args):
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, args.limit, args.max_new_tokens)
    result = harness.engine_bench(args.ctx, "engine_bench", args.systems.split(","), workloads, limit, tokens,
                                  hf=args.hf, timeout=560)
    tps = {(t["system"], t["workload"]): t["tokens_per_s"] for t in result["table"]}
    over_hf = {wl: tps[(FASTEST_AR, wl)] / tps[("hf-static", wl)] for wl in workloads
               if (FASTEST_AR, wl) in tps and tps.get(("hf-static", wl))}
    rows = []
    for t in result["table"]:
        ar, fast = tps.get(("ar", t["workload"])), tps.get((FASTEST_AR, t["workload"]))
        rows.append([t["system"], t["workload"], f"{t['tokens_per_s']:,.1f}",
                     harness.fmt(ar and t["tokens_per_s"] / ar, ".2f"),
                     harness.fmt(fast and t["tokens_per_s"] / fast, ".2f"),
                     harness.fmt(t["ms_per_target_step"], ".3f"), harness.fmt(t["tau"], ".2f")])
    table = harness.md_table(["system", "workload", "tok/s", "vs our modular AR", f"vs {FASTEST_AR}", "ms/step", "τ"],
                             rows)
    floor = (f"Weight-read floor {result['floor_s'] * 1e6:.1f} µs a step ({result['weight_bytes'] / 1e6:.1f} MB at "
             f"{result['copy_bandwidth'] / 1e12:.2f} TB/s).")
    lines = [f"Our fastest AR over HF's static cache, {wl}: **{r:.2f}x**." for wl, r in over_hf.items()]
    return ({"engine_bench": result, "fastest_ar_over_hf_static": over_hf},
            "\n\n".join([table, floor, " ".join(lines)]))
