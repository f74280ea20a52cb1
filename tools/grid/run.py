"""`specpilot grid`: expand a space of recipes, gate each, measure every passing one side by side, rank them.

    specpilot grid --target T --workload W --space SPACE.json --out DIR [--batch-sizes 1] [--limit N]
                   [--max-new-tokens N] [--repeats R] [--max-recipes N] [--no-gate] [--gate-workers N]
                   [--device D] [--dtype D]

The grid is the yardstick an optimizing agent must reach: the best recipe a plain search over declared knobs finds.
Order of work, each step written down before the next starts so that a killed run keeps what it had:
1. the space is expanded (space.py) and refused at once when it is too large or malformed;
2. each recipe goes through the token-forcing gate (tools/gate/check.py) on every workload, on a few prompts under
   one salt (so the reference is computed once), `--gate-workers` recipes at a time; a recipe that fails or errors
   is excluded, the rest go on; run again into the same DIR (same space, gate settings and workloads), a grid
   keeps the verdicts the earlier run wrote down and gates only the rest (a run killed while gating or benching
   does not gate again);
3. one bench run (tools/bench/run.py, into DIR/bench/) measures every passing recipe with ar, stock and our fastest
   AR, `ar-fused-overlap` (the reference of every ratio), in one process in rotated order;
4. DIR/results.json (the bench's results plus a `grid` section), DIR/report.md, DIR/best.json (a recipe file) and
   DIR/grid_tok_s.png rank the recipes by tok/s against the reference.

    python -m specpilot.tools.grid.run DIR   # (re)write DIR's results.json, report.md, best.json and plot
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shlex
import sys
import time
from pathlib import Path

from ...engine.errors import SpecPilotError
from ..bench import run as bench_run
from ..gate import check as gate
from .space import Expansion, expand, load_space

SCHEMA = "specpilot-grid/1"
REFERENCE = "ar-fused-overlap"
REFERENCE_RECIPE = {"specpilot_recipe": 1, "name": REFERENCE, "layer": "fused", "overlap": True,
                    "description": "our fastest AR (docs/RECIPE.md): the grid's reference"}
PLOT = "grid_tok_s.png"
RETRIED = ("crashed", "timed_out")  # a candidate process's failures that a second run gates again


def write_json(path: Path, data: dict) -> None:
    """Atomic rewrite: an interrupted run leaves the last complete file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def default_device(device: str | None) -> str:
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def command_line(args) -> str:
    return "specpilot " + shlex.join(getattr(args, "argv", None) or ["grid"])


# -- the gate --------------------------------------------------------------------------------------------------

def gate_one(args, name: str, recipe_file: Path, workloads: list[str], device: str, dtype: str, salt: str,
             out: Path) -> dict:
    """The gate's verdict on one recipe over every workload: pass, fail (the first failing workload's reason) or
    error (the gate could not run it); a broken candidate never stops the grid."""
    t0 = time.perf_counter()
    for i, workload in enumerate(workloads):
        try:
            report = gate.check(args.target, str(recipe_file), workload, args.gate_limit, args.gate_tokens, device,
                                dtype, out / "gate" / name / f"w{i}", salt=salt, timeout_s=args.gate_timeout)
        except Exception as e:  # noqa: BLE001 - the gate's own error on one recipe is that recipe's verdict
            return {"verdict": "error", "reason": f"{workload}: {type(e).__name__}: {one_line(e)}",
                    "seconds": time.perf_counter() - t0}
        if not report.passed:  # kind: the gate's (divergence, ...) or the candidate process's (crashed, timed_out)
            return {"verdict": "fail", "reason": f"{workload}: {report.reason}", "seconds": time.perf_counter() - t0,
                    "kind": (report.failure or {}).get("kind")}
    return {"verdict": "pass", "reason": None, "seconds": time.perf_counter() - t0}


