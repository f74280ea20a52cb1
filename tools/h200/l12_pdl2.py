"""Issue #5, eighth lease, second call: the committed 12-bit GEMV (HEAD's module, kernels/_l12_head.py) against
the working one with the scale on x and K a compile-time constant (x slices and word rows at immediate offsets),
without PDL and with PDL whose next-kernel trigger is at the program's start or after its main loop. Alternated
three times in one process, torch bf16 timed each time. Writes $OUT/l12_pdl2.json.
(kernels/_l12_head.py was `git show c7be34b:kernels/lossless12_linear.py`, written before the call and not
committed. The PDL switch was removed after this call, docs/BENCHMARKS.md eighth lease C.)
"""
import json
import os

from specpilot.kernels import _l12_head as H
from specpilot.kernels import lossless12_linear as L

VARIANTS = {"head": (H, {}), "scale x, K const": (L, dict(PDL=0, SCALE_X=1)),
            "+ pdl at start": (L, dict(PDL=1, SCALE_X=1)), "+ pdl after loop": (L, dict(PDL=2, SCALE_X=1))}
SHAPES = ((14336, 4096), (4096, 14336), (4096, 4096), (128256, 4096), (14336, 2048))
rows = []
for rep in range(3):
    for label, (mod, change) in VARIANTS.items():
        default = mod.gemv_config
        mod.gemv_config = lambda n, k, default=default, change=change: {**default(n, k), **change}
        r = mod.benchmark(shapes=SHAPES, ms=(1,), sweep=False, budget_s=30)
        mod.gemv_config = default
        for row in r["rows"]:
            print(f"rep {rep} {label}: {row['n']}x{row['k']} torch {row['torch_us']:.2f} us, ours "
                  f"{row['default_us']:.2f} us ({row['speedup_default']:.3f}x)", flush=True)
            rows.append(dict(rep=rep, variant=label, **{k: v for k, v in row.items() if k != "failed"}))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "l12_pdl2.json"), "w"), indent=1, default=str)
