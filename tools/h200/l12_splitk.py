"""(After this call the last split's merge became the only GEMV path and the LAST_SPLIT_ADDS switch it sets was
removed: docs/BENCHMARKS.md, seventh lease, J.)
Issue #5, seventh lease: the 12-bit GEMV at M = 1 with split K, the partials added by the last split to finish
(an atomic counter a row block, LAST_SPLIT_ADDS) against a second kernel (_splitk_reduce, as before), on the
Llama-3-8B shapes that split (4096 x 4096: 2, 4096 x 14336: 4 at the default) and 14336 x 4096 unsplit (the
default) and split in 2. Alternated three times in one process, torch bf16 timed each time. Writes
$OUT/l12_splitk.json."""
import json
import os

from specpilot.kernels import lossless12_linear as L

default = L.gemv_config
VARIANTS = {"reduce-kernel": (False, {}), "last-split": (True, {}), "last-split, 14336x4096 split 2": (True, {
    (14336, 4096): dict(SPLIT_K=2)})}

rows = []
for rep in range(3):
    for name, (last, change) in VARIANTS.items():
        L.LAST_SPLIT_ADDS = last
        L.gemv_config = lambda n, k, change=change: {**default(n, k), **change.get((n, k), {})}
        r = L.benchmark(shapes=((4096, 4096), (14336, 4096), (4096, 14336)), ms=(1,), sweep=False, budget_s=30)
        for row in r["rows"]:
            print(f"rep {rep} {name}: {row['n']}x{row['k']} torch {row['torch_us']:.2f} us, ours {row['default_us']:.2f}"
                  f" us ({row['speedup_default']:.3f}x) split {row['default_config'].get('SPLIT_K')}", flush=True)
            rows.append(dict(rep=rep, variant=name, **{k: v for k, v in row.items() if k != "failed"}))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "l12_splitk.json"), "w"), indent=1, default=str)
