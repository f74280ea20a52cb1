"""An 8B deployment with replayed acceptance: AR against its weight-read floor, 12-bit AR, chain recipes at two profiles.

What it measures (issue #24 items 1-3, B = 1 by default). One `specpilot bench` run on `synthetic:llama-3.1-8b`
(engine/synthetic.py: Llama-3.1-8B's architecture and shapes, weights drawn on the device; `--target` names another),
bf16, code and chat prompts (2 each, the packaged SmolLM2 tokenizer), 128 new tokens, no EOS. Systems: `ar`, `stock`
(whose n-gram drafts of a random model's text mean nothing), AR on the fused and on the modular layer with overlap
(`ar-fused-overlap`, `ar-overlap`: the report gives each speculative system over the faster of the two), 12-bit AR
on the modular layer and on the fused one (`ar-lossless12`, `ar-lossless12-fused-overlap`), AR with the Triton attention and with the Triton GEMV (`ar-attention-triton`,
`ar-linear-triton`: the levers the eighteenth lease's profile of AR named), and two replay recipes (engine/replay.py: the target's own AR continuation, corrupted to a
profile, drafted at the cost of an EAGLE-3 head of the target's shape with random weights), chained, k = 4, on the
fused layer with overlap:
- `replay-head-code`: the profile our trained SmolLM2 head reached on code at B = 1 (the fourteenth lease's
  `train_head` bench, eagle3-k4: a = 0.346, 0.145, 0.063, 0.044; docs/benchmarks/2026-12-02-fourteenth-lease.md, B);
- `replay-bar`: the acceptance issue #22 aims at, τ = 3.5 with k = 4 (a constant keep rate of 0.82: a = 0.82,
  0.672, 0.551, 0.452). A target, not a measurement; the report says so.
and the same two profiles on a static tree of 16 nodes, depth 4 (`replay-tree-*`: three branches at the first level,
each a chain, plus a second child below each first-level node: the nodes a tree verifies cost what they cost; the
accepted depth follows the profile). Each replay recipe runs on each layer `--layers` names (default both: on the
fused layer under its own name, on the modular one as `...-modular`, with overlap either way): at 8B the fused layer
lost to the modular one at B = 8 (0.61x; seventeenth lease, D). Those trees accept along their first chain only
(their profiles say nothing of second candidates); `--rank-profile` (the `head_ranks` experiment's result: the
trained head's chain profile and its 2nd-4th candidates' chances, measured) adds `replay-ranks` and
`replay-tree-ranks`, the tree's siblings holding the target's token with the measured chances, and
`replay-tree-bestN`: the static tree of N drafts that accepts the most under that profile
(`engine.replay.best_static_tree`, for each N of `--best-tree-drafts`; at 8B a verification of more tokens costs
little more). Each chain also runs under the batch controller (`...-cost`) and with ragged verification
(`...-ragged`) when a batch size is over 1 or `--systems` names them: issue #24's B = 1...64, e.g. `--batch-sizes
1,2,4,8,16,32,64 --systems ar-fused-overlap,ar-overlap,replay-ranks,replay-ranks-cost,replay-ranks-ragged`.
Also the weight-read floor of an AR step: the bytes of every weight a step reads (the layers' and the LM head's, not
the embedding table) over the device's measured copy bandwidth (bytes moved a second), and our fastest AR's tok/s
against it.

Backs docs/BENCHMARKS.md's 8B figures (issue #24), every one marked `replay` or `synthetic`.

Device minutes: 1-6 as measured (the 8B target is drawn once; each system compiles and captures its steps): 4
systems at B = 1 on code 61 s; 5 systems at B = 1, 2, 4, 8 276 s, at B = 16, 32, 64 359 s (twenty-eighth lease); 8
systems on code and chat 155 s (twenty-seventh). MINUTES stays 8 as the limit a chain plans for.
"""
from __future__ import annotations

import json
from pathlib import Path

import harness

