"""The token-forcing gate on CUDA: a recipe's greedy tokens against the stock AR's, ties forced.

What it measures. `specpilot check` (docs/GATE.md; the candidate in its own process, SPECPILOT_GATE_LAUNCH=
subprocess), bf16, 4 questions x 128 new tokens a workload (`--limit 8` for the B = 8 recipes), for each recipe:
`armiss` (B = 1: the adaptive min-2 n-gram with ar_after_miss on the fused layer, overlap on: verification with
dead slots skipped and AR steps after a miss), `lossless12` (stock with 12-bit weights and the 12-bit linear
kernels; `lossless12-fused` the same on the fused layer, whose steps read the 12-bit planes), `cost-b8` and `ragged-b8` (armiss with the batch controller, padded and ragged, at B = 8), `cost-frac-b16` and
`eagle3-cost-frac-b16` (the controllers with `batch.fractions` at B = 16, `--limit 16`), `ngram-tree` (the
n-gram drafter's two latest matches as a two-branch tree on the fused layer, issue #21), `stock-head` (smollm2's
stock: its packaged EAGLE-3 head's chain of 2, modular layer), `eagle3-k2` and `eagle3-tree` (that head's chain of 2
and a dynamic tree of 8 tokens on the fused layer with overlap), `eagle3-k2-b4` (the chain at B = 4, continuously
batched with `--limit 8`), or a recipe JSON file. Per run:
PASS/FAIL, tokens checked, exact, ties forced. `--identity` adds token identity without forcing (4 prompts x 192
tokens, 2 code and 2 summarization): fp32 against our modular AR, bf16 against the fused AR.

Backs docs/BENCHMARKS.md: the "PASS" of the speculative recipe (seventh lease H, then gate_armiss.sh; identity in
seventh lease E, ar_after_miss.sh with token_identity.py) and of the 12-bit recipe (eighth lease G, then l12_gate.sh),
docs/benchmarks/2026-11-29-seventh-lease.md and 2026-11-29-eighth-lease.md.

Device minutes: about 1 a (recipe, workload), 3 more with `--identity`.
"""
from __future__ import annotations

import json
from pathlib import Path

import harness

