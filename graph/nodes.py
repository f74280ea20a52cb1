"""The graph's nodes before and after evaluation: profiler, router, the three agents, review, remember.

Every node is a plain function of the state returning an update. A node can run more than once for the same step
(LangGraph re-executes it after a person answers one of its questions, and `specpilot resume` re-runs the node a
killed process was in), so each one's expensive or non-deterministic work is kept on disk in the run directory and
read back: a profile, a provider's decision, a proposal, a memory record is made once per run.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from langgraph.types import Send

from ..engine.loader import packaged_heads
from ..engine.recipe import RecipeError, load_recipe, parse
from ..memory import Outcome
from ..memory.records import current_versions, deployment_from_profile
from .artifacts import cached_json, log_evaluation, mark_remembered, remembered, round_dir, write_json
from .candidates import AGENTS, AgentContext
from .context import context_for, propose, provider_name, route
from .human import ask
from .measure import bench, gate, profile
from .progress import emit
from .proposals import changes, owner_of, plain, record
from .state import DEFAULTS, budget_spent, decision, make_settings

TOP_GAPS_SHOWN = 8


def agent_of(gap: dict) -> str:
    """The profiler writes `kernel-writer`; the graph's agents are Python names."""
    return str(gap.get("agent", "")).replace("-", "_")


def _architecture(target: str) -> str:
    from ..engine.loader import source_dir

    config = json.loads((source_dir(target) / "config.json").read_text())
    return str(config.get("model_type") or (config.get("architectures") or ["unknown"])[0])


def _synthetic(target: str) -> bool:
    """A target with random weights (engine/synthetic.py): what its drafters find in its text is noise."""
    from ..engine.loader import source_dir
    from ..engine.synthetic import synthetic_seed

    return synthetic_seed(source_dir(target) / "config.json") is not None


def gate_batch(settings: dict, recipe: dict) -> int:
    """The gate decodes in the batches the deployment would: the deployment's batch size, capped by the recipe's
    (read from the parsed recipe, so a minimal recipe without a `batch` section gets the default)."""
    try:
        max_batch = parse(recipe).batch.max_batch_size
    except (RecipeError, TypeError, AttributeError):  # not a valid recipe: its gate fails on its own terms
        max_batch = ((recipe.get("batch") or {}).get("max_batch_size") if isinstance(recipe, dict) else None) \
            or settings["batch_size"]
    return max(1, min(settings["batch_size"], max_batch))


def measured_from(bench_result: dict, system: str) -> dict:
    run = bench_result["systems"][system]
    return {"tokens_per_s": run["tokens_per_s"], "speedup_vs_ar": run["speedup_vs_ar"],
            "speedup_vs_stock": run["speedup_vs_stock"], "tau": run["mean_accepted"],
            "identical_to_ar": run["identical_to_ar"], "p50_token_ms": run["p50_token_ms"],
            "bench": bench_result["dir"]}


# -- profiler -----------------------------------------------------------------------------------------------------

def _start(settings: dict, out: Path) -> dict:
    """Round 1's starting point: `stock` if it passes the gate (else `ar`, the stock system itself), measured side
    by side with `ar` and `stock` in one process. Written to DIR/baseline/start.json once."""

    def compute() -> dict:
        log_evaluation(out, "baseline", "start")
        device_s, gates = 0.0, {}
        for name in ("stock", "ar"):
            recipe = asdict(load_recipe(name, settings["target"]))
            g, sec = gate(settings, name, out / "baseline" / f"gate-{name}", gate_batch(settings, recipe))
            device_s, gates[name] = device_s + sec, g
            if g["passed"]:
                break
        else:
            log_evaluation(out, "baseline", "done")
            return {"best": None, "device_s": device_s, "gates": gates,
                    "why": f"neither stock nor ar passed the gate: {gates['stock']['reason']}"}
        b, sec = bench(settings, [], out / "baseline" / "bench")
        device_s += sec
        log_evaluation(out, "baseline", "done")
        if not b["ok"] or name not in b["systems"] or "ar" not in b["systems"]:
            why = b["error"] or "; ".join(e["message"] for e in b["errors"]) or "no measurement"
            return {"best": None, "device_s": device_s, "gates": gates, "why": f"measuring ar and stock failed: {why}"}
        best = {"recipe": recipe, "path": name, "source": name, "round": 0, "gate": g,
                "measured": measured_from(b, name)}
        return {"best": best, "device_s": device_s, "gates": gates,
                "baselines": {s: b["systems"][s] for s in ("ar", "stock")}, "why": None}

    return cached_json(out / "baseline" / "start.json", compute)