MINUTES = 8
FASTEST_AR = "ar-fused-overlap"
MODULAR_AR = "ar-overlap"  # the modular layer with overlap: at 8B the faster AR once a step has several tokens
TARGET = "synthetic:llama-3.1-8b"
HEAD_CODE = [0.346, 0.145, 0.063, 0.044]  # fourteenth lease, train_head's bench: eagle3-k4 on code, B = 1
BAR = [round(0.82 ** i, 3) for i in range(1, 5)]  # issue #22's bar: tau 1 + sum(a) = 3.5 at k = 4
# 16 nodes, depth 4: three first-level branches of four drafts each, and a second child under each first-level node
TREE = ([[b] + [0] * d for b in range(3) for d in range(4)] + [[b, 1] for b in range(3)])


def arguments(p) -> None:
    p.add_argument("--workloads", default="code,chat")
    p.add_argument("--limit", type=int, default=2,
                   help="prompts a workload (random weights, no EOS: they differ only in length)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--layers", default="fused,modular",
                   help="the replay recipes on each of these layers (fused: with overlap; modular ones named "
                        "...-modular): at 8B the fused layer lost to the modular one at B = 8 (seventeenth lease)")
    p.add_argument("--rank-profile", default=None,
                   help="a head_ranks.json (its pooled profile), a {\"acceptance\", \"ranks\"} file or a packaged "
                        "head's name (smollm2-135m-eagle3: its measured profile): adds "
                        "replay-tree-ranks, the tree at that measured profile, whose 2nd and 3rd candidates count")
    p.add_argument("--best-tree-drafts", default="15,31",
                   help="with --rank-profile: the best static trees of these many drafts (replay-tree-bestN)")
    p.add_argument("--systems", default=None,
                   help="only these of the recipes, comma-separated (e.g. the AR ones: ar-fused-overlap,ar-overlap)")


def rank_profile(path: str) -> dict:
    """A measured replay profile with ranks: head_ranks.json's pooled one, a file of its own, or a packaged head's
    (its name: the profile shipped beside it)."""
    from specpilot.tools.argtypes import shipped_profile

    data = json.loads((shipped_profile(path) or Path(path)).read_text())
    data = (data.get("results") or {}).get("pooled", data)  # (a head_ranks.json record: its results)
    if not isinstance(data, dict) or "acceptance" not in data or "ranks" not in data:
        raise SystemExit(f"--rank-profile {path}: no replay profile ({{\"acceptance\", \"ranks\"}}) in it")
    if len(data["acceptance"]) != 4:
        raise SystemExit(f"--rank-profile {path}: measured at depth {len(data['acceptance'])}; the trees here are 4 "
                         "deep (head_ranks --depth 4)")
    return data