MINUTES = 4
RECIPES = {
    "armiss": {"k": 4, "layer": "fused", "overlap": True, "batch": {"max_batch_size": 1},
               "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True, "ar_after_miss": True}},
    "lossless12": {"drafter": {"kind": "ngram"}, "k": 4, "weights": {"format": "lossless12"},
                   "kernels": {"linear": "builtin:lossless12"}},
    # ... on the fused layer, whose steps of up to 6 tokens (k = 4: 5) read the 12-bit planes themselves
    "lossless12-fused": {"drafter": {"kind": "ngram"}, "k": 4, "weights": {"format": "lossless12"},
                         "kernels": {"linear": "builtin:lossless12"}, "layer": "fused", "overlap": True,
                         "batch": {"max_batch_size": 1}},
    # armiss with the batch controller, padded and ragged, gated at B = 8 (the gate's batch is the recipe's
    # max_batch_size): rows of different lengths verified together, packed in the ragged one
    "cost-b8": {"k": 4, "layer": "fused", "overlap": True, "batch": {"max_batch_size": 8, "controller": "cost"},
                "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True, "ar_after_miss": True}},
    "ragged-b8": {"k": 4, "layer": "fused", "overlap": True,
                  "batch": {"max_batch_size": 8, "controller": "cost", "ragged": True},
                  "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True,
                              "ar_after_miss": True}},
    # ... and with the controller's kinds below one draft a row (batch.fractions) at B = 16 (`--limit 16`), where one
    # draft a row is 32 tokens and half a draft 24: steps of 4 and 8 drafts packed across the batch
    "cost-frac-b16": {"k": 4, "layer": "fused", "overlap": True,
                      "batch": {"max_batch_size": 16, "controller": "cost", "fractions": [0.25, 0.5]},
                      "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True,
                                  "ar_after_miss": True}},
    # issue #21: the n-gram drafter's two latest matches as a two-branch tree of depth 4, on the fused layer
    "ngram-tree": {"k": 4, "layer": "fused", "verification": "tree", "batch": {"max_batch_size": 1},
                   "tree": {"kind": "static", "paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0],
                                                        [1], [1, 0], [1, 0, 0], [1, 0, 0, 0]]},
                   "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4}},
    # issues #21 / #22: the packaged EAGLE-3 head, a chain of 2 and an EAGLE-2 dynamic tree (depth 3, topk 2, 8
    # tokens), on the fused layer with overlap
    # smollm2-135m's stock (engine/recipe.stock_recipe): the head's chain of 2 on the modular layer
    "stock-head": {"k": 2, "batch": {"max_batch_size": 1},
                   "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}},
    "eagle3-k2": {"k": 2, "layer": "fused", "overlap": True, "batch": {"max_batch_size": 1},
                  "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}},
    # ... at B = 4 with more questions than rows (`--limit 8`): requests started in rows others finished, the head's
    # rows set up anew for each (continuous batching, Drafter.start_rows)
    "eagle3-k2-b4": {"k": 2, "layer": "fused", "overlap": True, "batch": {"max_batch_size": 4},
                     "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}},
    # ... its chain of up to 3 with the batch controller at B = 8 (`--limit 8`): each step's length 0..3, AR steps
    # with and without the head's search, rows of different lengths
    "eagle3-cost-b8": {"k": 3, "layer": "fused", "overlap": True, "batch": {"max_batch_size": 8, "controller": "cost"},
                       "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}},
    # ... and with fractions at B = 16 (`--limit 16`): a fraction's step drafts one token a row
    "eagle3-cost-frac-b16": {"k": 3, "layer": "fused", "overlap": True,
                             "batch": {"max_batch_size": 16, "controller": "cost", "fractions": [0.25, 0.5]},
                             "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}},
    "eagle3-tree": {"k": 3, "layer": "fused", "overlap": True, "batch": {"max_batch_size": 1},
                    "verification": "tree", "tree": {"kind": "dynamic", "depth": 3, "topk": 2, "tokens": 8},
                    "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}},
}


def arguments(p) -> None:
    p.add_argument("--recipes", default="armiss,lossless12", help=f"{', '.join(RECIPES)} or recipe JSON files")
    p.add_argument("--workloads", default="code,summarize")
    p.add_argument("--limit", type=int, default=4, help="questions a workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--identity", action="store_true", help="also token identity without forcing (fp32 and bf16)")


def recipe_fields(name: str) -> dict:
    return RECIPES[name] if name in RECIPES else json.loads(Path(name).read_text())


def dtype_for(fields: dict, device: str) -> str:
    """bf16 on CUDA; on the CPU (--smoke) fp32, but for 12-bit weights, which encode bf16 weights."""
    return "bf16" if device == "cuda" or (fields.get("weights") or {}).get("format") == "lossless12" else "fp32"


def run(out_dir, args):
    ctx = args.ctx
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, args.limit, args.max_new_tokens)
    reports, rows = {}, []
    for name in args.recipes.split(","):
        fields = recipe_fields(name)
        recipe = ctx.recipe(f"gate-{Path(name).stem}", fields)
        for wl in workloads:
            label = f"gate_{Path(name).stem}_{wl}"
            step = ctx.module(label, "specpilot.cli", [
                "check", "--target", ctx.target, "--recipe", recipe, "--workload", wl, "--limit", limit,
                "--max-new-tokens", tokens, "--device", ctx.device, "--dtype", dtype_for(fields, ctx.device),
                "--out", ctx.scratch / label], timeout=150, env={"SPECPILOT_GATE_LAUNCH": "subprocess"})
            r = json.loads(ctx.need(ctx.scratch / label / "report.json", step).read_text())
            reports[label] = {k: v for k, v in r.items() if k != "per_question"}
            rows.append([name, wl, "**PASS**" if r["passed"] else f"FAIL: {r.get('reason') or r.get('failure')}",
                         r["tokens_checked"], r["exact_matches"], len(r.get("ties") or []),
                         harness.fmt(r.get("epsilon"), ".3g")])
    table = harness.md_table(["recipe", "workload", "verdict", "tokens", "exact", "ties forced", "ε"], rows)
    result = {"ok": all(r["passed"] for r in reports.values()), "gate": reports}
    if args.identity:
        result["identity"] = identity(ctx, args.recipes.split(","), tokens, 1 if args.smoke else 2)
        table += "\n\n" + harness.md_table(
            ["dtype", "configuration", "reference", "identical prompts", "first difference"],
            [[r["dtype"], r["config"], r["reference"], f"{r['identical']}/{r['prompts']}", r["first_diff"]]
             for r in result["identity"]])
    return result, table


def identity(ctx, names: list[str], tokens: int, per_workload: int) -> list[dict]:
    """Token identity at B = 1, nothing forced: in fp32 every configuration must give our modular AR's tokens; in
    bf16 (CUDA) the fused layer's verification must give the fused AR's tokens bit for bit."""
    from specpilot.engine import loader
    from specpilot.engine.engine import Engine
    from specpilot.engine.recipe import parse
    from specpilot.engine.workloads import load_workload

    tokens = max(tokens, 192) if not ctx.smoke else tokens
    configs = {"ar-fused": {"layer": "fused"}}
    configs.update({Path(n).stem: recipe_fields(n) for n in names})
    out = []
    for dtype, ref in (("fp32", "ar"), ("bf16", "ar-fused")):
        if dtype == "bf16" and ctx.device == "cpu":
            continue
        target = loader.load(ctx.target, dtype, ctx.device)
        engines = {"ar": Engine(target, parse({"name": "ar"}))}
        engines.update({n: Engine(target, parse({**f, "name": n})) for n, f in configs.items()
                        if dtype == "bf16" or dtype_for(f, "cpu") == "fp32"})  # 12-bit weights: bf16 only
        questions = load_workload("code", per_workload) + load_workload("summarize", per_workload)
        prompts = [engines["ar"].encode(q.turns[0]) for q in questions]
        decoded = {n: [e.generate([p], tokens, ignore_eos=True)[0].tokens for p in prompts] for n, e in engines.items()}
        for n, rows in decoded.items():
            first = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), None)
                     for r, t in zip(rows, decoded[ref])]
            out.append({"dtype": dtype, "config": n, "reference": ref, "prompts": len(rows),
                        "identical": sum(f is None for f in first), "first_diff": first})
            print(f"identity {dtype} {n} = {ref}: {out[-1]['identical']}/{len(rows)} first diff {first}", flush=True)
        del engines, target
    return out
