"""The 12-bit GEMV's A/B timing for the H200 scripts (l12_*.py): variants alternated `reps` times in one process,
torch bf16 timed beside each, a line printed a (repetition, variant, shape, M) and the rows written to
$OUT/NAME.json. A variant is a kernel module (the committed one beside a copy of an older or a working version),
optionally with a change to its GEMV launch configuration."""
import json
import os

from specpilot.kernels import lossless12_linear as L


def alternate_modules(name: str, variants: dict, reps: int = 3, shapes=None, ms=(1,), budget_s: float = 30.0,
                      before=None) -> list[dict]:
    """`variants`: label -> module, or (module, change), the change a dict merged into the module's default GEMV
    configuration or a function (n, k, default config) -> config. `shapes` None: the benchmark's Llama-3-8B four.
    `before(label)`, if given, runs before each variant's timing (for a module switch)."""
    rows = []
    for rep in range(reps):
        for label, variant in variants.items():
            mod, change = variant if isinstance(variant, tuple) else (variant, None)
            if before:
                before(label)
            default = mod.gemv_config
            if change:
                config = change if callable(change) else (lambda n, k, cfg, change=change: {**cfg, **change})
                mod.gemv_config = lambda n, k, config=config, default=default: config(n, k, default(n, k))
            try:
                result = mod.benchmark(**({"shapes": shapes} if shapes else {}), ms=ms, sweep=False,
                                       budget_s=budget_s)
            finally:
                mod.gemv_config = default
            for row in result["rows"]:
                print(f"rep {rep} {label}: {row['n']}x{row['k']} M={row['m']} torch {row['torch_us']:.2f} us, ours "
                      f"{row['default_us']:.2f} us ({row['speedup_default']:.3f}x, {row['default_tbps']:.2f} TB/s)",
                      flush=True)
                rows.append(dict(rep=rep, variant=label, **{k: v for k, v in row.items() if k != "failed"}))
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"{name}.json"), "w"), indent=1, default=str)
    return rows


def alternate(name: str, variants: dict, shapes, reps: int = 3, before=None) -> list[dict]:
    """Variants of the committed kernel's launch configuration: label -> function (n, k, default config) ->
    config."""
    return alternate_modules(name, {label: (L, change) for label, change in variants.items()}, reps, shapes,
                             before=before)
