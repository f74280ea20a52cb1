"""(Reverted after this call, docs/BENCHMARKS.md, seventh lease, K: 2-3% faster on 14336 x 4096 only, a fifth slower
with split K (4096 x 14336); the EARLY_ESCAPES switch it sets no longer exists.)
Issue #5, seventh lease: the 12-bit GEMV at M = 1 with its first chunk of escapes (CSR row, column, value) loaded
in the main loop's first iteration, behind the first tile's words (EARLY_ESCAPES), instead of after the loop, where
its DRAM round trip adds to the kernel's tail. Compiled offline for sm_90 that takes 96 registers instead of 72 (5
programs a multiprocessor instead of 7: a second wave for 14336 x 4096's 896 programs), so also with ptxas capped at
72 (no spill unsplit, one split). Llama-3-8B shapes, alternated three times in one process, torch bf16 timed each
time. Writes $OUT/l12_escapes.json."""
from l12_ab import alternate

VARIANTS = {"after the loop": dict(EARLY_ESCAPES=False), "early, 72 registers": dict(EARLY_ESCAPES=True, maxnreg=72),
            "early": dict(EARLY_ESCAPES=True)}
alternate("l12_escapes", {label: lambda n, k, cfg, change=change: {**cfg, **change}
                          for label, change in VARIANTS.items()},
          ((14336, 4096), (4096, 14336), (4096, 4096), (128256, 4096)))