def earlier_verdicts(out: Path, grid: dict) -> dict[str, dict]:
    """The verdicts an earlier run of this same grid (space, gate settings but the salt and the workers, workloads)
    wrote into DIR/results.json, but for errors and for candidates that crashed or timed out (what a machine under
    load or a since-fixed fault can cause): those are gated again."""
    try:
        earlier = json.loads((out / "results.json").read_text())["grid"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}

    def same_gate(g: dict | None) -> dict | None:
        return g and {k: v for k, v in g.items() if k not in ("salt", "workers")}

    if (earlier.get("space") != grid["space"] or same_gate(earlier.get("gate_settings")) != same_gate(
            grid["gate_settings"]) or (earlier.get("bench_settings") or {}).get("workload")
            != grid["bench_settings"]["workload"]):
        return {}
    names = {r["name"] for r in grid["expansion"]["recipes"]}
    return {v["name"]: v for v in earlier.get("gate", []) if v["name"] in names and (
        v.get("verdict") == "pass" or v.get("verdict") == "fail" and v.get("kind") not in RETRIED)}


def gate_all(args, expansion: Expansion, files: dict, workloads: list[str], device: str, dtype: str, salt: str,
             out: Path, grid: dict, known: dict[str, dict] | None = None) -> list[str]:
    """Every recipe through the gate, `args.gate_workers` at a time (each gate's candidate is a process of its own:
    on a GPU several share it; the 60-recipe SmolLM2 grid gated one after another does not fit a device call). The
    first recipe gated goes alone: it computes each workload's reference, which the others then read from the cache.
    `known`: verdicts kept from an earlier run, not gated again. Verdicts are written down as they come, and kept in
    the space's order; the passing recipes' names are returned."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    recipes, verdicts = expansion.recipes, dict(known or {})
    if verdicts:
        print(f"specpilot: grid: {len(verdicts)} verdicts kept from the earlier run in {out}", file=sys.stderr)

    def one(r) -> dict:
        return {"name": r.name, **gate_one(args, r.name, files[r.name], workloads, device, dtype, salt, out)}

    def note(verdict: dict) -> None:
        verdicts[verdict["name"]] = verdict
        grid["gate"] = [verdicts[r.name] for r in recipes if r.name in verdicts]
        write_json(out / "results.json", {"grid": grid})
        print(f"specpilot: grid: gate {len(verdicts)}/{len(recipes)} {verdict['name']}: {verdict['verdict']}"
              + (f": {verdict['reason']}" if verdict["reason"] else ""), file=sys.stderr)

    todo = [r for r in recipes if r.name not in verdicts]
    if todo:
        note(one(todo[0]))
    with ThreadPoolExecutor(max(1, getattr(args, "gate_workers", 1))) as pool:
        for future in as_completed([pool.submit(one, r) for r in todo[1:]]):
            note(future.result())  # (gate_one turns every failure into a verdict)
    return [r.name for r in recipes if verdicts[r.name]["verdict"] == "pass"]


def one_line(text, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the measurement -------------------------------------------------------------------------------------------

def bench_argv(args, recipe_files: list[Path], device: str, dtype: str, out: Path) -> list[str]:
    """`specpilot bench`'s flags for the grid's one measurement."""
    argv = [f"--target={args.target}", f"--workload={args.workload}",
            f"--batch-sizes={','.join(str(b) for b in args.batch_sizes)}", f"--max-new-tokens={args.max_new_tokens}",
            f"--repeats={args.repeats}", f"--device={device}", f"--dtype={dtype}", f"--out={out}"]
    argv += [f"--limit={args.limit}"] if args.limit else []
    return argv + [f"--recipe={f}" for f in recipe_files]


def ranking(bench_results: dict | None, grid_names: set[str]) -> list[dict]:
    """Per cell (workload, batch size): every measured system by tok/s, fastest first, with its ratio to the
    reference's tok/s in the same cell (null when the reference was not measured there)."""
    cells: dict[tuple, list[dict]] = {}
    for run in (bench_results or {}).get("runs", []):
        cells.setdefault((run["workload"], run["batch_size"]), []).append(run)
    out = []
    for (workload, b), runs in cells.items():
        ref = next((r["tokens_per_s"] for r in runs if r["system"] == REFERENCE), None)
        rows = []
        for r in sorted(runs, key=lambda r: -(r["tokens_per_s"] or 0.0)):
            kind = "grid" if r["system"] in grid_names else "reference" if r["system"] == REFERENCE else "bench"
            rows.append({"system": r["system"], "kind": kind, "tokens_per_s": r["tokens_per_s"],
                         "ratio": r["tokens_per_s"] / ref if ref and r["tokens_per_s"] else None,
                         "mean_accepted": r["mean_accepted"], "speedup_vs_ar": r["speedup_vs_ar"],
                         "identical_to_ar": r["identical_to_ar"], "repeats": r.get("repeats")})
        out.append({"workload": workload, "batch_size": b, "reference_tokens_per_s": ref, "rows": rows})
    return out


