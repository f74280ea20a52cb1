"""`specpilot grid`: the yardstick the optimizing agents must reach. A declared space of recipes (space.py: the
space file's format, its validation and its expansion) is expanded, each recipe is put through the token-forcing
gate, and every recipe that passes is measured side by side with ar, stock and our fastest AR (`ar-fused-overlap`)
in one bench run (run.py: gate, bench, results, report, plot). Shipped spaces live in data/ (docs/GRID.md).
Uses tools/gate and tools/bench (and tools/argtypes); the sandbox module is handed in by the caller, as to the bench.
"""