def _profile(settings: dict, best: dict, out_dir: Path) -> tuple[dict, float]:
    path = out_dir / "profile.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), 0.0
        except json.JSONDecodeError:  # written by a process that was killed while writing it: measure again
            pass
    return profile(settings, best["path"], out_dir)


def complete(settings: dict) -> dict:
    """Settings as `specpilot optimize` makes them, from the few a LangGraph Studio user types (target, out_dir)."""
    if not set(DEFAULTS) - set(settings) and settings.get("out_dir"):
        return settings
    s = make_settings(**{k: v for k, v in settings.items() if k in DEFAULTS})
    s["out_dir"] = str(Path(s["out_dir"] or f"runs/optimize-{time.strftime('%Y%m%d-%H%M%S')}").resolve())
    return s


def profiler(state: dict) -> dict:
    t0 = time.perf_counter()
    s, n = complete(state["settings"]), state.get("round", 0) + 1
    out = Path(s["out_dir"])
    update: dict = {"settings": s, "round": n, "redirects": [], "agent_pass": 0, "trail": [], "device_s": 0.0}
    best = state.get("best")
    if not best:
        emit(f"round {n}: gating stock and measuring ar / stock")
        start = _start(s, out)
        update["device_s"] += start["device_s"]
        if start["best"] is None:
            return update | {"stop_reason": start["why"], "elapsed_s": time.perf_counter() - t0,
                             "trail": [decision(n, "profiler", "gate", "no starting recipe", start["why"])]}
        best = start["best"]
        m = best["measured"]
        update |= {"best": best, "baselines": start["baselines"],
                   "progression": [{"round": 0, "source": best["source"], "speedup_vs_ar": m["speedup_vs_ar"],
                                    "speedup_vs_stock": m["speedup_vs_stock"], "tokens_per_s": m["tokens_per_s"]}]}
        update["trail"].append(decision(0, "profiler", "gate", f"start from {best['source']}",
                                        f"passed the gate ({best['gate']['tokens_checked']} tokens checked); "
                                        f"{m['speedup_vs_ar']:.2f}x ar"))
    emit(f"round {n}: profiling {best['source']}")
    prof, sec = _profile(s, best, round_dir(out, n) / "profile")
    deployment = deployment_from_profile(prof, architecture=_architecture(s["target"]),
                                         weight_format=best["recipe"]["weights"]["format"],
                                         workload_mix=s["workload"])
    deployment |= {"workload": s["workload"], "max_new_tokens": s["max_new_tokens"], "limit": s["limit"],
                   "drafter_heads": _heads(s),
                   "synthetic": _synthetic(s["target"]), "replay_acceptance": s.get("acceptance"),
                   "replay_ranks": s.get("acceptance_ranks")}
    return update | {"profile": prof, "gaps": prof["gaps"], "deployment": deployment,
                     "device_s": update["device_s"] + sec, "elapsed_s": time.perf_counter() - t0}


def _heads(s: dict) -> list[str]:
    """The EAGLE-3 heads the agents may draft with: those given (optimize --head, paths made absolute), then those
    that ship for the target (smollm2-135m's, by its alias)."""
    given = [str(Path(h).resolve()) if Path(h).exists() else h for h in s.get("heads") or []]
    return given + [h for h in packaged_heads(s["target"]) if h not in given]


def after_profiler(state: dict) -> str:
    return "report" if state.get("stop_reason") else "router"


# -- router -------------------------------------------------------------------------------------------------------

def _hits(ctx, deployment: dict) -> tuple[list[dict], str | None]:
    try:
        return [h.to_dict() for h in ctx.memory.similar(deployment, k=10)], None
    except Exception as e:  # a memory that cannot be read costs the round its hints, not the run
        return [], f"memory lookup failed: {type(e).__name__}: {e}"


