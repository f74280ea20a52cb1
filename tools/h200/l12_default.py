"""(The new default was not kept: no faster over the three repetitions; docs/BENCHMARKS.md, sixth lease, H.)
Issue #5, sixth lease: the 12-bit GEMV's default launch for the two Llama-3-8B MLP shapes at M = 1, the fourth
lease's default (4 warps, 64 groups a step, no prefetch; 4 splits for 4096 x 14336) against the new one for long rows
(8 warps, 128 groups, prefetch, half the splits), alternated three times in one process (torch bf16 timed each time)."""
from l12_ab import alternate


def old(n, k, cfg):
    cfg = dict(cfg)
    if cfg["num_warps"] == 8 and cfg["PREFETCH"]:
        cfg.update(num_warps=4, BLOCK_K8=64, SPLIT_K=cfg["SPLIT_K"] * 2, PREFETCH=0)
    return cfg


alternate("l12_default", {"old": old, "new": lambda n, k, cfg: cfg}, ((14336, 4096), (4096, 14336)))
