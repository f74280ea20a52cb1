"""The run's outputs: DIR/recipe.json (the best recipe, its measurements and gate report in `measured`),
DIR/report.md (every round: gaps, who chose which agents and why, candidates with reasons, tool results, gate
outcomes, the speedup progression, device and wall minutes) and DIR/progress.png (when matplotlib is installed;
without it the report says so and keeps the table)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from .artifacts import read_json, round_dir, write_json
from .proposals import plain
from .state import MIN_GAIN, decision


def final_recipe(state: dict) -> dict:
    s, best = state["settings"], state["best"]
    m = best["measured"]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", Path(str(s["target"])).name).strip("-") or "target"
    g = best["gate"]
    return plain(best["recipe"]) | {
        "name": f"specpilot-{slug}-{s['workload']}-b{s['batch_size']}".replace("/", "-"),
        "description": f"specpilot optimize: {best['source']} (round {best['round']})",
        "measured": {
            "speedup_vs_ar": m["speedup_vs_ar"], "speedup_vs_stock": m["speedup_vs_stock"],
            "tokens_per_s": m["tokens_per_s"], "tau": m.get("tau"), "identical_to_ar": m.get("identical_to_ar"),
            "deployment": {k: s[k] for k in ("target", "workload", "batch_size", "device", "dtype",
                                             "max_new_tokens", "limit")},
            "gate": {k: g.get(k) for k in ("passed", "reason", "salt", "epsilon", "tokens_checked",
                                          "exact_matches", "ties", "report")},
            "bench": m.get("bench"), "source": best["source"], "round": best["round"],
            "rounds": state.get("round", 0), "stop_reason": state.get("stop_reason"), "run": str(s["out_dir"]),
            # the run's cost: minutes its measurements held the device (the GPU-minutes budget), and of work
            "device_minutes": round(state.get("device_s", 0.0) / 60, 3),
            "wall_minutes": round(state.get("elapsed_s", 0.0) / 60, 3),
        }}


def _fmt(x, spec=".2f", suffix="x") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _cell(text) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def _candidate_rows(state: dict, n: int) -> list[str]:
    rows = ["| id | agent | origin | status | reason | kernel check | gate | x best | x ar | x stock | verdict |",
            "|---|---|---|---|---|---|---|---:|---:|---:|---|"]
    evs = state.get("evaluations", {})
    recs = sorted((r for r in state.get("candidates", {}).values() if r["round"] == n),
                  key=lambda r: (r["pass"], r["agent"], r["order"]))
    for r in recs:
        ev = evs.get(r["id"]) or {}
        k, g, sp = ev.get("kernel"), ev.get("gate"), ev.get("speed") or {}
        kernel = "–" if not k else ("passed" if k["passed"] else f"{k['failure']}")
        gate = "–" if not g else ("passed" if g["passed"] else f"failed: {g['reason']}")
        verdict = ("wins" if ev.get("beats_best") else ev.get("failure")) if ev else r.get("error")
        rows.append("| " + " | ".join(_cell(c) for c in (
            r["id"], r["agent"], r.get("origin"), r["status"], r.get("reason", "")[:300], kernel, gate,
            _fmt(sp.get("speedup_vs_best"), ".3f"), _fmt(sp.get("speedup_vs_ar")), _fmt(sp.get("speedup_vs_stock")),
            verdict)) + " |")
    return rows if len(rows) > 2 else ["(no candidates)"]


def _memory_lines(state: dict, n: int) -> list[str]:
    """How memory steered round n: the changes proposed first because they worked on a similar deployment, those not
    proposed because they failed on one, and a lookup that failed."""
    recs = sorted((r for r in state.get("candidates", {}).values() if r["round"] == n and r.get("origin") == "memory"),
                  key=lambda r: (r["pass"], r["agent"], r["order"]))
    lines = [f"- tried first: {r['id']} ({r['agent']}), because it {r.get('reason', '').removeprefix('memory: ')}"
             for r in recs]
    lines += [f"- {t['node']}: {t['decision']} — {t['why']}" for t in state.get("trail", [])
              if t["round"] == n and t["who"] == "memory"]
    return lines


def _round_section(state: dict, n: int) -> list[str]:
    out = Path(state["settings"]["out_dir"])
    lines = [f"## Round {n}", ""]
    prof_path = round_dir(out, n) / "profile" / "profile.json"
    if prof_path.is_file():
        prof = read_json(prof_path)
        st, acc = prof["step"], prof["acceptance"]
        start = [p["source"] for p in state.get("progression", []) if p["round"] == n - 1]
        lines += [f"Profile of the best recipe at the start of the round ({start[0] if start else '?'}): step "
                  f"{st['loop_s'] * 1e3:.3f} ms, {st['tokens_per_s']:.1f} tok/s, tau {acc['tau']:.2f}.", "",
                  "| gap | measured ms | floor ms | gain | agent | reason |", "|---|---:|---:|---:|---|---|"]
        for g in prof["gaps"][:8]:
            lines.append(f"| {_cell(g['component'])} | {g['measured_s'] * 1e3:.3f} | {g['floor_s'] * 1e3:.3f} | "
                         f"{g['gain'] * 100:.1f}% | {g['agent']} | {_cell(g['reason'])} |")
        lines.append("")
    route = round_dir(out, n) / "route.json"
    if route.is_file():
        r = read_json(route)
        lines += [f"Router ({r['who']}): {', '.join(r['agents']) or 'no agent'} — {r['reason']}"
                  + (f" ({r['note']})" if r.get("note") else ""), ""]
    memory = _memory_lines(state, n)
    if memory:
        lines += ["Memory (outcomes on similar deployments):", ""] + memory + [""]
    people = [t for t in state.get("trail", []) if t["round"] == n and t["who"] == "human"]
    lines += ["Candidates:", ""] + _candidate_rows(state, n) + [""]
    integ = round_dir(out, n) / "integration.json"
    if integ.is_file():
        i = read_json(integ)
        # (the proposal already names the combination tried, if any)
        lines += [f"Integration: {i['proposal']}" + ("" if i["adopted"] else " (not adopted)"), ""]
    if people:
        lines += ["Decisions by a person:", ""] + [f"- {t['node']}: {t['decision']}" + (f" ({t['why']})" if t["why"]
                                                                                       else "") for t in people]
        lines.append("")
    return lines


def why_not_faster(state: dict) -> str | None:
    """When the best is not a 2% win over stock: why, from the candidates' verdicts and the stop reason."""
    m = state["best"]["measured"]
    if (m.get("speedup_vs_stock") or 0) >= 1 + MIN_GAIN:
        return None
    reasons = []
    evs = state.get("evaluations", {})
    for r in state.get("candidates", {}).values():
        ev = evs.get(r["id"])
        why = (ev or {}).get("failure") or r.get("error")
        if why:
            reasons.append(f"- {r['id']} ({r['agent']}, round {r['round']}): {why}")
    head = (f"The best recipe is {m['speedup_vs_stock']:.2f}x stock: no change beat stock by {MIN_GAIN:.0%}. "
            f"The run stopped because: {state.get('stop_reason')}.")
    return head + ("\n\nWhat was tried:\n\n" + "\n".join(reasons) if reasons else " No candidate was evaluated.")


