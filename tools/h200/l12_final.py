"""Issue #5, eighth lease: the committed 12-bit GEMV (HEAD, kernels/_l12_head.py) against the final one (weights'
scale on x, K and K8 compile-time constants, 8-warp unsplit programs for a short K), alternated five times in one
process on the Llama-3-8B shapes at M = 1, torch bf16 timed each time; then the final kernel's default launch at
M = 1, 4, 16, 64 (the table of docs/BENCHMARKS.md). Writes $OUT/l12_final_ab.json and $OUT/l12_final_table.json.
(kernels/_l12_head.py was `git show c7be34b:kernels/lossless12_linear.py`, written before the call and not
committed. The "final" kernel here loads its first tile in the loop's first iteration; the committed one peels
that load before the loop, after l12_loop.py.)
"""
import json
import os

from specpilot.kernels import _l12_head as H
from specpilot.kernels import lossless12_linear as L

OUT = os.environ.get("OUT", ".")
rows = []
for rep in range(5):
    for label, mod in (("head", H), ("final", L)):
        for row in mod.benchmark(ms=(1,), sweep=False, budget_s=30)["rows"]:
            print(f"rep {rep} {label}: {row['n']}x{row['k']} torch {row['torch_us']:.2f} us, ours "
                  f"{row['default_us']:.2f} us ({row['speedup_default']:.3f}x, {row['default_tbps']:.2f} TB/s)",
                  flush=True)
            rows.append(dict(rep=rep, variant=label, **{k: v for k, v in row.items() if k != "failed"}))
json.dump(rows, open(os.path.join(OUT, "l12_final_ab.json"), "w"), indent=1, default=str)
table = L.benchmark(ms=(1, 4, 16, 64), sweep=False, budget_s=60, out=os.path.join(OUT, "l12_final_table.json"))
for row in table["rows"]:
    print(f"table {row['n']}x{row['k']} M={row['m']}: torch {row['torch_us']:.2f} us, ours {row['default_us']:.2f} us "
          f"({row['speedup_default']:.3f}x), {row['default_tbps']:.2f} TB/s, err {row['max_rel_err']:.1e}", flush=True)
