"""Speculation against AR at every batch size: one `specpilot bench` run, B = 1..64, code, chat and summarize.

What it measures (issue #20 item 5). One `specpilot bench` run over B in {1, 2, 4, 8, 16, 32, 64} and the code, chat and
summarize workloads (`--workloads` picks some: one run per device call), 128 new tokens, `--cell-requests 8 --waves 4`:
a cell decodes max(8, 4 x B) requests, B at a time, continuously batched (a request's row goes to the next waiting
request when it finishes; HF decodes batches of B in order). Systems: `ar` (the reference), `stock`, and by default our
fastest AR (the fused layer with overlap), the n-gram chain (adaptive min-2, fused, overlap) and the packaged EAGLE-3
head's chain of up to 3, each under the batch controller, and HF's static cache (`--baselines hf-static`; HF's prompt
lookup decodes a row at a time). `--recipes` names others (the shipped recipe `ngram2-k4-adaptive-armiss-fused-overlap`,
ragged verification `ngram2-k4-ragged-fused-overlap`, ...). Every system warms every shape of a cell before anything is
timed; each run reports `captures_while_timed`. The table: tok/s per cell and the ratio to our fastest AR, then the
controller's choices and its step prices; the bench's results.json is in NAME.json, from which
tools/bench/report.write_report draws report.md and speedup_vs_batch.png.

`--repeats N` times each cell's call N times a system (the systems in turn, the order rotated): each ratio then
carries its range over the repeats, and the table ends with the speculative cells below our fastest AR in every
repeat (issue #20's bar reads a loss within that replica noise as none).

`--resume DIR`: the sweep's bench writes to DIR and continues the results.json there (`specpilot bench --resume`):
a sweep stopped at a call's time limit goes on in the next call with the same command (DIR under /tmp on a warm
machine; on a fresh one, the stopped run's results.json carried in: benchmarks/README.md), one bench run whose cells
came from several calls, each cell's systems still side by side in one process.

`--crash-check` first reruns issue #20's crashing command verbatim (chat, B = 8 and 32, 32 requests a cell, the
ar_after_miss recipe, `--baselines hf`), and records whether it finished and its HF figures.

Backs docs/BENCHMARKS.md, "speculation against our fastest AR at B = 1-64" (issue #20 item 5): the thirtieth lease,
docs/benchmarks/2026-12-06-thirtieth-lease.md (its first run, the tenth lease's A, was not quotable: it exposed the
fused layer's dead-token bug).

Device minutes: about 4 for `--crash-check`; the sweep with HF, one workload a call: code 8.4, chat 5.2,
summarize 3.0 (H100, thirtieth lease).
"""
from __future__ import annotations

from pathlib import Path

import harness

MINUTES = 9
FASTEST_AR = "ar-fused-overlap"
RECIPES = ("ar-fused-overlap", "ngram2-k4-cost-fused-overlap", "eagle3-k3-cost-fused-overlap")
# The recipe of issue #20's crash, as the issue gives it.
CRASH_RECIPE = {"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True,
                            "ar_after_miss": True}, "k": 4, "layer": "fused", "overlap": True}


def arguments(p) -> None:
    p.add_argument("--workloads", default="code,chat,summarize")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cell-requests", type=int, default=8)
    p.add_argument("--waves", type=int, default=4, help="a cell decodes at least this many times B requests")
    p.add_argument("--batching", default="continuous", choices=("continuous", "static"))
    p.add_argument("--repeats", type=int, default=1,
                   help="each cell's call timed this many times a system (the systems in turn): with 2 or more, "
                        "each ratio's range over the repeats (the replica noise issue #20's bar is read within)")
    p.add_argument("--baselines", default="hf-static")
    p.add_argument("--lead-in", type=float, default=None,
                   help="the bench's --lead-in: seconds of a system's own untimed decoding before each timed call "
                        "(default: the bench's, 0.3; 0: none, as before the forty-seventh lease)")
    p.add_argument("--resume", default="", metavar="DIR",
                   help="the sweep's bench in DIR, continuing the results.json there (`specpilot bench --resume`)")
    p.add_argument("--crash-check", action="store_true", help="first rerun issue #20's crashing command")
    p.add_argument("--no-sweep", action="store_true", help="only the crash check")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="the sweep's recipes besides ar and stock: any of the bench's systems (tools/bench)")
    p.add_argument("--margins", default="",
                   help="also each controller recipe of --recipes at these batch.margin values, e.g. 0.15 "
                        "(ngram2-k4-cost-m15-fused-overlap)")
    p.add_argument("--probe-every", default="",
                   help="also each controller recipe of --recipes at these batch.probe_every values, e.g. 32 "
                        "(ngram2-k4-cost-p32-fused-overlap)")


