"""Issue #5, eighth lease, third call: the 12-bit GEMV with the weights' scale moved onto x, K and K8 compile-time
constants (the working kernel), against the same kernel with K and K8 runtime arguments (kernels/_l12_krt.py) and
the committed one (HEAD, kernels/_l12_head.py): alternated three times in one process on the Llama-3-8B shapes,
torch bf16 timed each time. Then the sweep of launch configurations of the working kernel on the three shapes
under the LM head (the best tile may have moved now that the loop is cheaper). Writes $OUT/l12_scale.json and
$OUT/l12_sweep.json.
(kernels/_l12_head.py was `git show c7be34b:kernels/lossless12_linear.py`; kernels/_l12_krt.py the working kernel
with `K: tl.constexpr, K8: tl.constexpr` turned back into runtime arguments by sed. Both written before the call,
not committed.)
"""
import os

from l12_ab import alternate_modules
from specpilot.kernels import _l12_head as H
from specpilot.kernels import _l12_krt as R
from specpilot.kernels import lossless12_linear as L

SHAPES = ((14336, 4096), (4096, 14336), (4096, 4096), (128256, 4096))
alternate_modules("l12_scale", {"head": H, "scale x, K runtime": R, "scale x, K const": L}, shapes=SHAPES)
sweep = L.benchmark(shapes=SHAPES[:3], ms=(1,), sweep=True, budget_s=150,
                    out=os.path.join(os.environ.get("OUT", "."), "l12_sweep.json"))
for row in sweep["rows"]:
    best = sorted(row["sweep_us"].items(), key=lambda kv: kv[1])[:6]
    print(f"{row['n']}x{row['k']}: torch {row['torch_us']:.2f}, default {row['default_us']:.2f}, best "
          f"{row['best_us']:.2f} us; fastest: " + "; ".join(f"{k} {v}" for k, v in best), flush=True)
