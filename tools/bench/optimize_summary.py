"""What an optimize run found and what it cost, per workload: the found recipe's speedup over `ar` and over `stock`.

    python -m specpilot.tools.bench.optimize_summary RUN_DIR|RECIPE BENCH_DIR [--json FILE]

RUN_DIR is a `specpilot optimize` output directory (its recipe.json: the speedups measured during the run on the
run's workload, and `device_minutes`, the minutes its measurements held the device); BENCH_DIR a `specpilot bench
--recipe RUN_DIR/recipe.json --workload code,chat,...` of that recipe, which measures it beside `ar` and `stock`
side by side in each (workload, batch size) cell. Prints one markdown table: tok/s of the three systems, the recipe's
ratios, its tau and its share of requests token-identical to ar, per cell. Speedups are ratios of tok/s measured in
the same cell, never across runs. `benchmarks/run.py optimize` writes it after the H200 run (issue #6).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...engine.recipe import reported_name


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def summarize(run_dir: str | Path, bench_dir: str | Path) -> dict:
    """RUN_DIR, or a recipe file of the run (recipes/best-rN.json, when the run was stopped before it finished)."""
    path = Path(run_dir)
    recipe = json.loads((path if path.is_file() else path / "recipe.json").read_text())
    results = json.loads((Path(bench_dir) / "results.json").read_text())
    m = recipe.get("measured") or {}
    name = recipe.get("name")
    system = reported_name(name or "", (recipe.get("drafter") or {}).get("kind", "none"))  # (the bench's row)
    cells: dict[tuple, dict] = {}
    for r in results.get("runs", []):
        cells.setdefault((r["workload"], r["batch_size"]), {})[r["system"]] = r
    rows = []
    for (workload, batch), systems in cells.items():
        ar, stock, found = systems.get("ar") or {}, systems.get("stock") or {}, systems.get(system) or {}
        rows.append({"workload": workload, "batch_size": batch,
                     "ar_tokens_per_s": ar.get("tokens_per_s"), "stock_tokens_per_s": stock.get("tokens_per_s"),
                     "recipe_tokens_per_s": found.get("tokens_per_s"),
                     "speedup_vs_ar": _ratio(found.get("tokens_per_s"), ar.get("tokens_per_s")),
                     "speedup_vs_stock": _ratio(found.get("tokens_per_s"), stock.get("tokens_per_s")),
                     "stock_vs_ar": _ratio(stock.get("tokens_per_s"), ar.get("tokens_per_s")),
                     "tau": found.get("mean_accepted"), "identical_to_ar": found.get("identical_to_ar")})
    dep = m.get("deployment") or {}
    return {"recipe": name, "source": m.get("source"), "run": {
                "workload": dep.get("workload"), "speedup_vs_ar": m.get("speedup_vs_ar"),
                "speedup_vs_stock": m.get("speedup_vs_stock"), "tokens_per_s": m.get("tokens_per_s"),
                "device_minutes": m.get("device_minutes"), "wall_minutes": m.get("wall_minutes"),
                "rounds": m.get("rounds"), "stop_reason": m.get("stop_reason"), "gate_passed": (m.get("gate") or {})
                .get("passed")},
            "bench": {"command": (results.get("header") or {}).get("command"),
                      "device_name": (results.get("header") or {}).get("device_name"),
                      "errors": results.get("errors", [])},
            "workloads": rows}


def _f(x, spec: str) -> str:
    if spec == "tps" and x is not None:
        spec = ",.0f" if x >= 100 else ".1f"  # a CPU dry run's few tok/s keep a decimal
    return "-" if x is None else format(x, spec)


def markdown(s: dict) -> str:
    r = s["run"]
    lines = [f"Found recipe `{s['recipe']}` (best: {s['source']}; gate passed: {r['gate_passed']}). During the run, on "
             f"{r['workload']}: {_f(r['speedup_vs_ar'], '.2f')}x ar, {_f(r['speedup_vs_stock'], '.2f')}x stock, "
             f"{_f(r['tokens_per_s'], 'tps')} tok/s; {r['rounds']} round(s), stopped: {r['stop_reason']}. Device "
             f"minutes of the run's measurements: {_f(r['device_minutes'], '.2f')} (wall minutes of work "
             f"{_f(r['wall_minutes'], '.2f')}).", "",
             f"Side by side on {s['bench']['device_name']}: `{s['bench']['command']}`", "",
             "| workload | B | ar tok/s | stock tok/s | recipe tok/s | recipe / ar | recipe / stock | stock / ar | τ | =AR |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in s["workloads"]:
        lines.append(f"| {w['workload']} | {w['batch_size']} | {_f(w['ar_tokens_per_s'], 'tps')} | "
                     f"{_f(w['stock_tokens_per_s'], 'tps')} | {_f(w['recipe_tokens_per_s'], 'tps')} | "
                     f"{_f(w['speedup_vs_ar'], '.2f')}x | {_f(w['speedup_vs_stock'], '.2f')}x | "
                     f"{_f(w['stock_vs_ar'], '.2f')}x | {_f(w['tau'], '.2f')} | "
                     f"{_f(w['identical_to_ar'], '.0%')} |")
    for e in s["bench"]["errors"]:
        lines.append(f"\nbench error: {e}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specpilot.tools.bench.optimize_summary", description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("bench_dir")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    args = p.parse_args(argv)
    s = summarize(args.run_dir, args.bench_dir)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1) + "\n")
    sys.stdout.write(markdown(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
