"""(The new default was not kept: no faster over the three repetitions; docs/BENCHMARKS.md, sixth lease, H.)
Issue #5, sixth lease: the 12-bit GEMV's default launch for the two Llama-3-8B MLP shapes at M = 1, the fourth
lease's default (4 warps, 64 groups a step, no prefetch; 4 splits for 4096 x 14336) against the new one for long rows
(8 warps, 128 groups, prefetch, half the splits), alternated three times in one process (torch bf16 timed each time)."""
import json
import os

from specpilot.kernels import lossless12_linear as L

new = L.gemv_config


def old(n, k):
    cfg = dict(new(n, k))
    if cfg["num_warps"] == 8 and cfg["PREFETCH"]:
        cfg.update(num_warps=4, BLOCK_K8=64, SPLIT_K=cfg["SPLIT_K"] * 2, PREFETCH=0)
    return cfg


rows = []
for rep in range(3):
    for name, fn in (("old", old), ("new", new)):
        L.gemv_config = fn
        r = L.benchmark(shapes=((14336, 4096), (4096, 14336)), ms=(1,), sweep=False, budget_s=30)
        for row in r["rows"]:
            print(f"rep {rep} {name}: {row['n']}x{row['k']} torch {row['torch_us']:.2f} us, ours {row['default_us']:.2f}"
                  f" us ({row['speedup_default']:.3f}x) {row['default_config']}", flush=True)
            rows.append(dict(rep=rep, default=name, **{k: v for k, v in row.items() if k != "failed"}))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "l12_default.json"), "w"), indent=1, default=str)