def recipes(ctx, layers=("fused",), ranks: dict | None = None, best_trees: tuple[int, ...] = ()) -> list:
    """The recipe files; with --smoke (fp32 on the CPU) no 12-bit one, which encodes bf16 weights. The replay recipes
    once per layer: on the fused layer with overlap under their own names, on another with the layer's name added."""
    fast = {"layer": "fused", "overlap": True}
    l12 = {"weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}}
    # 12-bit AR on the modular layer, and on the fused one (whose one-token steps read the 12-bit planes)
    twelve = [] if ctx.smoke else [ctx.recipe("ar-lossless12", l12),
                                   ctx.recipe("ar-lossless12-fused-overlap", {**l12, **fast})]
    # AR with the Triton attention (reads only the cache blocks a row has written; the default math attention reads
    # all 512 slots, 0.18 ms of an 8B step) and the Triton GEMV (q/k/v and o ran at 76-78% of the bandwidth with
    # cuBLAS): the eighteenth lease's profile of AR at 8B (G); CUDA only
    slots = [] if ctx.smoke else [ctx.recipe(f"ar-{slot}-triton", {"overlap": True, "kernels": {slot: "builtin:triton"}})
                                  for slot in ("attention", "linear")]
    out = [ctx.recipe(FASTEST_AR, fast), ctx.recipe(MODULAR_AR, {"overlap": True}), *twelve, *slots]
    for layer in layers:
        on, suffix = (fast, "") if layer == "fused" else ({"layer": layer, "overlap": True}, f"-{layer}")
        for name, profile in (("head-code", HEAD_CODE), ("bar", BAR)):
            drafter = {"kind": "replay", "model": "random-eagle3", "acceptance": profile}
            out.append(ctx.recipe(f"replay-{name}{suffix}", {"drafter": drafter, "k": 4, **on}))
            out += controlled(ctx, f"replay-{name}{suffix}", {"drafter": drafter, "k": 4, **on})
            out.append(ctx.recipe(f"replay-tree-{name}{suffix}", {"drafter": drafter, "k": 4, **on,
                                                                   "verification": "tree",
                                                                   "tree": {"kind": "static", "paths": TREE}}))
        if ranks is not None:  # the measured head's profile, its siblings' chances included
            from specpilot.engine.replay import best_static_tree

            drafter = {"kind": "replay", "model": "random-eagle3", "acceptance": ranks["acceptance"],
                       "ranks": ranks["ranks"]}
            chain = {"drafter": {**drafter, "ranks": []}, "k": 4, **on}
            out += [ctx.recipe(f"replay-ranks{suffix}", chain), *controlled(ctx, f"replay-ranks{suffix}", chain)]
            out.append(ctx.recipe(f"replay-tree-ranks{suffix}", {"drafter": drafter, "k": 4, **on,
                                                                  "verification": "tree",
                                                                  "tree": {"kind": "static", "paths": TREE}}))
            for n in best_trees:
                paths = best_static_tree(ranks["acceptance"], ranks["ranks"], n)
                out.append(ctx.recipe(f"replay-tree-best{n}{suffix}", {
                    "drafter": drafter, "k": max(map(len, paths)), **on, "verification": "tree",
                    "tree": {"kind": "static", "paths": paths}}))
    return out


def controlled(ctx, name: str, chain: dict) -> list:
    """A chain under the batch controller (`NAME-cost`: each step's draft length 0..k for the whole batch, from the
    measured acceptance and the step prices) and with ragged verification (`NAME-ragged`: only live drafts packed):
    issue #24's B = 1...64, where verifying B x 5 tokens stops being nearly free."""
    return [ctx.recipe(f"{name}-cost", {**chain, "batch": {"controller": "cost"}}),
            ctx.recipe(f"{name}-ragged", {**chain, "batch": {"controller": "cost", "ragged": True}})]


def weight_bytes(target: str) -> int | None:
    """Bytes of the weights an AR step reads (bf16): every layer's matrices and norms, the final norm, the LM head
    (the embedding table's one row is left out), from the synthetic target's published config; None for others."""
    from specpilot.engine import synthetic

    name = target[len(synthetic.PREFIX):] if synthetic.is_synthetic(target) else None
    c = synthetic.CONFIGS.get(name) if name else None
    if c is None:
        return None
    H, inter, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    D = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    per_layer = H * (q + 2 * kv) + q * H + 3 * H * inter + 2 * H
    return 2 * (L * per_layer + H + V * H)


def best_ar_note(results: dict) -> str:
    """Each cell's fastest AR (of the fused and the modular layer, with overlap) and every speculative system's ratio
    to it: which layer is our fastest AR depends on the model and the batch (at 8B, B = 8: the modular one)."""
    lines = []
    for (wl, b), cell in harness.bench_cells(results).items():
        ars = {s: r["tokens_per_s"] for s, r in cell.items() if s in (FASTEST_AR, MODULAR_AR) and r}
        if not ars:
            continue
        best = max(ars, key=ars.get)
        ratios = ", ".join(f"{s} {r['tokens_per_s'] / ars[best]:.2f}x" for s, r in cell.items()
                           if r and s.startswith("replay"))
        lines.append(f"- {wl} B={b}: {best} {ars[best]:,.0f} tok/s; {ratios}")
    return "Over each cell's fastest AR:\n\n" + "\n".join(lines)


def tree_note(results: dict, chosen: list, ranks: dict) -> str:
    """Each static tree's τ under the measured rank profile (`engine.replay.expected_accepted` + 1) beside the τ its
    replay reached: whether the replay follows the profile it was given."""
    from specpilot.engine.replay import expected_accepted

    lines = []
    for r in chosen:
        recipe = json.loads(Path(r).read_text())
        if (recipe.get("tree") or {}).get("kind") != "static" or "ranks" not in recipe.get("drafter", {}):
            continue
        tau = 1 + expected_accepted(ranks["acceptance"], ranks["ranks"], recipe["tree"]["paths"])
        measured = ", ".join(f"{x['workload']} {x['mean_accepted']:.2f}" for x in results["runs"]
                             if x["system"] == r.stem and x.get("mean_accepted"))
        lines.append(f"- {r.stem} ({len(recipe['tree']['paths'])} drafts): τ {tau:.2f} under the profile; "
                     f"measured {measured or '-'}")
    return "Static trees at the measured rank profile:\n\n" + "\n".join(lines)


def run(out_dir, args):
    import torch

    ctx = args.ctx
    if not (args.target or args.smoke):
        ctx.target = TARGET
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, args.limit, args.max_new_tokens)
    argv = ["--workload", ",".join(workloads), "--batch-sizes", args.batch_sizes, "--max-new-tokens", tokens,
            "--limit", limit, "--baselines", "none"]
    layers = tuple(filter(None, args.layers.split(",")))
    unknown = sorted(set(layers) - {"fused", "modular"})
    if unknown:
        raise SystemExit(f"--layers: {', '.join(unknown)} (of fused, modular)")
    best_trees = tuple(int(n) for n in args.best_tree_drafts.split(",") if n)
    chosen = recipes(ctx, layers, rank_profile(args.rank_profile) if args.rank_profile else None, best_trees)
    if args.systems:
        wanted = args.systems.split(",")
        unknown = sorted(set(wanted) - {r.stem for r in chosen})
        if unknown:
            raise SystemExit(f"--systems: {', '.join(unknown)} (of {', '.join(r.stem for r in chosen)})")
        chosen = [r for r in chosen if r.stem in wanted]
    elif max(map(int, str(args.batch_sizes).split(","))) == 1:  # the controller has nothing to choose at B = 1 alone
        chosen = [r for r in chosen if not r.stem.endswith(("-cost", "-ragged"))]
    for r in chosen:
        argv += ["--recipe", r]
    floor = None
    weights = weight_bytes(ctx.target)
    if weights and torch.cuda.is_available():
        from specpilot.tools.bench.engine_bench import copy_bandwidth

        bandwidth = copy_bandwidth("cuda")  # bytes moved a second, read and written alike
        floor = {"weight_bytes": weights, "read_bytes_per_s": bandwidth, "tokens_per_s": bandwidth / weights}
        torch.cuda.empty_cache()
    results = harness.specpilot_bench(ctx, "bench", argv, timeout=560)
    table = harness.bench_table(results, FASTEST_AR)
    from specpilot.engine.synthetic import is_synthetic

    what = "random weights, timing only" if is_synthetic(ctx.target) else "real weights"
    notes = [f"Target {ctx.target} ({what}); `replay-head-code` replays the trained SmolLM2 head's measured profile "
             f"{HEAD_CODE}, `replay-bar` issue #22's aim {BAR} (a target, not a measurement)."]
    if floor:
        ar = {(r["system"], r["workload"]): r["tokens_per_s"] for r in results["runs"]
              if r["batch_size"] == 1 and r["system"].startswith("ar") and "lossless12" not in r["system"]
              and r["tokens_per_s"]}
        notes.append(f"Weight-read floor of an AR step: {weights / 1e9:.2f} GB at {floor['read_bytes_per_s'] / 1e12:.2f} "
                     f"TB/s (the measured copy bandwidth), {floor['tokens_per_s']:.1f} tok/s at B = 1; "
                     + "; ".join(f"{system} {wl}: {v:.1f} tok/s, {v / floor['tokens_per_s']:.0%} of it"
                                 for (system, wl), v in ar.items()))
    notes.append(best_ar_note(results))
    if args.rank_profile:
        notes.append(tree_note(results, chosen, rank_profile(args.rank_profile)))
    return {"bench": results, "floor": floor, "profiles": {"replay-head-code": HEAD_CODE, "replay-bar": BAR}}, \
        table + "\n\n" + "\n\n".join(notes)