def best_recipe(cells: list[dict]) -> tuple[str, float, str] | None:
    """(name, score, what the score is) of the grid recipe measured in every cell with the highest geometric mean
    ratio to the reference (of tok/s where the reference is missing from a cell)."""
    if not cells:
        return None
    use_ratio = all(c["reference_tokens_per_s"] for c in cells)
    key = "ratio" if use_ratio else "tokens_per_s"
    scores: dict[str, list[float]] = {}
    for c in cells:
        for row in c["rows"]:
            if row["kind"] == "grid" and row[key]:
                scores.setdefault(row["system"], []).append(row[key])
    complete = {n: math.exp(sum(map(math.log, v)) / len(v)) for n, v in scores.items() if len(v) == len(cells)}
    if not complete:
        return None
    name = max(complete, key=complete.get)
    return name, complete[name], f"geometric mean of tok/s / {REFERENCE}" if use_ratio else "geometric mean tok/s"


# -- results, report, plot -------------------------------------------------------------------------------------

def finish(out: Path) -> dict:
    """DIR/results.json (the bench's results, if any, plus the grid section), report.md, best.json and the plot,
    from DIR/results.json's grid section and DIR/bench/results.json."""
    grid = json.loads((out / "results.json").read_text())["grid"]
    bench_file = out / "bench" / "results.json"
    bench_results = json.loads(bench_file.read_text()) if bench_file.is_file() else None
    names = {r["name"] for r in grid["expansion"]["recipes"]}
    cells = ranking(bench_results, names)
    best = best_recipe(cells)
    grid["ranking"] = cells
    grid["best"] = None
    if best is not None:
        name, score, what = best
        recipe = next(r["recipe"] for r in grid["expansion"]["recipes"] if r["name"] == name)
        grid["best"] = {"name": name, "score": score, "score_is": what}
        write_json(out / "best.json", {**recipe, "measured": {"grid": grid["best"]}})
    results = {**(bench_results or {}), "grid": grid}
    write_json(out / "results.json", results)
    write_report(out, grid, bench_results)
    return results


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def markdown(grid: dict, bench_results: dict | None, no_plot: str | None) -> str:
    verdicts = {g["name"]: g for g in grid["gate"]}
    lines = ["# SpecPilot grid", "", f"`{grid['command']}`", "",
             f"Space `{grid['space_file']}`: {grid['expansion']['combinations']} combinations, "
             f"{len(grid['expansion']['recipes'])} recipes, {len(grid['expansion']['excluded'])} excluded by "
             f"constraints, {len(grid['expansion']['refused'])} refused by the recipe parser, "
             f"{len(grid['expansion']['duplicates'])} duplicates dropped.", ""]
    if grid["gate_settings"] is None:
        lines += ["Gate: **skipped (--no-gate)**: the measured recipes were not checked for lossless output.", ""]
    else:
        g = grid["gate_settings"]
        passed = sum(v["verdict"] == "pass" for v in grid["gate"])
        lines += [f"Gate: {passed} of {len(grid['gate'])} recipes passed the token-forcing gate ({g['limit']} prompts "
                  f"of each workload, {g['max_new_tokens']} tokens, salt {g['salt']}).", ""]
    repeats = grid["bench_settings"]["repeats"]
    lines += [f"Measurement: one bench run (`bench/`), {repeats} repeat(s) of each timed call, the median kept; the "
              "bench records no spread between repeats, so differences within a few percent are noise (run again "
              "with more --repeats to see it move).", ""]
    best = grid.get("best")
    if best:
        lines += [f"**Best: `{best['name']}`** ({best['score_is']}: {best['score']:.3f}), written to best.json.", ""]
    else:
        lines += ["No grid recipe was measured in every cell: no best.json.", ""]
    if grid.get("bench_error"):
        lines += [f"The bench failed: {grid['bench_error']}", ""]
    for cell in grid["ranking"]:
        lines += [f"## {cell['workload']}, B={cell['batch_size']}", "",
                  f"| rank | recipe | tok/s | × {REFERENCE} | τ | × ar | =AR | gate |", "|---:|---|---:|---:|---:|---:|---:|---|"]
        for i, row in enumerate(cell["rows"], 1):
            v = verdicts.get(row["system"])
            gate_cell = (v["verdict"] if v else "not gated (--no-gate)" if row["kind"] == "grid"
                         else "reference" if row["kind"] == "reference" else "built-in")
            lines.append(f"| {i} | `{row['system']}` | {_fmt(row['tokens_per_s'], '{:,.1f}')} | "
                         f"{_fmt(row['ratio'], '{:.3f}')} | {_fmt(row['mean_accepted'], '{:.2f}')} | "
                         f"{_fmt(row['speedup_vs_ar'], '{:.2f}')} | {_fmt(row['identical_to_ar'], '{:.0%}')} | "
                         f"{gate_cell} |")
        lines.append("")
    if not grid["ranking"]:
        lines += ["Nothing was measured.", ""]
    failed = [v for v in grid["gate"] if v["verdict"] != "pass"]
    sections = (("Failed the gate", [(v["name"], f"{v['verdict']}: {v['reason']}") for v in failed]),
                ("Excluded by constraints", [(s["name"], s["reason"]) for s in grid["expansion"]["excluded"]]),
                ("Refused by the recipe parser", [(s["name"], s["reason"]) for s in grid["expansion"]["refused"]]),
                ("Duplicates dropped", [(s["name"], s["reason"]) for s in grid["expansion"]["duplicates"]]),
                ("Bench errors", [(e.get("system") or "-", e["message"])
                                  for e in (bench_results or {}).get("errors", [])]))
    for title, items in sections:
        lines += [f"## {title} ({len(items)})", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in items] or ["none"]
        lines.append("")
    lines.append(f"Plot: {no_plot}" if no_plot else f"Plot: ![tok/s by recipe]({PLOT})")
    return "\n".join(lines) + "\n"


