"""Issue #5, seventh lease: the 12-bit GEMV's weight loads at M = 1 for the two Llama-3-8B MLP shapes, the default
(POLICY "evict_first": PTX ld.global.L1::evict_first with an L2 evict-first hint) against loads that skip L1
(CACHE ".cg", which PTX does not combine with an L1 eviction hint) and plain loads; the default tile otherwise.
Alternated three times in one process, torch bf16 timed each time. Writes $OUT/l12_cache.json."""
from l12_ab import alternate

VARIANTS = {"evict_first": {}, "cg": dict(POLICY="", CACHE=".cg"), "plain": dict(POLICY="")}
alternate("l12_cache", {label: lambda n, k, cfg, change=change: {**cfg, **change} for label, change in VARIANTS.items()},
          ((14336, 4096), (4096, 14336)))