def _route_evidence(state: dict, decided: dict, hits: list[dict]) -> dict:
    gaps = [{"component": g["component"], "gain": g["gain"], "agent": agent_of(g), "reason": g.get("reason", "")}
            for g in state["gaps"][:TOP_GAPS_SHOWN]]
    memory = []
    for h in hits[:3]:
        o = h["outcome"]
        verdict = "failed: " + str(o.get("failure")) if o.get("failure") else "worked"
        memory.append(f"{o['candidate'].get('agent')} {json.dumps(o['candidate'].get('recipe_patch'))} {verdict}")
    return {"gaps": gaps, "memory": memory, "agents": decided["agents"], "reason": decided["reason"],
            "who": decided["who"]}


def router(state: dict) -> dict:
    t0 = time.perf_counter()
    s, n = state["settings"], state["round"]
    out = Path(s["out_dir"])
    ctx = context_for(s)
    hits, memory_error = _hits(ctx, state["deployment"])

    def decide() -> dict:
        try:
            d, who, note = route(ctx, state["gaps"], hits, state["deployment"])
        except Exception as e:  # the provider is broken: the run stops with why, after what it has
            return {"agents": [], "reason": f"the provider failed: {type(e).__name__}: {e}",
                    "who": provider_name(ctx.provider), "note": ""}
        agents = [a for a in dict.fromkeys(d.agents) if a in AGENTS]
        dropped = [a for a in d.agents if a not in AGENTS]
        note = note + (f"; dropped unknown agent(s) {', '.join(map(str, dropped))}" if dropped else "")
        return {"agents": agents, "reason": d.reason, "who": who, "note": note.strip("; ")}

    emit(f"round {n}: routing")
    decided = cached_json(round_dir(out, n) / "route.json", decide)
    trail = [decision(n, "router", decided["who"], "agents: " + (", ".join(decided["agents"]) or "none"),
                      decided["reason"] + (f" ({decided['note']})" if decided.get("note") else ""))]
    if memory_error:
        trail.append(decision(n, "router", "memory", "no memory hits", memory_error))
    agents, stop = decided["agents"], None
    if not agents:
        stop = f"router: {decided['reason']}"
    if s["interactive"]:
        answer = ask("route", n, _route_evidence(state, decided, hits))
        action, value = answer["action"], answer["value"]
        if action == "edit":
            wanted = value.get("agents") if isinstance(value, dict) else value
            if isinstance(wanted, list) and wanted and all(a in AGENTS for a in wanted):
                agents, stop = list(dict.fromkeys(wanted)), None
                why = value.get("reason", "") if isinstance(value, dict) else ""
                trail.append(decision(n, "router", "human", "edit: agents " + ", ".join(agents), why))
            else:
                trail.append(decision(n, "router", "human", "edit rejected, provider's choice kept",
                                      f"{value!r} is not a list of agents among {', '.join(AGENTS)}"))
        elif action == "redirect":
            agents, stop = [value], None
            trail.append(decision(n, "router", "human", f"redirect: {value} instead"))
        elif action == "skip":
            agents, stop = [], None
            trail.append(decision(n, "router", "human", "skip: no agent this round"))
        elif action == "stop":
            stop = "stopped by a person at the router"
            trail.append(decision(n, "router", "human", "stop"))
        elif action == "invalid":
            trail.append(decision(n, "router", "human", "answer not understood, provider's choice kept", value))
        else:
            trail.append(decision(n, "router", "human", "approve"))
    update = {"route": {"round": n, "agents": agents, "reason": decided["reason"], "who": decided["who"]},
              "memory_hits": hits, "trail": trail, "elapsed_s": time.perf_counter() - t0}
    return update | ({"stop_reason": stop} if stop else {})


def agent_task(state: dict, agent: str, pass_: int) -> dict:
    """What one agent node gets through Send: its context (AgentContext as a dict) and the run's settings."""
    s = state["settings"]
    ctx = AgentContext(agent=agent, deployment=state["deployment"], recipe=plain(state["best"]["recipe"]),
                       profile=state["profile"], gaps=[dict(g, agent=agent_of(g)) for g in state["gaps"]],
                       memory_hits=state.get("memory_hits", []), tried=list(state.get("tried", [])),
                       max_candidates=s["max_candidates"])
    return {"agent": agent, "round": state["round"], "pass": pass_, "settings": s, "context": asdict(ctx)}


def after_router(state: dict):
    if state.get("stop_reason"):
        return "report"
    agents = state["route"]["agents"]
    if not agents:
        return "remember"  # a person skipped this round's agents: on to the budget check and the next round
    return [Send(a, agent_task(state, a, 0)) for a in agents]


