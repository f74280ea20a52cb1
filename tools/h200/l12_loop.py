"""Issue #5, eighth lease: the final 12-bit GEMV's main loop as committed (the first tile's words loaded in the
loop's first iteration) against the same kernel with that first load peeled before the loop (kernels/_l12_peel.py),
and HEAD (kernels/_l12_head.py): alternated four times in one process on the Llama-3-8B shapes at M = 1, torch bf16
timed each time. Writes $OUT/l12_loop.json.
(kernels/_l12_head.py was `git show c7be34b:kernels/lossless12_linear.py` and kernels/_l12_peel.py the working
kernel with the first tile's load peeled before the loop, both written before the call and not committed; the
peeled kernel is what was committed after it.)
"""
from l12_ab import alternate_modules
from specpilot.kernels import _l12_head as H
from specpilot.kernels import _l12_peel as P
from specpilot.kernels import lossless12_linear as L

alternate_modules("l12_loop", {"head": H, "final": L, "final, first tile peeled": P}, reps=4)
