"""report.md and the plots of a benchmark, from its results.json alone.

    python -m specpilot.tools.bench.report DIR      # (re)write DIR/report.md and DIR/*.png from DIR/results.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PLOTS = ("speedup_vs_batch.png", "tau_histogram.png", "latency_cdf.png")
# The column of the speedup's lowest and highest over a cell's repeats, each repeat's tok/s over AR's in that repeat
# (`--repeats N`, results.json tokens_per_s_repeats): the replica noise of the speedup
SPEEDUP_RANGE = "speedup_range"
# (heading, run key, format): one column of a workload's table
COLUMNS = (("system", "system", "{}"), ("B", "batch_size", "{}"), ("requests", "requests", "{}"),
           ("tok/s", "tokens_per_s", "{:,.1f}"), ("speedup", "speedup_vs_ar", "{:.2f}x"),
           ("in a repeat", SPEEDUP_RANGE, "{:.2f}-{:.2f}x"),
           ("τ", "mean_accepted", "{:.2f}"), ("p50 tok ms", "p50_token_ms", "{:.2f}"),
           ("p99 tok ms", "p99_token_ms", "{:.2f}"), ("TTFT ms", "ttft_ms", "{:.1f}"),
           ("p50 req ms", "p50_request_ms", "{:.0f}"), ("p99 req ms", "p99_request_ms", "{:.0f}"),
           ("=AR", "identical_to_ar", "{:.0%}"), ("peak MiB", "peak_memory_bytes", "{:,.0f}"),
           ("live rows", "live_rows_per_step", "{:.1f}"), ("steady tok/s", "time_budget.steady_tokens_per_s",
                                                             "{:,.0f}"), ("warm-up s", "warmup_seconds", "{:.1f}"))


def _cell(run: dict, key: str, fmt: str) -> str:
    value = run
    for part in key.split("."):  # (a dotted key reads inside an object: time_budget.steady_tokens_per_s)
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "-"
    return fmt.format(value / 2**20 if key == "peak_memory_bytes" else value)


def speedup_range(run: dict, ar: dict | None) -> tuple[float, float] | None:
    """The lowest and highest of `run`'s tok/s over AR's (`ar`, the same cell's), repeat r against repeat r; None
    without repeats of both."""
    mine, theirs = run.get("tokens_per_s_repeats"), (ar or {}).get("tokens_per_s_repeats")
    if not mine or not theirs or len(mine) != len(theirs) or run is ar:
        return None
    ratios = [a / b for a, b in zip(mine, theirs) if b]
    return (min(ratios), max(ratios)) if ratios else None


def workload_table(runs: list[dict]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "|".join("---" if k in ("system",) else "---:" for _, k, _ in COLUMNS) + "|"]
    ar = {r["batch_size"]: r for r in runs if r["system"] == "ar"}
    for run in sorted(runs, key=lambda r: r["batch_size"]):  # stable: system order kept within a batch size
        cells = []
        for _, key, fmt in COLUMNS:
            if key == SPEEDUP_RANGE:
                spread = speedup_range(run, ar.get(run["batch_size"]))
                cells.append("-" if spread is None else fmt.format(*spread))
            else:
                cells.append(_cell(run, key, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_workload(results: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {w: [] for w in results["header"].get("workloads", [])}
    for run in results["runs"]:
        out.setdefault(run["workload"], []).append(run)
    return out


def summary_text(results: dict) -> str:
    parts = []
    for workload, runs in _by_workload(results).items():
        if runs:
            parts.append(f"workload {workload}\n{workload_table(runs)}")
    return "\n\n".join(parts) or "no runs measured"


def resumed_lines(header: dict) -> list[str]:
    """A line for a run that continued another (`--resume`): how many cells came from which run; none otherwise."""
    resumed = header.get("resumed")
    if not resumed:
        return []
    n = len(resumed["cells"])
    return [f"- resumed: {n} cell{'s' * (n != 1)} kept from the run of {resumed['date']} on "
            f"{resumed['device_name']} (`--resume`): each cell's systems side by side in one process"]


def markdown(results: dict, no_plots: str | None = None) -> str:
    """The report; `no_plots` says why there are no plots (none: they are listed)."""
    h = results["header"]
    commit = h.get("git_commit") or "unknown"
    if h.get("git_dirty"):
        commit += " (with uncommitted changes)"
    memory = {r["memory_kind"] for r in results["runs"]}
    lines = [
        "# SpecPilot benchmark", "",
        f"`{h.get('command')}`", "",
        f"- date: {h.get('date')}; git commit: {commit}",
        f"- target: {h.get('target')} ({h.get('dtype')}) on {h.get('device')}: {h.get('device_name')}"
        + (f", driver {h['driver']}" if h.get("driver") else ""),
        (f"- specpilot {h.get('specpilot')}, torch {h.get('torch')}, transformers {h.get('transformers')}, "
         f"triton {h.get('triton') or 'not installed'}"),
        (f"- max new tokens {h.get('max_new_tokens')} ({'EOS ignored' if h.get('ignore_eos') else 'stop at EOS'}), "
         f"repeats {h.get('repeats')} (median), questions per workload: {h.get('limit') or 'all'}"
         + (f", per cell the first max({h['cell_requests']}, B)" if h.get("cell_requests") else "")
         + (f", at least {h['waves']} x B" if (h.get("waves") or 1) > 1 else "")
         + (f"; batching: {h['batching']}" if h.get("batching") else "")),
        *resumed_lines(h),
        ("- speedup and =AR (share of requests token-identical to AR) are against this engine's AR in the same cell; "
         "τ is the mean tokens per verification step; peak memory is "
         + (" / ".join(sorted(memory)) or "-") + " (see docs/BENCH.md)"), "",
    ]
    for workload, runs in _by_workload(results).items():
        lines += [f"## {workload}", "", workload_table(runs) if runs else "no runs measured", ""]
    lines += ["## Errors", ""]
    for e in results["errors"]:
        where = ", ".join(f"{k} {e[k]}" for k in ("system", "workload", "batch_size") if e[k] is not None)
        lines.append(f"- {where or 'bench'}: {e['message']}")
    if not results["errors"]:
        lines.append("none")
    lines += ["", f"Plots: none ({no_plots})" if no_plots else "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS),
              ""]
    return "\n".join(lines)


def _systems(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["system"] for r in runs))


def _axes(plt, count: int, title: str):
    fig, axes = plt.subplots(1, max(count, 1), figsize=(4.5 * max(count, 1), 3.6), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


# The AR a speculative system has to beat, where a run measured it (the grid's reference, engine_bench's system of that
# name): the speedup plot is over it then, else over the modular `ar` every bench runs.
FASTEST_AR = "ar-fused-overlap"


def plot_speedup(plt, results: dict, path: Path) -> None:
    workloads = {w: rs for w, rs in _by_workload(results).items() if rs}
    reference = FASTEST_AR if any(r["system"] == FASTEST_AR for r in results["runs"]) else "ar"
    fig, axes = _axes(plt, len(workloads), "Speedup over the same engine's AR" if reference == "ar"
                      else f"Speedup over our fastest AR ({reference}), same cell")
    for ax, (workload, runs) in zip(axes, workloads.items()):
        base = {r["batch_size"]: r["tokens_per_s"] for r in runs if r["system"] == reference and r.get("tokens_per_s")}
        for system in _systems(runs):
            pts = sorted((r["batch_size"], r["speedup_vs_ar"] if reference == "ar"
                          else r["tokens_per_s"] / base[r["batch_size"]]) for r in runs
                         if r["system"] == system and r.get("speedup_vs_ar") is not None
                         and (reference == "ar" or (r.get("tokens_per_s") and r["batch_size"] in base)))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=workload, xlabel="batch size", ylabel=f"speedup vs {reference}")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_tau(plt, results: dict, path: Path) -> None:
    """Share of verification steps that accepted 0..k drafts, per speculative system, all cells pooled."""
    fig, [ax] = _axes(plt, 1, "Accepted drafts per verification step (all cells)")
    spec = [r for r in results["runs"] if r["draft_tokens"] > 0 and sum(r["accepted_histogram"])]
    systems = _systems(spec)
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        runs = [r for r in spec if r["system"] == system]
        counts = [sum(r["accepted_histogram"][a] for r in runs) for a in range(runs[0]["draft_tokens"] + 1)]
        tau = sum(c * (a + 1) for a, c in enumerate(counts)) / sum(counts)
        ax.bar([a + i * width for a in range(len(counts))], [c / sum(counts) for c in counts], width,
               label=f"{system} (τ={tau:.2f})")
    if not systems:
        ax.text(0.5, 0.5, "no speculative system measured", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="drafts accepted", ylabel="share of steps")
    if systems:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_latency_cdf(plt, results: dict, path: Path) -> None:
    """Per-token latency CDF per system at the smallest batch size measured."""
    runs = [r for r in results["runs"] if r["token_latency_quantiles_ms"]]
    smallest = min((r["batch_size"] for r in runs), default=None)
    workloads = list(dict.fromkeys(r["workload"] for r in runs if r["batch_size"] == smallest))
    fig, axes = _axes(plt, len(workloads), f"Per-token latency CDF, batch size {smallest}")
    for ax, workload in zip(axes, workloads):
        for r in runs:
            if r["workload"] == workload and r["batch_size"] == smallest:
                qs = r["token_latency_quantiles_ms"]
                ax.plot(qs, [i / (len(qs) - 1) for i in range(len(qs))], label=r["system"])
        ax.set(title=workload, xlabel="ms per token", ylabel="share of tokens")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_report(out: Path, results: dict) -> None:
    """report.md and the plots; without matplotlib (a GPU image may lack it) report.md alone, saying so."""
    try:
        import matplotlib
    except ImportError as e:
        (out / "report.md").write_text(markdown(results, f"matplotlib is not installed: {e}"))
        return
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    (out / "report.md").write_text(markdown(results))
    for name, plot in zip(PLOTS, (plot_speedup, plot_tau, plot_latency_cdf)):
        plot(plt, results, out / name)
        plt.close("all")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m specpilot.tools.bench.report DIR (a bench output directory with results.json)")
    directory = Path(sys.argv[1])
    write_report(directory, json.loads((directory / "results.json").read_text()))
    print(f"wrote {directory / 'report.md'}" + (f" and {', '.join(PLOTS)}" if (directory / PLOTS[0]).is_file() else ""))
