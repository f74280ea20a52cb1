"""(After this call the last split's merge became the only GEMV path and the LAST_SPLIT_ADDS switch it sets was
removed: docs/BENCHMARKS.md, seventh lease, J.)
Issue #5, seventh lease: the 12-bit GEMV at M = 1 with split K, the partials added by the last split to finish
(an atomic counter a row block, LAST_SPLIT_ADDS) against a second kernel (_splitk_reduce, as before), on the
Llama-3-8B shapes that split (4096 x 4096: 2, 4096 x 14336: 4 at the default) and 14336 x 4096 unsplit (the
default) and split in 2. Alternated three times in one process, torch bf16 timed each time. Writes
$OUT/l12_splitk.json."""
from l12_ab import alternate

from specpilot.kernels import lossless12_linear as L

VARIANTS = {"reduce-kernel": (False, {}), "last-split": (True, {}),
            "last-split, 14336x4096 split 2": (True, {(14336, 4096): dict(SPLIT_K=2)})}
alternate("l12_splitk", {label: lambda n, k, cfg, change=change: {**cfg, **change.get((n, k), {})}
                         for label, (_, change) in VARIANTS.items()},
          ((4096, 4096), (14336, 4096), (4096, 14336)),
          before=lambda label: setattr(L, "LAST_SPLIT_ADDS", VARIANTS[label][0]))