def table(results: dict, reference: str) -> str:
    """The bench's table, then what the batch controller chose (steps of each kind k', 0: AR, where a run mixed
    them), the shapes captured while timed (none after the cells' warm-ups) and each cell's live rows a step."""
    kinds = [f"- {r['workload']} B={r['batch_size']} {r['system']}: {r['step_kinds']}"
             + (" at ms " + ", ".join(f"{k}: {v:.3f}" for k, v in r["step_prices_ms"].items())
                if r.get("step_prices_ms") else "")
             + ("; in the loop " + ", ".join(f"{k}: {v:.3f}" for k, v in r["step_loop_ms"].items())
                if r.get("step_loop_ms") else "")
             for r in results["runs"] if r.get("step_kinds") and (len(r["step_kinds"]) > 1 or r.get("step_prices_ms"))]
    captured = {(r["system"], r["workload"], r["batch_size"]): r.get("captures_while_timed")
                for r in results["runs"] if r.get("captures_while_timed")}
    text = harness.bench_table(results, reference) + f"\n\nShapes captured while timed: {captured or 'none'}."
    lead_in = (results.get("header") or {}).get("lead_in_s")
    if lead_in is not None:  # (results before the forty-seventh lease have none: no lead-in)
        text += (f"\n\nEach timed call on the GPU came after {lead_in:g} s of the same system's own untimed decoding "
                 "(the bench's lead-in)." if lead_in > 0 else "\n\nNo lead-in (`--lead-in 0`): each timed call in "
                 "the clocks the system before it left.")
    beyond = losses_beyond_noise(results, reference)
    if beyond is not None:
        text += (f"\n\nBelow 1.0x {reference} in every repeat (a loss beyond the replica noise, issue #20's bar): "
                 + (", ".join(beyond) or "none") + ".")
    if kinds:
        text += ("\n\nSteps by kind k' (0: AR), where a run had more than one kind, and the controller's price of "
                 "each kind (replayed at warm-up; then as the loop timed it):\n\n" + "\n".join(kinds))
    occupancy = {}
    for r in results["runs"]:
        if r.get("live_rows_per_step") is not None:
            occupancy.setdefault((r["workload"], r["batch_size"]), []).append(
                f"{r['system']} {r['live_rows_per_step']:.1f}")
    if occupancy:
        text += ("\n\nLive rows a step (a batch's occupancy):\n\n"
                 + "\n".join(f"- {wl} B={b}: {', '.join(v)}" for (wl, b), v in occupancy.items()))
    warm = {}
    for r in results["runs"]:
        if r.get("warmup_seconds") is not None:
            warm.setdefault((r["workload"], r["batch_size"]), []).append(f"{r['system']} {r['warmup_seconds']:.1f}")
    if warm:
        text += ("\n\nWarm-up seconds in each cell, before its timing (what a first request of that batch size "
                 "costs each system, after the cells before it):\n\n"
                 + "\n".join(f"- {wl} B={b}: {', '.join(v)}" for (wl, b), v in warm.items()))
    uneven = cache_lines(results, reference)
    if uneven:
        text += ("\n\nCells where a system's static KV cache was longer than " + reference + "'s (slots a row; the "
                 "fused layer's attention grid covers it):\n\n" + "\n".join(uneven))
    budgets = [r for r in results["runs"] if r.get("time_budget") and r["batch_size"] > 1]
    if budgets:
        text += ("\n\nWhere the steps' time went (ms; the bench's time_budget): the cell's wall time, its steps' "
                 "reads summed; requests started (steps behind a refill, their time beyond a typical step of their "
                 "kind; the prefills that started them, their device time); the drain (steps once no request "
                 "waited, their live rows); tok/s and live rows before the drain:\n\n"
                 "| workload | B | system | wall | steps' time | refill steps | refill extra | prefills | "
                 "prefill time | drain steps | drain | drain live rows | steady tok/s | steady live rows |\n"
                 "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
                 + "\n".join(budget_row(r) for r in budgets))
        kinds = [f"- {r['workload']} B={r['batch_size']} {r['system']}: " + ", ".join(
                     f"k'={k} {v['steps']} steps, {v['ms']:.3f} ms, {v['live']:.1f} live, {v['tokens']:.1f} tokens"
                     for k, v in r["time_budget"]["steady_by_kind"].items())
                 for r in budgets if r["time_budget"].get("steady_by_kind")]
        if kinds:
            text += ("\n\nBefore the drain, the steps not behind a refill by kind (count, mean loop time, live rows, "
                     "tokens):\n\n" + "\n".join(kinds))
    events = [r for r in results["runs"] if (r.get("step_log") or {}).get("device_ms")]
    if events:
        text += ("\n\nEach step between CUDA events (SPECPILOT_STEP_EVENTS=1), before the drain and not behind a "
                 "refill: per kind k', steps, the median device ms a step, the mean idle µs before it:\n\n"
                 + "\n".join(device_line(r) for r in events))
    return text


