"""Issue #5, eighth lease: the 12-bit kernels with their window's scales read from a tensor (`Packed12Linear.scales`,
what lets torch.compile treat every matrix alike; the GEMM keeps the scale on the weights) against HEAD 934b124
(kernels/_l12_head.py: `git show 934b124:kernels/lossless12_linear.py`, written before the call, not committed):
alternated three times in one process on the Llama-3-8B shapes at M = 1, 4, 16, torch bf16 timed each time.
Writes $OUT/l12_scales.json.
(Reverted after this call, docs/BENCHMARKS.md eighth lease K: a little slower at M = 1 and on the split GEMM, and the
compiled layers it was for still recompiled past torch's limit.)
"""
from l12_ab import alternate_modules
from specpilot.kernels import _l12_head as H
from specpilot.kernels import lossless12_linear as L

alternate_modules("l12_scales", {"head": H, "new": L}, ms=(1, 4, 16), budget_s=60)
