"""The 12-bit GEMV's A/B timing for the H200 scripts (l12_*.py): each variant (a change to the default launch
configuration, per shape or for all) timed at M = 1 on the given shapes, the variants alternated `reps` times in
one process with torch bf16 timed each time; prints a line a (repetition, variant, shape) and writes the rows to
$OUT/NAME.json."""
import json
import os

from specpilot.kernels import lossless12_linear as L


def alternate(name: str, variants: dict, shapes, reps: int = 3, before=None) -> list[dict]:
    """`variants`: label -> function (n, k, default config) -> config. `before(label)`, if given, runs before each
    variant's timing (for a module switch)."""
    default, rows = L.gemv_config, []
    for rep in range(reps):
        for label, config in variants.items():
            if before:
                before(label)
            L.gemv_config = lambda n, k, config=config: config(n, k, default(n, k))
            r = L.benchmark(shapes=shapes, ms=(1,), sweep=False, budget_s=30)
            for row in r["rows"]:
                print(f"rep {rep} {label}: {row['n']}x{row['k']} torch {row['torch_us']:.2f} us, ours "
                      f"{row['default_us']:.2f} us ({row['speedup_default']:.3f}x) {row['default_config']}", flush=True)
                rows.append(dict(rep=rep, variant=label, **{k: v for k, v in row.items() if k != "failed"}))
    L.gemv_config = default
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"{name}.json"), "w"), indent=1, default=str)
    return rows
