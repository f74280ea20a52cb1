"""Issue #5, eighth lease: the committed 12-bit GEMV (HEAD, kernels/_l12_head.py) against the final one (weights'
scale on x, K and K8 compile-time constants, 8-warp unsplit programs for a short K), alternated five times in one
process on the Llama-3-8B shapes at M = 1, torch bf16 timed each time; then the final kernel's default launch at
M = 1, 4, 16, 64 (the table of docs/BENCHMARKS.md). Writes $OUT/l12_final_ab.json and $OUT/l12_final_table.json.
(kernels/_l12_head.py was `git show c7be34b:kernels/lossless12_linear.py`, written before the call and not
committed. The "final" kernel here loads its first tile in the loop's first iteration; the committed one peels
that load before the loop, after l12_loop.py.)
"""
import os

from l12_ab import alternate_modules
from specpilot.kernels import _l12_head as H
from specpilot.kernels import lossless12_linear as L

alternate_modules("l12_final_ab", {"head": H, "final": L}, reps=5)
table = L.benchmark(ms=(1, 4, 16, 64), sweep=False, budget_s=60,
                    out=os.path.join(os.environ.get("OUT", "."), "l12_final_table.json"))
for row in table["rows"]:
    print(f"table {row['n']}x{row['k']} M={row['m']}: torch {row['torch_us']:.2f} us, ours {row['default_us']:.2f} us "
          f"({row['speedup_default']:.3f}x), {row['default_tbps']:.2f} TB/s, err {row['max_rel_err']:.1e}", flush=True)
