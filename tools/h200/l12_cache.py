"""Issue #5, seventh lease: the 12-bit GEMV's weight loads at M = 1 for the two Llama-3-8B MLP shapes, the default
(POLICY "evict_first": PTX ld.global.L1::evict_first with an L2 evict-first hint) against loads that skip L1
(CACHE ".cg", which PTX does not combine with an L1 eviction hint) and plain loads; the default tile otherwise.
Alternated three times in one process, torch bf16 timed each time. Writes $OUT/l12_cache.json."""
import json
import os

from specpilot.kernels import lossless12_linear as L

default = L.gemv_config
VARIANTS = {"evict_first": {}, "cg": dict(POLICY="", CACHE=".cg"), "plain": dict(POLICY="")}

rows = []
for rep in range(3):
    for name, change in VARIANTS.items():
        L.gemv_config = lambda n, k, change=change: {**default(n, k), **change}
        r = L.benchmark(shapes=((14336, 4096), (4096, 14336)), ms=(1,), sweep=False, budget_s=30)
        for row in r["rows"]:
            print(f"rep {rep} {name}: {row['n']}x{row['k']} torch {row['torch_us']:.2f} us, ours {row['default_us']:.2f}"
                  f" us ({row['speedup_default']:.3f}x)", flush=True)
            rows.append(dict(rep=rep, variant=name, **{k: v for k, v in row.items() if k != "failed"}))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "l12_cache.json"), "w"), indent=1, default=str)