def plot_tok_s(plt, cells: list[dict], path: Path) -> None:
    """One horizontal bar chart of tok/s by system per cell; the reference in another colour, its tok/s a line."""
    fig, axes = plt.subplots(1, len(cells), figsize=(7 * len(cells), 0.3 * max(len(c["rows"]) for c in cells) + 1.5),
                             squeeze=False)
    for ax, cell in zip(axes[0], cells):
        rows = [r for r in cell["rows"] if r["tokens_per_s"]][::-1]
        colours = ["tab:orange" if r["kind"] == "reference" else "tab:blue" if r["kind"] == "grid" else "tab:gray"
                   for r in rows]
        ax.barh([r["system"] for r in rows], [r["tokens_per_s"] for r in rows], color=colours)
        if cell["reference_tokens_per_s"]:
            ax.axvline(cell["reference_tokens_per_s"], color="tab:orange", linestyle="--", linewidth=1)
        ax.set_title(f"{cell['workload']}, B={cell['batch_size']}")
        ax.set_xlabel("tok/s")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_report(out: Path, grid: dict, bench_results: dict | None) -> None:
    """report.md and the plot; without matplotlib report.md alone, saying so (as the bench's report does)."""
    cells = [c for c in grid["ranking"] if any(r["tokens_per_s"] for r in c["rows"])]
    if not cells:
        (out / "report.md").write_text(markdown(grid, bench_results, "nothing measured"))
        return
    try:
        import matplotlib
    except ImportError as e:
        (out / "report.md").write_text(markdown(grid, bench_results, f"matplotlib is not installed: {e}"))
        return
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    (out / "report.md").write_text(markdown(grid, bench_results, None))
    plot_tok_s(plt, cells, out / PLOT)
    plt.close("all")


