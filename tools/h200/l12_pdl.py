"""Issue #5, eighth lease: the 12-bit GEMV at M = 1 with programmatic dependent launch (PDL: the first weight tile
and the CSR offsets load before the wait for the previous kernel, so a call's launch and first loads overlap the
previous call's tail) and with the weights' power-of-two scale moved onto x (SCALE_X: one FMUL per x value a
thread loads instead of one per weight, ~7% fewer instructions in the loop). Each combination alternated three
times in one process with torch bf16 timed each time, on the Llama-3-8B shapes and 14336 x 2048 / 8192 (same grid,
half / twice the loop: the fixed cost per call is the intercept). Writes $OUT/l12_pdl.json.
(After this call, docs/BENCHMARKS.md eighth lease B-C: PDL was left out of the GEMV and the scale on x kept for
good, so the PDL and SCALE_X switches this script sets no longer exist.)
"""
from l12_ab import alternate

VARIANTS = {"plain": dict(PDL=False, SCALE_X=0), "pdl": dict(PDL=True, SCALE_X=0),
            "scale x": dict(PDL=False, SCALE_X=1), "pdl + scale x": dict(PDL=True, SCALE_X=1)}
alternate("l12_pdl", {label: lambda n, k, cfg, change=change: {**cfg, **change} for label, change in VARIANTS.items()},
          ((14336, 4096), (4096, 14336), (4096, 4096), (128256, 4096), (14336, 2048), (14336, 8192)))
