"""The cost model against measured steps: predicted vs replayed step time at B = 1, 8, 32.

What it measures: `python -m specpilot.tools.profile.costmodel_validate --batch-sizes 1,8,32 --ks 0,1,4,16` on SmolLM2-135M
bf16: the device's ceilings (copy bandwidth, matmul, launch, graph node, GEMM node; calibrated anew with
`--recalibrate`), then for each (B, k) the engine's captured step replayed between CUDA events and its real loop,
against the cost model's prediction from the step's kernel count and bytes; how many predictions fall within 25%.
`--trees 2x4,4x4` adds static n-gram tree steps (issue #21); `--head-ks 2,4 --head-trees 3x2x8,4x4x16` chains and
EAGLE-2 dynamic trees (depth x topk x tokens) of the packaged EAGLE-3 head (issue #21: a head's tree step priced);
`--target synthetic:llama-3.1-8b` the bandwidth-bound regime (issue #24 item 4).

Backs docs/BENCHMARKS.md (cost model, issue #4's 25% bound): the third lease's validation table (12 of 12 within
25%; then bench_costmodel.sh), docs/benchmarks/2026-11-29-third-lease.md.

Device minutes: about 3.
"""
from __future__ import annotations

import json

MINUTES = 3
CUDA_ONLY = True


def arguments(p) -> None:
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--ks", default="0,1,4,16", help="0 = AR, else chain verification with the n-gram drafter")
    p.add_argument("--trees", default="", help="also static n-gram trees, BxD each (B branches of D drafts), e.g. "
                                               "2x4,4x4 (issue #21: tree steps predicted within 25%%)")
    p.add_argument("--head-ks", default="", help="chains of the target's packaged EAGLE-3 head, e.g. 2,4")
    p.add_argument("--head-trees", default="", help="dynamic trees of that head, DxKxN each, e.g. 3x2x8,4x4x16")
    p.add_argument("--recalibrate", action="store_true", help="measure the device's ceilings again")


def run(out_dir, args):
    ctx = args.ctx
    sizes, ks = ("1", "0,4") if args.smoke else (args.batch_sizes, args.ks)
    out = ctx.scratch / "costmodel_validate.json"
    step = ctx.module("costmodel_validate", "specpilot.tools.profile.costmodel_validate", [
        "--target", ctx.target, "--batch-sizes", sizes, "--ks", ks, "--trees", "" if args.smoke else args.trees,
        "--head-ks", "" if args.smoke else args.head_ks, "--head-trees", "" if args.smoke else args.head_trees,
        "--out", out,
        *(["--recalibrate"] if args.recalibrate else [])], timeout=300)
    result = json.loads(ctx.need(out, step).read_text())
    table = "\n".join(line for line in step.tail if line.startswith(("|", "<!--")) or " predictions within " in line)
    return result, table
