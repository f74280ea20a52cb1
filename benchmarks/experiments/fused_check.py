"""The fused layer against the modular one on the GPU, as the engine runs it (PDL on): outputs and cache writes.

What it checks (kernels/triton_fused_layer.py `check`): every layer of each target in `--targets`, at steps of 1x1,
1x5, 3x2 and 2x6 tokens (rows x tokens a row) at random positions over a randomly filled 512-slot cache, bf16: the
fused layer's outputs, cache writes and final norm against the modular layer run in fp32 on the same inputs, within
twice the bf16 modular layer's own error (plus 1e-3). CI runs the same check under Triton's interpreter, where
kernels run one after another; on the GPU, with programmatic dependent launch, a kernel starts before its
predecessor ends, so only here would a kernel that reads what its predecessor has not yet written (a K/V slot of this
step loaded before the wait, say) be caught: its error would be that of random data.

Backs docs/BENCHMARKS.md's fused-layer rows at 8B shapes (issue #24): the twenty-second lease, D (then
.scratch/gpu_check.py), docs/benchmarks/2026-12-03-twenty-second-lease.md.

Device minutes: about 1 a target (synthetic targets are drawn on the device).
"""
from __future__ import annotations

import time

import harness

MINUTES = 2
CUDA_ONLY = True
STEPS = ((1, 1), (1, 5), (3, 2), (2, 6))


def arguments(p) -> None:
    p.add_argument("--targets", default="synthetic:llama-3.2-1b,synthetic:qwen3-8b",
                   help="comma-separated targets (a model file or directory, or synthetic:NAME); default: the run's "
                        "--target, else these two")


def run(out_dir, args):
    import torch

    from specpilot.engine import loader
    from specpilot.engine.model import Block
    from specpilot.kernels import triton_fused_layer

    targets = [args.target] if args.target else [t for t in args.targets.split(",") if t]
    rows = []
    for target in targets:
        t0 = time.perf_counter()
        try:  # a target that fails costs its own row
            model = loader.load(target, "bf16", "cuda").model
            error = triton_fused_layer.check(model, Block.forward, batch_tokens=STEPS)
            rows.append({"target": target, "verdict": "PASS", "worst_error": error})
            del model
        except AssertionError as e:
            rows.append({"target": target, "verdict": "FAIL", "why": str(e)})
        except Exception as e:
            rows.append({"target": target, "verdict": "ERROR", "why": f"{type(e).__name__}: {str(e).strip()[:300]}"})
        rows[-1]["seconds"] = time.perf_counter() - t0
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    table = harness.md_table(["target", "verdict", "worst error / why", "s"],
                             [[r["target"], r["verdict"], f"{r['worst_error']:.2e}" if "worst_error" in r else r["why"],
                               f"{r['seconds']:.0f}"] for r in rows])
    return {"steps": STEPS, "rows": rows}, table
