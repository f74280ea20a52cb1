"""Issue #5, eighth lease, second call: the committed 12-bit GEMV (HEAD's module, kernels/_l12_head.py) against
the working one with the scale on x and K a compile-time constant (x slices and word rows at immediate offsets),
without PDL and with PDL whose next-kernel trigger is at the program's start or after its main loop. Alternated
three times in one process, torch bf16 timed each time. Writes $OUT/l12_pdl2.json.
(kernels/_l12_head.py was `git show c7be34b:kernels/lossless12_linear.py`, written before the call and not
committed. The PDL switch was removed after this call, docs/BENCHMARKS.md eighth lease C.)
"""
from l12_ab import alternate_modules
from specpilot.kernels import _l12_head as H
from specpilot.kernels import lossless12_linear as L

alternate_modules("l12_pdl2", {"head": H, "scale x, K const": (L, dict(PDL=0, SCALE_X=1)),
                               "+ pdl at start": (L, dict(PDL=1, SCALE_X=1)),
                               "+ pdl after loop": (L, dict(PDL=2, SCALE_X=1))},
                  shapes=((14336, 4096), (4096, 14336), (4096, 4096), (128256, 4096), (14336, 2048)))