# -- the command -----------------------------------------------------------------------------------------------

def grid_section(args, expansion: Expansion, salt: str | None) -> dict:
    return {"schema": SCHEMA, "command": command_line(args), "space_file": args.space,
            "space": load_space(args.space), "expansion": expansion.to_dict(),
            "gate_settings": None if args.no_gate else {"limit": args.gate_limit, "max_new_tokens": args.gate_tokens,
                                                        "timeout_s": args.gate_timeout, "salt": salt,
                                                        "workers": getattr(args, "gate_workers", 1)},
            "bench_settings": {"repeats": args.repeats, "batch_sizes": args.batch_sizes, "limit": args.limit,
                               "max_new_tokens": args.max_new_tokens, "workload": args.workload},
            "gate": [], "measured": [], "bench_error": None, "ranking": [], "best": None}


def run_grid(args, sandbox=None) -> int:
    """`specpilot grid`. `sandbox`: tools/sandbox/process, handed on to the bench (a recipe naming candidate kernel
    files is benched there). Exit 0 when some grid recipe was measured, 1 when none was."""
    expansion = expand(load_space(args.space), args.max_recipes)  # a bad or too large space: before anything runs
    workloads = list(bench_run.load_workloads(args.workload, args.limit))  # a bad workload, too
    args.batch_sizes = bench_run.parse_batch_sizes(args.batch_sizes)
    device = default_device(args.device)
    dtype = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    out = Path(args.out)
    (out / "recipes").mkdir(parents=True, exist_ok=True)
    salt = None if args.no_gate else secrets.token_hex(8)
    grid = grid_section(args, expansion, salt)
    known = {} if args.no_gate else earlier_verdicts(out, grid)
    write_json(out / "results.json", {"grid": grid})
    files = {}
    for r in expansion.recipes:
        files[r.name] = out / "recipes" / f"{r.name}.json"
        files[r.name].write_text(json.dumps(r.recipe, indent=1) + "\n")
    print(f"specpilot: grid: {expansion.combinations} combinations, {len(expansion.recipes)} recipes "
          f"({len(expansion.excluded)} excluded, {len(expansion.refused)} refused, {len(expansion.duplicates)} "
          "duplicates)", file=sys.stderr)
    if args.no_gate:
        passing = [r.name for r in expansion.recipes]
    else:
        passing = gate_all(args, expansion, files, workloads, device, dtype, salt, out, grid, known)
    grid["measured"] = passing
    write_json(out / "results.json", {"grid": grid})
    if passing:
        reference = out / "recipes" / f"{REFERENCE}.json"
        reference.write_text(json.dumps(REFERENCE_RECIPE, indent=1) + "\n")
        bench_args = bench_run.parse_args(bench_argv(args, [files[n] for n in passing] + [reference], device, dtype,
                                                     out / "bench"))
        bench_args.argv = getattr(args, "argv", None) or ["grid"]
        try:
            bench_run.run_bench(bench_args, sandbox=sandbox)
        except Exception as e:  # what was gated and what the bench wrote before it failed is still reported
            grid["bench_error"] = f"{type(e).__name__}: {one_line(e)}"
            write_json(out / "results.json", {"grid": grid})
            finish(out)
            raise
    else:
        print("specpilot: grid: no recipe passed the gate: nothing measured", file=sys.stderr)
    results = finish(out)
    best = results["grid"]["best"]
    print(f"specpilot: grid: best {best['name']} ({best['score_is']} {best['score']:.3f}); " if best else
          "specpilot: grid: no best recipe; ", file=sys.stderr, end="")
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}" + (f", {out / 'best.json'}" if best else ""),
          file=sys.stderr)
    return 0 if best else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m specpilot.tools.grid.run DIR (a grid output directory)")
    finish(Path(sys.argv[1]))
    print(f"wrote {Path(sys.argv[1]) / 'report.md'}")