# -- the agents ---------------------------------------------------------------------------------------------------

def agent_node(agent: str):
    """The node of one agent: ask the provider for candidates, validate each (docs/AGENTS.md)."""

    def node(task: dict) -> dict:
        started = time.time()
        s, n, p = task["settings"], task["round"], task["pass"]
        out = Path(s["out_dir"])
        ctx = context_for(s)
        agent_ctx = AgentContext(**task["context"])

        def ask_provider() -> dict:
            try:
                found, who, note, kept_out = propose(ctx, agent_ctx)
            except Exception as e:  # a provider that raises proposes nothing this time; the round goes on
                return {"who": provider_name(ctx.provider), "note": f"the provider failed: {type(e).__name__}: {e}",
                        "candidates": []}
            return {"who": who, "note": note, "candidates": [c.to_dict() if hasattr(c, "to_dict") else c
                                                             for c in found], "memory_skipped": kept_out}

        emit(f"round {n}: {agent} proposing")
        proposal = cached_json(round_dir(out, n) / f"proposals-{agent}-{p}.json", ask_provider)
        who = proposal["who"]
        why = proposal["note"]
        if not proposal["candidates"] and not why:  # a provider that says nothing still leaves a why in the trail
            why = f"the {who} provider returned no candidates and gave no reason"
        trail = [decision(n, agent, who, f"proposed {len(proposal['candidates'])} candidate(s)", why)]
        # what memory kept out (it failed on a similar deployment): one entry each, for history and the report
        for skipped in proposal.get("memory_skipped", []):
            trail.append(decision(n, agent, "memory", f"{skipped['candidate']} not proposed: "
                                  f"{json.dumps(skipped['recipe_patch'], sort_keys=True)}", skipped["why"]))
        records, ids = {}, []
        tried = set(agent_ctx.tried)
        for i, raw in enumerate(proposal["candidates"]):
            rec = record(raw, agent, who, agent_ctx.recipe, out, n, p, i, who)
            if rec["id"] in tried or rec["id"] in ids:
                trail.append(decision(n, agent, "graph", f"{rec['id']} not evaluated again",
                                      "already proposed in this run"))
                continue
            ids.append(rec["id"])
            records[rec["id"]] = rec
            if rec["status"] == "invalid":
                trail.append(decision(n, agent, "graph", f"{rec['id']} invalid", rec["error"]))
            else:
                trail.append(decision(n, agent, who, f"{rec['id']} proposed", rec["reason"]))
        return {"candidates": records, "tried": ids, "trail": trail, "agent_span": [started, time.time()]}

    node.__name__ = agent
    return node


# -- review: a person looks at each valid candidate before it is evaluated ----------------------------------------

def this_round(state: dict, *statuses: str) -> list[dict]:
    """This round's candidates in the order they are evaluated: first the changes that won on a similar deployment
    (memory's, the largest remembered speedup first: a warm start), then each agent's first, each one's second, ...,
    the agents in the router's order (largest gap first). A budget that runs out mid-round so leaves out the least
    promising candidates of every agent rather than one agent's whole list (the H200's code run of 2026-12-02
    evaluated two attention kernels and two draft lengths and ran out before the scheduler's first proposal; its
    warm-started chat run evaluated the smallest remembered win first and ran out before the largest)."""
    recs = [r for r in state.get("candidates", {}).values()
            if r["round"] == state["round"] and (not statuses or r["status"] in statuses)]
    routed = [a for a in (state.get("route") or {}).get("agents", []) if a in AGENTS]
    rank = {a: i for i, a in enumerate(routed + [a for a in AGENTS if a not in routed])}

    def prior(r: dict) -> float:
        return float((r.get("candidate") or {}).get("prior") or 0.0)

    return sorted(recs, key=lambda r: (r["pass"], -prior(r), r["order"], rank.get(r["agent"], len(rank)), r["id"]))