def write_plot(state: dict, path: Path) -> str | None:
    """DIR/progress.png; without matplotlib (a GPU image may lack it) no plot, and the reason is returned."""
    try:
        import matplotlib
    except ImportError as e:
        path.unlink(missing_ok=True)  # a plot from an earlier report of this run would no longer be current
        return f"no plot: matplotlib is not installed ({e})"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prog = state.get("progression", [])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rounds = [p["round"] for p in prog]
    ax.plot(rounds, [p["speedup_vs_ar"] for p in prog], "o-", label="best recipe over ar")
    # each point is from its own side-by-side measurement: over stock shows progress even when ar ran faster there
    ax.plot(rounds, [p["speedup_vs_stock"] for p in prog], "s--", label="best recipe over stock")
    stock = (state.get("baselines") or {}).get("stock", {}).get("speedup_vs_ar")
    if stock:
        ax.axhline(stock, linestyle="--", color="gray", label="stock (round 1)")
    ax.axhline(1.0, linestyle=":", color="black", label="ar")
    evs = state.get("evaluations", {})
    xs = [e["round"] for e in evs.values() if (e.get("speed") or {}).get("speedup_vs_ar")]
    ys = [e["speed"]["speedup_vs_ar"] for e in evs.values() if (e.get("speed") or {}).get("speedup_vs_ar")]
    if xs:
        ax.scatter(xs, ys, marker="x", color="tab:orange", label="candidates that passed the gate")
    ax.set_xlabel("round (0 = start)")
    ax.set_ylabel("speedup (tok/s ratio)")
    ax.set_title(f"{Path(str(state['settings']['target'])).name}, {state['settings']['workload']}, "
                 f"B={state['settings']['batch_size']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(state: dict) -> None:
    s = state["settings"]
    out = Path(s["out_dir"])
    best = state.get("best")
    lines = [f"# specpilot optimize: {s['target']}", "",
             f"{s['workload']} workload, batch {s['batch_size']}, {s['device']} ({s['dtype']}), "
             f"{s['max_new_tokens']} new tokens, {s['limit']} prompts; provider {s['provider']}"
             + (f" ({s['model']})" if s.get("model") else "") + f"; gate salt {s['salt']}.", ""]
    if best:
        write_json(out / "recipe.json", final_recipe(state))
        m, g = best["measured"], best["gate"]
        lines += [f"**Best recipe: {best['source']}** (round {best['round']}): {_fmt(m['speedup_vs_ar'])} over ar, "
                  f"{_fmt(m['speedup_vs_stock'])} over stock, {m['tokens_per_s']:.1f} tok/s, tau "
                  f"{_fmt(m.get('tau'), '.2f', '')}; token-forcing gate passed on {g.get('tokens_checked')} tokens "
                  f"({g.get('ties')} ties forced). Written to recipe.json.", ""]
        why = why_not_faster(state)
        if why:
            lines += [why, ""]
        no_plot = write_plot(state, out / "progress.png")
        lines += [f"({no_plot}; the table below has the same figures)" if no_plot
                  else "![speedup progression](progress.png)", "", "| round | best | x ar | x stock | tok/s |",
                  "|---:|---|---:|---:|---:|"]
        for p in state.get("progression", []):
            lines.append(f"| {p['round']} | {p['source']} | {_fmt(p['speedup_vs_ar'])} | "
                         f"{_fmt(p['speedup_vs_stock'])} | {p['tokens_per_s']:.1f} |")
        lines.append("")
    else:
        lines += [f"**No recipe**: {state.get('stop_reason')}", ""]
    lines += [f"Stopped: {state.get('stop_reason')}. Time: {state.get('elapsed_s', 0.0) / 60:.1f} wall minutes of "
              f"work, {state.get('device_s', 0.0) / 60:.1f} device minutes.", ""]
    for n in range(1, state.get("round", 0) + 1):
        lines += _round_section(state, n)
    lines += ["## Every decision", "", "| round | node | who | decision | why |", "|---:|---|---|---|---|"]
    for t in state.get("trail", []):
        lines.append(f"| {t['round']} | {t['node']} | {_cell(t['who'])} | {_cell(t['decision'])} | "
                     f"{_cell(t['why'])[:400]} |")
    lines += ["", "## Settings", "", "```json", json.dumps(s, indent=1, sort_keys=True), "```", ""]
    (out / "report.md").write_text("\n".join(lines))


def report(state: dict) -> dict:
    write_outputs(state)
    return {"trail": [decision(state.get("round", 0), "report", "graph", "stop", state.get("stop_reason") or "")]}
