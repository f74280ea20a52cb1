"""The cost model's predicted step time against the engine's measured one on a GPU, as one markdown table.

    python -m specpilot.tools.profile.costmodel_validate [--target smollm2-135m] [--batch-sizes 1,8,32]
        [--ks 0,1,2,4,8,16] [--trees 2x4,4x4] [--head-ks 2,4] [--head-trees 3x2x8,4x4x16] [--max-new-tokens 128]
        [--recalibrate] [--out FILE.json]

For each batch size B and k (0 = AR; k >= 1 = chain verification with the n-gram drafter), and each static n-gram
tree of `--trees` (BxD: B branches of D drafts, N = B x D + 1 nodes verified a row), each chain of `--head-ks`
drafts and each EAGLE-2 dynamic tree of `--head-trees` (DxKxN: depth, topk, tokens) of the target's packaged EAGLE-3
head (`--head`: another head directory), it builds the engine
with the default recipe settings (compiled, CUDA graphs, math attention), decodes B distinct prompts twice with
EOS ignored (the first run compiles and captures), then measures `replay`: the device time of one captured step
(the graph replayed 20 times between CUDA events), and `loop`: decode time per step of the real loop, host
included. The kernels one replay launches are counted with torch.profiler: a structural input of the model (a
count, not a time); the drafter's kernels are the chain step's count less the AR step's at that B (a head's: that
difference over its forwards a step, k for a chain, D for a tree). The prediction
uses only those counts, the calibrated ceilings (`specpilot calibrate`) and the model's shape; `est` is the
prediction with kernel counts estimated from the structure alone. The error is predicted / replay - 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

import torch

from ...engine import loader
from ...engine.engine import Engine
from ...engine.recipe import parse
from ...engine.workloads import load_workload
from ..argtypes import add_target_argument
from .calibrate import load_or_measure
from ...engine.tree import DynamicTree
from .costmodel import KERNELS_BOOKKEEPING, Deployment, ModelShape, eagle3_shape, predict, tree_draft_widths
from .native_stderr import quiet_profile

TOLERANCE = 0.25


def measure(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> dict:
    engine.generate(prompts, max_new_tokens, ignore_eos=True)  # compile, capture
    engine.generate(prompts, max_new_tokens, ignore_eos=True)
    dec, stats = engine.decoder, engine.decoder.last_stats
    replay_s = dec.time_graph_replay()
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dec.replay_once()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"replay_s": replay_s, "loop_s": stats.decode_s / stats.steps, "kernels": kernels,
            "context_len": dec._cache.max_len}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_argument(ap, default="smollm2-135m")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--ks", default="0,1,2,4,8,16", help="0 = AR, else chain verification with the n-gram drafter")
    ap.add_argument("--trees", default="", help="static n-gram trees, BxD each (B branches of D drafts), e.g. 2x4,4x4")
    ap.add_argument("--head-ks", default="", help="chains of the EAGLE-3 head, k drafts each, e.g. 2,4")
    ap.add_argument("--head-trees", default="",
                    help="EAGLE-2 dynamic trees of the head, DxKxN each (depth, topk, tokens), e.g. 3x2x8,4x4x16")
    ap.add_argument("--head", default=None, help="the EAGLE-3 head (default: the target's packaged head)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--workload", default="code")
    ap.add_argument("--recalibrate", action="store_true", help="measure the ceilings again")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("costmodel_validate needs CUDA", file=sys.stderr)
        return 2
    dev = load_or_measure("cuda", force=args.recalibrate)
    target = loader.load(args.target, "bf16", "cuda")
    shape = ModelShape.from_config(target.model.cfg)
    cases = [(int(k), None) for k in args.ks.split(",")]
    if 0 not in [k for k, _ in cases]:
        cases.insert(0, (0, None))  # AR first: the drafter's kernels are counted against it
    for tree in filter(None, args.trees.split(",")):
        branches, depth = (int(v) for v in tree.split("x"))
        cases.append((depth, [[b] + [0] * d for b in range(branches) for d in range(depth)]))
    head = args.head or next(iter(loader.packaged_heads(args.target)), None)
    heads = [(int(k), None) for k in filter(None, args.head_ks.split(","))]
    trees = [DynamicTree(*map(int, s.split("x"))) for s in filter(None, args.head_trees.split(","))]
    heads += [(t.depth, t) for t in trees]
    if heads and head is None:
        ap.error(f"--head-ks / --head-trees: {args.target} has no packaged head; name one with --head")
    cases += [(k, ("head", tree)) for k, tree in heads]
    questions = load_workload(args.workload)
    print(f"<!-- {' '.join(['python -m specpilot.tools.profile.costmodel_validate'] + (argv or sys.argv[1:]))} -->")
    print(f"<!-- {time.strftime('%Y-%m-%d')}, torch {torch.__version__}; {dev.name}: copy "
          f"{dev.copy_bytes_per_s / 1e12:.2f} TB/s, matmul {dev.matmul_flops_per_s / 1e12:.0f} TFLOP/s, launch "
          f"{dev.launch_s * 1e6:.2f} us, graph node {dev.graph_node_s * 1e6:.2f} us, GEMM node "
          f"{(dev.gemm_node_s or dev.graph_node_s) * 1e6:.2f} us -->\n")
    print("| B | recipe | k | kernels | measured replay ms | loop ms | predicted ms | error | est. ms | est. error"
          " | memory floor ms | launch floor ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows, failed = [], []

    def write(rows, failed):
        """The rows so far, rewritten after each: a crash later in the run keeps what was measured."""
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"ceilings": asdict(dev), "rows": rows, "failed": failed}, f, indent=2)

    for B in map(int, args.batch_sizes.split(",")):
        ar_kernels = None
        prompts = None
        for k, paths in cases:
            spec = {"name": f"ngram-k{k}" if k else "ar"} | ({"drafter": {"kind": "ngram"}, "k": k} if k else {})
            head_tree = paths[1] if isinstance(paths, tuple) else None
            if isinstance(paths, tuple):  # the EAGLE-3 head: a chain, or a dynamic tree
                spec = {"name": f"eagle3-k{k}", "drafter": {"kind": "eagle3", "model": head}, "k": k}
                if head_tree is not None:
                    t = head_tree
                    spec |= {"name": f"eagle3-dyn-d{t.depth}-k{t.topk}-t{t.tokens}", "verification": "tree",
                             "tree": {"kind": "dynamic", "depth": t.depth, "topk": t.topk, "tokens": t.tokens}}
            elif paths:
                spec |= {"name": f"ngram-tree-{len(paths) // k}x{k}", "verification": "tree",
                         "tree": {"kind": "static", "paths": paths}}
            try:
                engine = Engine(target, parse(spec))
                prompts = prompts or [engine.encode(questions[i % len(questions)].turns[0]) for i in range(B)]
                m = measure(engine, prompts, args.max_new_tokens)
            except Exception as e:  # one failed step shape is that row's error; the others are still measured
                failed.append({"batch": B, "k": k, "recipe": spec["name"], "error": f"{type(e).__name__}: {e}"})
                print(f"| {B} | {spec['name']} | {k} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)
                write(rows, failed)
                continue
            if k == 0:
                ar_kernels = m["kernels"]
            drafted = m["kernels"] - ar_kernels if k and ar_kernels else None
            if isinstance(paths, tuple):
                head_cfg = engine.decoder.drafter.head.cfg
                dep = Deployment(shape, 2, 2, B, k, "eagle3", drafter_model=eagle3_shape(head_cfg),
                                 context_len=m["context_len"],
                                 kernels_per_target_forward=ar_kernels - KERNELS_BOOKKEEPING if ar_kernels else None,
                                 kernels_per_draft_forward=drafted // k if drafted else None,
                                 kernels_bookkeeping=KERNELS_BOOKKEEPING, cuda_graphs=True,
                                 tree_nodes=head_tree.tokens if head_tree else None,
                                 draft_widths=tree_draft_widths(head_tree) if head_tree else None)
            else:
                dep = Deployment(shape, 2, 2, B, k, "ngram" if k else "none", context_len=m["context_len"],
                                 kernels_per_target_forward=ar_kernels - KERNELS_BOOKKEEPING if ar_kernels else None,
                                 kernels_per_draft_forward=drafted, kernels_bookkeeping=KERNELS_BOOKKEEPING,
                                 cuda_graphs=True, tree_nodes=len(paths) + 1 if paths else None)
            p = predict(dep, dev)
            est = predict(replace(dep, kernels_per_target_forward=None, kernels_per_draft_forward=None), dev)
            err, est_err = p.step_s / m["replay_s"] - 1, est.step_s / m["replay_s"] - 1
            rows.append({"batch": B, "k": k, "recipe": spec["name"], **m, "predicted_s": p.step_s, "error": err, "estimated_s": est.step_s,
                         "estimated_error": est_err, "memory_floor_s": p.memory_floor_s,
                         "launch_floor_s": p.launch_floor_s, "deployment": asdict(dep)})
            print(f"| {B} | {spec['name']} | {k} | {m['kernels']} | {m['replay_s'] * 1e3:.3f} | "
                  f"{m['loop_s'] * 1e3:.3f} | {p.step_s * 1e3:.3f} | {err:+.0%} | {est.step_s * 1e3:.3f} | "
                  f"{est_err:+.0%} | {p.memory_floor_s * 1e3:.3f} | {p.launch_floor_s * 1e3:.3f} |", flush=True)
            del engine
            write(rows, failed)
    ok = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    print(f"\n{ok} of {len(rows)} predictions within {TOLERANCE:.0%} of the measured replay time"
          + (f"; {len(failed)} shapes failed" if failed else "") + ".")
    return 0 if ok == len(rows) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
