"""Issue #5, eighth lease: the final 12-bit GEMV's main loop as committed (the first tile's words loaded in the
loop's first iteration) against the same kernel with that first load peeled before the loop (kernels/_l12_peel.py),
and HEAD (kernels/_l12_head.py): alternated four times in one process on the Llama-3-8B shapes at M = 1, torch bf16
timed each time. Writes $OUT/l12_loop.json.
(kernels/_l12_head.py was `git show c7be34b:kernels/lossless12_linear.py` and kernels/_l12_peel.py the working
kernel with the first tile's load peeled before the loop, both written before the call and not committed; the
peeled kernel is what was committed after it.)
"""
import json
import os

from specpilot.kernels import _l12_head as H
from specpilot.kernels import _l12_peel as P
from specpilot.kernels import lossless12_linear as L

rows = []
for rep in range(4):
    for label, mod in (("head", H), ("final", L), ("final, first tile peeled", P)):
        for row in mod.benchmark(ms=(1,), sweep=False, budget_s=30)["rows"]:
            print(f"rep {rep} {label}: {row['n']}x{row['k']} torch {row['torch_us']:.2f} us, ours "
                  f"{row['default_us']:.2f} us ({row['speedup_default']:.3f}x)", flush=True)
            rows.append(dict(rep=rep, variant=label, **{k: v for k, v in row.items() if k != "failed"}))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "l12_loop.json"), "w"), indent=1, default=str)