# A run stopped at its time limit (benchmarks/run.py) reports its finished cells as a finished run does: the lists too.
partial_table = table


def cache_lines(results: dict, reference: str) -> list[str]:
    """Per cell, the systems whose cache held more slots a row than the reference's (runs without `cache_slots`,
    HF's and older results, left out)."""
    cells: dict[tuple, dict[str, int]] = {}
    for r in results["runs"]:
        if r.get("cache_slots"):
            cells.setdefault((r["workload"], r["batch_size"]), {})[r["system"]] = r["cache_slots"]
    lines = []
    for (workload, batch), slots in cells.items():
        ref = slots.get(reference)
        longer = {name: n for name, n in slots.items() if ref is not None and n > ref}
        if longer:
            lines.append(f"- {workload} B={batch}: {reference} {ref}, "
                         + ", ".join(f"{name} {n}" for name, n in longer.items()))
    return lines


def device_line(r: dict) -> str:
    """One run's steps by kind on the device (tools/bench/step_events.summary of its step log's columns)."""
    from specpilot.tools.bench import step_events

    log = r["step_log"]
    keep = [not refill and not drain for refill, drain in zip(log["refill"], log["drain"])]
    kinds = step_events.summary(log["kind"], log["device_ms"], log["idle_us"], keep)
    return (f"- {r['workload']} B={r['batch_size']} {r['system']}: "
            + ", ".join(f"k'={k} {v['steps']}, {v['device_ms']:.4f} ms, idle {v['idle_us_mean']:.1f} µs"
                        for k, v in kinds.items()))


def losses_beyond_noise(results: dict, reference: str) -> list[str] | None:
    """The speculative systems' cells (not an AR system, not HF's) whose tok/s was below `reference`'s in every
    repeat, with the ratio's range; None where the run has no repeats to tell noise by."""
    cells, ranged = harness.bench_cells(results), False
    out = []
    for (workload, b), cell in cells.items():
        ref = cell.get(reference)
        for system, run in cell.items():
            if ref is None or system.startswith(("ar", "hf-")):
                continue
            spread = harness.ratio_range(run, ref)
            ranged |= spread is not None
            if spread is not None and spread[1] < 1.0:
                out.append(f"{workload} B={b} {system} ({spread[0]:.2f}-{spread[1]:.2f})")
    return out if ranged else None


