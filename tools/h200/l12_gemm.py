"""Issue #5, eighth lease: the 12-bit kernels with the sum scale read from a tensor (what lets torch.compile treat
every matrix alike) and the tensor-core GEMM (1 < M) moved to the scale on x with K constant, as the GEMV was,
against HEAD 934b124 (kernels/_l12_head.py: `git show 934b124:kernels/lossless12_linear.py`, written before the
call, not committed): alternated three times in one process on the Llama-3-8B shapes at M = 1, 4, 16, torch bf16
timed each time. Writes $OUT/l12_gemm.json.
(After this call the GEMM went back to the scale on the weights, read from a tensor: l12_scales.py; both were
reverted after that call.)"""
from l12_ab import alternate_modules
from specpilot.kernels import _l12_head as H
from specpilot.kernels import lossless12_linear as L

alternate_modules("l12_gemm", {"head": H, "new": L}, ms=(1, 4, 16), budget_s=60)