def _candidate_evidence(rec: dict, best: dict) -> dict:
    cand = rec["candidate"]
    recipe = json.loads(Path(rec["recipe_path"]).read_text())
    diff = [f"{path}: {a!r} -> {b!r}" for path, (a, b) in changes(best["recipe"], recipe).items()]
    ev = {"id": rec["id"], "agent": rec["agent"], "origin": rec["origin"], "reason": rec["reason"],
          "recipe_patch": cand.get("recipe_patch"), "changes": diff, "kernel": None}
    if cand.get("kernel"):
        ev["kernel"] = {"slot": cand["kernel"]["slot"], "head": cand["kernel"]["source"].splitlines()[:12]}
    return ev


def review(state: dict) -> dict:
    t0 = time.perf_counter()
    s, n = state["settings"], state["round"]
    span = state.get("agent_span")
    update: dict = {"agent_span": None, "redirects": [], "elapsed_s": (span[1] - span[0]) if span else 0.0}
    if not s["interactive"]:
        return update
    out = Path(s["out_dir"])
    records, trail, redirects, stop = {}, [], [], None
    for rec in this_round(state, "proposed"):
        cid = rec["id"]
        if stop:
            records[cid] = {"status": "stopped", "error": stop}
            continue
        answer = ask("candidate", n, _candidate_evidence(rec, state["best"]))
        action, value = answer["action"], answer["value"]
        if action == "approve":
            records[cid] = {"status": "approved"}
            trail.append(decision(n, "review", "human", f"approve {cid}"))
        elif action == "skip":
            records[cid] = {"status": "skipped", "error": "skipped by a person"}
            trail.append(decision(n, "review", "human", f"skip {cid}"))
        elif action == "redirect":
            records[cid] = {"status": "redirected", "error": f"a person sent it to the {value} agent"}
            redirects.append(value)
            trail.append(decision(n, "review", "human", f"redirect {cid} to {value}"))
        elif action == "stop":
            stop = f"stopped by a person at candidate {cid}"
            records[cid] = {"status": "stopped", "error": stop}
            trail.append(decision(n, "review", "human", "stop"))
        elif action == "edit":
            edited = record({"agent": rec["agent"], **value} if isinstance(value, dict) else value, rec["agent"],
                            "human", plain(state["best"]["recipe"]), out, n, rec["pass"], rec["order"], "human")
            records[cid] = {"status": "replaced", "error": f"replaced by a person's edit {edited['id']}"}
            if edited["id"] in state.get("tried", []) or edited["id"] in records:
                trail.append(decision(n, "review", "human", f"edit {cid} -> {edited['id']}",
                                      "the edit is a candidate proposed before: not evaluated again"))
                continue
            if edited["status"] == "proposed":
                edited["status"] = "approved"
            records[edited["id"]] = edited
            update.setdefault("tried", []).append(edited["id"])
            trail.append(decision(n, "review", "human", f"edit {cid} -> {edited['id']}",
                                  edited["error"] or edited["reason"]))
        else:
            records[cid] = {"status": "skipped", "error": f"answer not understood: {value}"}
            trail.append(decision(n, "review", "human", f"skip {cid} (answer not understood)", value))
    update |= {"candidates": records, "trail": trail, "redirects": list(dict.fromkeys(redirects)),
               "elapsed_s": update["elapsed_s"] + time.perf_counter() - t0}
    if redirects and not stop:
        update["agent_pass"] = state.get("agent_pass", 0) + 1
    return update | ({"stop_reason": stop} if stop else {})


def after_review(state: dict):
    if state.get("stop_reason"):
        return "remember"
    if state.get("redirects"):
        return [Send(a, agent_task(state, a, state["agent_pass"])) for a in state["redirects"]]
    return "evaluate"


# -- remember: every evaluated or rejected candidate becomes a memory outcome --------------------------------------

REMEMBERED = ("invalid", "skipped", "redirected", "replaced", "evaluated")


def outcome_for(state: dict, rec: dict, when: str) -> Outcome:
    ev = state.get("evaluations", {}).get(rec["id"]) or {}
    speed = ev.get("speed") or {}
    results = {k: speed[k] for k in ("speedup_vs_ar", "speedup_vs_stock", "tokens_per_s", "mean_accepted",
                                     "identical_to_ar", "p50_token_ms") if speed.get(k) is not None}
    if speed.get("speedup_vs_best") is not None:
        results["speedup"] = speed["speedup_vs_best"]  # over the recipe it changed (the best of its round)
    g = ev.get("gate") or {}
    gate_summary = {k: g[k] for k in ("passed", "reason", "epsilon", "tokens_checked", "salt") if k in g}
    failure = ev.get("failure") if rec["status"] == "evaluated" else rec.get("error")
    if rec["status"] == "invalid":
        failure = f"invalid: {rec.get('error')}"
    return Outcome(candidate=rec["candidate"], deployment=state["deployment"], results=results, gate=gate_summary,
                   failure=failure, versions=current_versions(), time=when, run=str(state["settings"]["out_dir"]),
                   extra={"round": rec["round"], "status": rec["status"], "kernel_check": ev.get("kernel"),
                          "timed_check": ev.get("timed"),
                          "proposed_by": rec.get("proposed_by")})