def sweep_recipes(names: list[str], systems: dict, variants: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The sweep's recipes by name: each of `names` (the bench's systems), then every batch-controller recipe among
    them (named -cost-) again with each of `variants` ((tag, batch keys) pairs: `batch_variants`) set in its batch,
    named -cost-TAG-."""
    out = [(name, systems[name]) for name in names]
    for tag, keys in variants:
        for name in (n for n in names if "-cost-" in n):
            cost = systems[name]
            out.append((name.replace("-cost-", f"-cost-{tag}-"), {**cost, "batch": {**cost["batch"], **keys}}))
    return out


def batch_variants(margins: str, probe_every: str) -> list[tuple[str, dict]]:
    """`--margins` and `--probe-every` as (tag, batch keys): margin 0.15 is m15 (hundredths), probe_every 32 p32."""
    return ([(f"m{round(float(m) * 100)}", {"margin": float(m)}) for m in margins.split(",") if m]
            + [(f"p{int(n)}", {"probe_every": int(n)}) for n in probe_every.split(",") if n])


def budget_row(r: dict) -> str:
    b = r["time_budget"]
    live = "-" if b["drain_live_rows"] is None else f"{b['drain_live_rows']:.1f}"
    steady = "-" if b["steady_tokens_per_s"] is None else f"{b['steady_tokens_per_s']:,.0f}"
    steady_live = "-" if b.get("steady_live_rows") is None else f"{b['steady_live_rows']:.1f}"
    return (f"| {r['workload']} | {r['batch_size']} | {r['system']} | {r['seconds'] * 1e3:.0f} | "
            f"{b['steps_s'] * 1e3:.0f} | {b['refill_steps']} | {b['refill_extra_s'] * 1e3:.0f} | "
            f"{b.get('refill_prefills', '-')} | {b.get('refill_prefill_s', 0.0) * 1e3:.0f} | "
            f"{b['drain_steps']} | {b['drain_s'] * 1e3:.0f} | {live} | {steady} | {steady_live} |")


def run(out_dir, args):
    from specpilot.tools.bench.engine_bench import SYSTEMS

    ctx = args.ctx
    found, text = {}, []
    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, 64, args.max_new_tokens)
    if args.crash_check:
        recipe = ctx.recipe("R", CRASH_RECIPE)
        argv = ["--recipe", recipe, "--workload", "chat", "--batch-sizes", "8,32", "--max-new-tokens", 128,
                "--limit", 32, "--cell-requests", 32, "--baselines", "hf"]
        if args.smoke:
            argv = ["--recipe", recipe, "--workload", "chat", "--batch-sizes", "2", "--max-new-tokens", 8,
                    "--limit", 2, "--cell-requests", 2]
        found["crash_check"] = harness.specpilot_bench(ctx, "crash_check", argv, timeout=330)
        text.append("## Issue #20's crash command\n\n" + table(found["crash_check"], "ar"))
    if not args.no_sweep:
        sizes = args.batch_sizes.split(",")
        if args.smoke:
            sizes = sizes[:2]
        argv = ["--workload", ",".join(workloads), "--batch-sizes", ",".join(sizes), "--max-new-tokens", tokens,
                "--limit", max(limit, max(map(int, sizes))), "--cell-requests", 1 if args.smoke else args.cell_requests,
                "--waves", 1 if args.smoke else args.waves, "--batching", args.batching, "--repeats", args.repeats]
        names = [n for n in args.recipes.split(",") if n]
        unknown = sorted(set(names) - set(SYSTEMS))
        if unknown or FASTEST_AR not in names:
            raise SystemExit(f"--recipes: {', '.join(unknown) or 'no ' + FASTEST_AR} (any of the bench's systems: "
                             f"{', '.join(SYSTEMS)}; {FASTEST_AR} is the table's reference)")
        for name, recipe in sweep_recipes(names, SYSTEMS, batch_variants(args.margins, args.probe_every)):
            argv += ["--recipe", ctx.recipe(name, recipe)]
        if args.baselines and not args.smoke:
            argv += ["--baselines", args.baselines]
        if args.lead_in is not None:
            argv += ["--lead-in", args.lead_in]
        if args.resume:
            # the bench's folder in the scratch is DIR, so that a stopped run's cells are found there as ever
            where = Path(args.resume).resolve()
            where.mkdir(parents=True, exist_ok=True)
            (ctx.scratch / "sweep").symlink_to(where, target_is_directory=True)
            argv += ["--resume"]
        found["sweep"] = harness.specpilot_bench(ctx, "sweep", argv, timeout=570)
        text.append("## Every batch size\n\n" + table(found["sweep"], FASTEST_AR))
    return found, "\n\n".join(text)