def best_outcome(state: dict, when: str) -> tuple[str, Outcome] | None:
    """The run's best so far as one change of its starting recipe (every field the rounds changed, in one patch), or
    None while the start is still the best. A warm start evaluates it first, whole: a similar deployment then reaches
    this run's best in one evaluation instead of replaying its rounds one change at a time (on the H200, a 3-minute
    warm start that got the changes one by one ran out of budget before the largest one, 2026-12-02)."""
    best, progression = state.get("best") or {}, state.get("progression") or []
    if not best or best.get("round", 0) == 0 or not progression:
        return None
    source = progression[0]["source"]
    start = load_recipe(source, state["settings"].get("target")) if source in ("ar", "stock") else None
    if start is None:
        return None
    patch: dict = {}
    for path, (_, new) in changes(asdict(start), plain(best["recipe"])).items():
        if path == "batch.max_batch_size":  # the pin to the batch size it passed the gate at, not a mechanism
            continue
        node, (*parents, last) = patch, path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = new
    if not patch:
        return None
    m, before = best["measured"], progression[0]
    agent = owner_of(patch)
    cand = {"id": f"best-{best['source']}", "agent": agent, "recipe_patch": patch, "kernel": None, "origin": "graph",
            "reason": f"this run's best (round {best['round']}, {best['source']}) as one change of "
                      f"{progression[0]['source']}: {m['tokens_per_s']:.0f} against {before['tokens_per_s']:.0f} "
                      f"tok/s"}
    results = {k: m[k] for k in ("speedup_vs_ar", "speedup_vs_stock", "tokens_per_s", "identical_to_ar",
                                 "p50_token_ms") if m.get(k) is not None}
    results["mean_accepted"] = m.get("tau")
    if before.get("tokens_per_s"):
        results["speedup"] = m["tokens_per_s"] / before["tokens_per_s"]  # over the recipe it changed: the start
    g = best.get("gate") or {}
    outcome = Outcome(candidate=cand, deployment=state["deployment"], results=results,
                      gate={k: g[k] for k in ("passed", "reason", "epsilon", "tokens_checked", "salt") if k in g},
                      failure=None, versions=current_versions(), time=when, run=str(state["settings"]["out_dir"]),
                      extra={"round": best["round"], "status": "best", "proposed_by": "graph"})
    return f"best-{best['source']}-r{best['round']}", outcome


def remember(state: dict) -> dict:
    t0 = time.perf_counter()
    s, n = state["settings"], state["round"]
    out = Path(s["out_dir"])
    ctx = context_for(s)
    done, trail = remembered(out), []
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    records = [(f"{rec['id']}-r{rec['round']}", rec["id"], lambda rec=rec: outcome_for(state, rec, when))
               for rec in this_round(state, *REMEMBERED)]
    whole = best_outcome(state, when)
    if whole is not None:
        records.append((whole[0], whole[1].candidate["id"], lambda: whole[1]))
    for key, cid, outcome in records:
        if key in done:
            continue
        try:
            rid = ctx.memory.record(outcome())
        except Exception as e:  # a memory that cannot be written must not cost the run what it measured
            trail.append(decision(n, "remember", "memory", f"{cid} not recorded", f"{type(e).__name__}: {e}"))
            continue
        mark_remembered(out, key, rid)
    update = {"trail": trail}
    if not state.get("stop_reason"):
        spent = budget_spent(state, time.perf_counter() - t0)
        if spent:
            update["stop_reason"] = spent
    write_json(round_dir(out, n) / "candidates.json", this_round(state))
    return update | {"elapsed_s": time.perf_counter() - t0}


def after_remember(state: dict) -> str:
    return "report" if state.get("stop_reason") else "profiler"
