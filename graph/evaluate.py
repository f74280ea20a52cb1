"""Evaluation and integration: the only way a candidate's claims become numbers, and numbers become the best recipe.

evaluate, one candidate at a time (measurements hold the device lock, measure.py):
  1. a kernel candidate's source goes through benchmark_kernel in the sandbox; a kernel that fails its slot's
     contract goes no further;
  2. the candidate's recipe goes through the token-forcing gate against the stock system (the run's salt), at the
     gate's batch size (the deployment's, capped by the recipe's); a recipe that fails it is never timed: its speed
     would be the speed of wrong answers;
  3. it is measured side by side with the current best (twice: the second copy measures the noise), ar and stock
     in one `specpilot bench` process.
  4. what was timed is checked (tools/gate/timed.py): the candidate's outputs of that measured run, judged by the
     stock model in this process with the gate's tie rule and epsilon; a timed output that is not the stock
     system's greedy decode beyond a tie rejects the candidate, whatever the gate said (a candidate honest only
     when it sees a checker gains nothing).
  5. a candidate that beats the current best by MIN_GAIN and by more than that noise goes through the gate again at
     every smaller batch size and on the long cases (a prefill past 256 tokens, a context past 8,192 as far as the
     model's positions allow: docs/GATE.md, "Coverage"), and wins only if it passes them all; an adopted recipe is
     pinned to the batch size it passed (batch.max_batch_size). (These checks come last because most candidates
     lose: on the H200 they took 13-19 s of an evaluation's 60, 2026-12-02.)
  Finished evaluations are cached in DIR/evaluations/ by candidate id + recipe hash, so a node that runs again skips
  them.

integrator: the winners' changes combined into one recipe (fastest first; a change to a field an earlier winner
already changed is left out), which is gated and measured again next to the best single winner; the faster of the
two becomes the best. `adopt` refuses anything whose gate did not pass: no provider, person or combination can make
an ungated recipe the best.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from ..engine.recipe import BUILTIN, RecipeError, parse
from .artifacts import (candidate_dir, evaluation_path, log_evaluation, read_json, recipe_key, round_dir,
                        write_json)
from .human import ask
from .measure import bench, device_turn, gate, kernel_check
from .nodes import gate_batch, this_round
from .progress import emit
from .proposals import FIELD_OWNERS, changes, leaves, plain, record
from .state import MIN_GAIN, budget_spent, decision


def best_system(best: dict) -> str:
    """The best recipe's system name in a bench: a built-in is measured under its own name anyway."""
    return best["path"] if best["path"] in BUILTIN else best["recipe"]["name"]


REPLICA = "best-replica"


def compare(settings: dict, recipe_path: str, name: str, best: dict, out_dir: Path,
            others: tuple[str, ...] = ()) -> tuple[dict, float]:
    """Side-by-side speed of one recipe against the current best, ar and stock (and `others`), one process.

    The best is measured twice, the second time as a copy named `best-replica`: two measurements of one recipe
    differ only by noise, and `noise` = |replica / best - 1| is the smallest difference this measurement can tell
    apart from it."""
    replica = write_json(Path(out_dir) / f"{REPLICA}.json", plain(best["recipe"]) | {"name": REPLICA})
    files = [recipe_path, *others, str(replica)] + ([] if best["path"] in BUILTIN else [best["path"]])
    b, sec = bench(settings, files, out_dir)
    if not b["ok"] or name not in b["systems"]:
        why = b["error"] or "; ".join(e["message"] for e in b["errors"] if e.get("system") in (name, None)) \
            or "no measurement"
        return {"ok": False, "error": why, "dir": b["dir"]}, sec
    run, ref, rep = (b["systems"][name], b["systems"].get(best_system(best)), b["systems"].get(REPLICA))
    noise = abs(rep["tokens_per_s"] / ref["tokens_per_s"] - 1) if ref and rep and ref["tokens_per_s"] else None
    speed = {"ok": True, "error": None, "dir": b["dir"], "tokens_per_s": run["tokens_per_s"],
             "speedup_vs_ar": run["speedup_vs_ar"], "speedup_vs_stock": run["speedup_vs_stock"],
             "mean_accepted": run["mean_accepted"], "identical_to_ar": run["identical_to_ar"],
             "p50_token_ms": run["p50_token_ms"], "best_tokens_per_s": ref["tokens_per_s"] if ref else None,
             "speedup_vs_best": run["tokens_per_s"] / ref["tokens_per_s"] if ref and ref["tokens_per_s"] else None,
             "noise": noise, "systems": b["systems"]}
    return speed, sec


def timed_outputs(bench_dir: str | Path, system: str) -> list | None:
    """The outputs `system` produced in the measured run of a bench (results.json: per run, `outputs` =
    [{prompt, tokens, finish}] in request order), or None when the bench did not record them."""
    from ..tools.gate.timed import TimedOutput

    try:
        runs = json.loads((Path(bench_dir) / "results.json").read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    outs, found = [], False
    for run in runs:
        if run.get("system") != system:
            continue
        recorded = run.get("outputs")
        if not isinstance(recorded, list):
            return None
        found = True
        for o in recorded:
            try:
                outs.append(TimedOutput(len(outs), [int(t) for t in o["prompt"]], [int(t) for t in o["tokens"]],
                                        o.get("finish")))
            except (KeyError, TypeError, ValueError):
                return None
    return outs if found else None


def check_timed_run(settings: dict, speed: dict, name: str, gate_result: dict) -> tuple[dict, float]:
    """Was what the bench timed the stock system's greedy output (up to ties within the gate's epsilon)?
    {"passed", "reason", "how", ...}. With the outputs recorded, each is judged by the stock model here
    (tools/gate/timed.py). Without them (a bench that records only `identical_to_ar`), anything but outputs
    identical to ar's is rejected: no tie can be told apart from a wrong token without the tokens."""
    from ..tools.gate.timed import check_timed

    t0 = time.perf_counter()
    outputs = timed_outputs(speed["dir"], name)
    if outputs is None:
        same = speed.get("identical_to_ar")
        if same is None or same < 1.0:
            shown = "no comparison with ar" if same is None else f"{1 - same:.0%} of requests differ from ar's"
            return ({"passed": False, "how": "identical_to_ar", "reason": f"timed run of {name}: {shown} (the bench "
                     f"recorded no tokens, so no tie check: rejected)"}, time.perf_counter() - t0)
        return ({"passed": True, "how": "identical_to_ar", "reason": None}, time.perf_counter() - t0)
    epsilon = gate_result.get("epsilon")
    if epsilon is None:
        return ({"passed": False, "how": "tokens", "reason": "timed run: the gate gave no epsilon to judge ties "
                 "with"}, time.perf_counter() - t0)
    with device_turn(settings):
        v = check_timed(settings["target"], outputs, float(epsilon), settings["max_new_tokens"], settings["device"],
                        settings["dtype"], system=name)
    return ({"passed": v.passed, "how": "tokens", "reason": v.reason, "requests_checked": v.requests_checked,
             "tokens_checked": v.tokens_checked, "ties": v.ties, "epsilon": v.epsilon, "failure": v.failure},
            time.perf_counter() - t0)


COVERAGE_BATCHES_MAX = 8  # above this gate batch size, the smaller sizes checked are 1..4 and the powers of two
# New tokens decoded on the long cases: every one of them already attends past the long thresholds, and an 8K-token
# context is what costs (minutes a candidate on a CPU), not how far past it the decode runs.
LONG_CASE_NEW_TOKENS = 16


def coverage_batches(gate_batch_size: int) -> list[int]:
    """The batch sizes below the gate's that are checked too: every one up to COVERAGE_BATCHES_MAX (rows finish at
    different times, so a deployment runs every smaller batch), beyond it 1..4 and the powers of two."""
    if gate_batch_size <= COVERAGE_BATCHES_MAX:
        return list(range(1, gate_batch_size))
    return sorted({b for b in (1, 2, 3, 4) if b < gate_batch_size}
                  | {1 << i for i in range(gate_batch_size.bit_length()) if (1 << i) < gate_batch_size})


def coverage_gate(settings: dict, recipe_path: str, out_dir: Path, gate_batch_size: int) -> tuple[dict, float]:
    """The gate again, at every smaller batch size (the workload's questions, the run's salt: the reference is the
    cached one) and on the long cases at the gate's batch size. {"passed", "reason", "checks": [...]}."""
    from ..tools.gate.check import check

    t0 = time.perf_counter()
    runs = [(f"batch-{b}", b, None) for b in coverage_batches(gate_batch_size)] + [("long", gate_batch_size, "long")]
    long_tokens = min(settings["max_new_tokens"], LONG_CASE_NEW_TOKENS)
    checks = []
    for label, b, coverage in runs:
        with device_turn(settings, flock=False):
            try:
                rep = check(settings["target"], recipe_path, settings["workload"], settings["limit"],
                            long_tokens if coverage else settings["max_new_tokens"], settings["device"],
                            settings["dtype"], Path(out_dir) / label,
                            salt=settings["salt"], batch_size=b, timeout_s=settings["gate_timeout_s"],
                            coverage=coverage)
                passed, reason = rep.passed, rep.reason
            except Exception as e:  # the check could not run for this recipe: not shown to be right
                passed, reason = False, f"the gate could not run: {type(e).__name__}: {e}"
        checks.append({"check": label, "batch_size": b, "passed": passed, "reason": reason})
        if not passed:
            what = "on the long cases (prefill > 256, context > 8,192 tokens)" if coverage else f"at batch size {b}"
            return ({"passed": False, "reason": f"{what}: {reason}", "checks": checks}, time.perf_counter() - t0)
    return {"passed": True, "reason": None, "checks": checks}, time.perf_counter() - t0


def needed_gain(speed: dict) -> float:
    """A win must beat the best by MIN_GAIN and by more than the noise its own measurement showed."""
    return max(MIN_GAIN, speed.get("noise") or 0.0)


def evaluate_recipe(settings: dict, recipe_path: str, cid: str, best: dict, kernel: dict | None) -> dict:
    """Kernel check (if any), gate, side-by-side speed: the evaluation result of one candidate recipe."""
    d = candidate_dir(Path(settings["out_dir"]), cid)
    recipe = read_json(recipe_path)
    # device_s and, per step, the seconds it held the device (phase_s: where an evaluation's time goes)
    res = {"id": cid, "kernel": None, "gate": None, "speed": None, "failure": None, "beats_best": False,
           "device_s": 0.0, "phase_s": {}}

    def spent(phase: str, sec: float) -> None:
        res["device_s"] += sec
        res["phase_s"][phase] = round(sec, 2)

    if kernel:
        emit(f"{cid}: kernel check ({kernel['slot']})")
        kc, sec = kernel_check(settings, kernel["slot"], kernel["source"], d / "kernel_check.json")
        spent("kernel_check", sec)
        res["kernel"] = {k: kc.get(k) for k in ("passed", "failure", "reason", "timing_reason")}
        res["kernel"]["speedup_vs_builtin"] = [t.get("speedup_vs_builtin") for t in kc.get("timing") or []]
        if not kc["passed"]:
            reason = (kc.get("reason") or "").splitlines()[0] if kc.get("reason") else ""
            res["failure"] = f"kernel check: {kc.get('failure')}: {reason}"
            return res
    emit(f"{cid}: token-forcing gate")
    g, sec = gate(settings, recipe_path, d / "gate", gate_batch(settings, recipe))
    spent("gate", sec)
    res["gate"] = g
    if not g["passed"]:
        res["failure"] = f"gate: {g['reason']}"
        return res
    emit(f"{cid}: measuring against the best, ar and stock")
    speed, sec = compare(settings, recipe_path, recipe["name"], best, d / "bench")
    spent("bench", sec)
    res["speed"] = speed
    if not speed["ok"]:
        res["failure"] = f"bench: {speed['error']}"
        return res
    emit(f"{cid}: checking the timed outputs against the reference")
    timed, sec = check_timed_run(settings, speed, recipe["name"], g)
    spent("timed_check", sec)
    res["timed"] = timed
    if not timed["passed"]:
        res["failure"] = timed["reason"]
        return res
    gain, need = speed["speedup_vs_best"], needed_gain(speed)
    if gain is None or gain < 1 + need:
        res["failure"] = (f"not faster: {gain:.3f}x the current best {best['source']} (a win needs >= "
                          f"{1 + need:.3f}x: {MIN_GAIN:.0%}, or the {speed['noise'] or 0:.1%} between two measurements "
                          f"of the best in this bench)" if gain is not None else "no measurement of the current best")
        return res
    emit(f"{cid}: token-forcing gate at smaller batch sizes and on long inputs")
    cov, sec = coverage_gate(settings, recipe_path, d / "gate-coverage", gate_batch(settings, recipe))
    spent("coverage_gate", sec)
    res["gate"] = g | {"coverage": cov["checks"]}
    if not cov["passed"]:
        res["gate"] |= {"passed": False, "reason": cov["reason"]}
        res["failure"] = f"gate: {cov['reason']}"
        return res
    res["beats_best"] = True
    return res


def cached_evaluation(settings: dict, key: str, compute) -> tuple[dict, bool]:
    """(result, was it cached): a finished evaluation is never done twice in a run."""
    out = Path(settings["out_dir"])
    path = evaluation_path(out, key)
    if path.is_file():
        try:
            return read_json(path), True
        except json.JSONDecodeError:
            pass
    log_evaluation(out, key, "start")
    result = compute()
    write_json(path, result | {"key": key})
    log_evaluation(out, key, "done")
    return result | {"key": key}, False


def evaluate(state: dict) -> dict:
    t0 = time.perf_counter()
    s, n, best = state["settings"], state["round"], state["best"]
    todo = this_round(state, "proposed", "approved")
    results, records, trail, device_s = {}, {}, [], 0.0
    for i, rec in enumerate(todo):
        cid = rec["id"]
        key = f"{cid}-{rec['recipe_key']}"
        if not evaluation_path(Path(s["out_dir"]), key).is_file():
            spent = budget_spent(state, time.perf_counter() - t0, device_s, count_rounds=False)
            if spent:
                records[cid] = {"status": "not_evaluated", "error": spent}
                trail.append(decision(n, "evaluate", "graph", f"{cid} not evaluated", spent))
                continue
        emit(f"round {n}: evaluating {i + 1}/{len(todo)}: {cid} ({rec['agent']})")
        res, _ = cached_evaluation(s, key, lambda: evaluate_recipe(s, rec["recipe_path"], cid, best,
                                                                    rec["candidate"].get("kernel")))
        # a cached result comes from a run that was killed before this node finished: its time was never counted
        device_s += res["device_s"]
        results[cid] = res | {"round": n}
        records[cid] = {"status": "evaluated"}
        verdict = "wins" if res["beats_best"] else "rejected"
        trail.append(decision(n, "evaluate", _judge(res), f"{cid} {verdict}", res["failure"] or _speed_text(res["speed"])))
    return {"evaluations": results, "candidates": records, "trail": trail, "device_s": device_s,
            "elapsed_s": time.perf_counter() - t0}


def _judge(res: dict) -> str:
    """Which check decided: the kernel check, the gate, the timed run's check, or the side-by-side measurement."""
    if res.get("kernel") and not res["kernel"]["passed"]:
        return "kernel_check"
    if res.get("gate") and not res["gate"]["passed"]:
        return "gate"
    if res.get("timed") and not res["timed"]["passed"]:
        return "timed_check"
    return "bench"


def _speed_text(speed: dict | None) -> str:
    if not speed or not speed.get("ok"):
        return ""
    return (f"{speed['speedup_vs_best']:.3f}x the best, {speed['speedup_vs_ar']:.2f}x ar, "
            f"{speed['speedup_vs_stock']:.2f}x stock")


# -- integration --------------------------------------------------------------------------------------------------

def adopt(settings: dict, recipe: dict, source: str, round_: int, gate_result: dict, speed: dict) -> dict:
    """The new best: written to DIR/recipes/best-r<round>.json under the name `best`. Only a recipe that passed
    the token-forcing gate gets here; anything else is a bug in the caller, and raising stops the run before a
    wrong recipe is written anywhere."""
    if not (gate_result and gate_result.get("passed") is True):
        raise RuntimeError(f"refusing to adopt {source}: it did not pass the token-forcing gate")
    path = Path(settings["out_dir"]) / "recipes" / f"best-r{round_}.json"
    measured = {"tokens_per_s": speed["tokens_per_s"], "speedup_vs_ar": speed["speedup_vs_ar"],
                "speedup_vs_stock": speed["speedup_vs_stock"], "tau": speed["mean_accepted"],
                "identical_to_ar": speed["identical_to_ar"], "p50_token_ms": speed["p50_token_ms"],
                "bench": speed["dir"]}  # the same fields as the starting point's (nodes.measured_from)
    body = plain(recipe) | {"name": "best"}
    passed_batch = gate_result.get("batch_size")
    if isinstance(passed_batch, int) and passed_batch >= 1:  # pinned to the batch sizes it passed (1..this one)
        batch = dict(body.get("batch") or {})
        batch["max_batch_size"] = min(batch.get("max_batch_size") or passed_batch, passed_batch)
        body["batch"] = batch
    write_json(path, body)
    return {"recipe": body, "path": str(path), "source": source, "round": round_, "gate": gate_result,
            "measured": measured}


def fused_fma_clash(settings: dict):
    """The rule `combine` leaves winners out by on this deployment: on CUDA, the fused layer runs a verify step of at
    most FMA_MAX_TOKENS tokens on its FMA path (a program per token) and a longer one on its tensor-core path, which
    cost the fused layer's k = 6 a third of its speed (H200 grid, 2026-12-02). A fused-layer winner measured on one
    side of that line says nothing about a combination on the other: the fused layer (5-token steps) with a k = 12
    draft passed the gate at 1.20x where the fused layer alone won 1.37x (2026-12-02), an evaluation spent on a
    combination the numbers already ruled out. Returns f(combined, winners' own recipes; all flat) -> why or None."""
    if not str(settings.get("device", "")).startswith("cuda"):
        return lambda after, own: None
    from ..kernels.triton_fused_layer import FMA_MAX_TOKENS  # (lazily: it imports Triton)

    batch = int(settings.get("batch_size") or 1)

    def step_tokens(flat: dict) -> int | None:
        """Tokens of a fused chain step at the deployment's batch, or None (not fused, a tree, no drafter)."""
        if flat.get("layer") != "fused" or flat.get("verification", "chain") != "chain" or not flat.get("k"):
            return None
        return (int(flat["k"]) + 1) * batch

    def why(after: dict, own: list[dict]) -> str | None:
        tokens = step_tokens(after)
        if tokens is None:
            return None
        for recipe in own:
            measured = step_tokens(recipe)
            if measured is not None and (measured <= FMA_MAX_TOKENS) != (tokens <= FMA_MAX_TOKENS):
                return (f"with the fused layer, k = {after['k']} makes a {tokens}-token verify step, on the other side "
                        f"of its FMA path's {FMA_MAX_TOKENS} tokens than the {measured}-token step the fused layer "
                        f"won with")
        return None

    return why


def combine(best_recipe: dict, winners: list[dict], recipes: dict[str, dict],
            clash=lambda after, own: None) -> tuple[dict | None, list[str], list[str]]:
    """The best recipe with every winner's changes (fastest first); a change to a field an earlier winner already
    changed is left out, and so is one that `clash(combined, winners' own recipes)` (flat recipes) says does not
    compose with what is merged so far. (recipe, ids used, why each other winner was left out); the recipe is None
    when the result is not a valid recipe."""
    merged, taken, used, left = leaves(plain(best_recipe)), set(), [], []
    for w in winners:
        diff = changes(best_recipe, recipes[w["id"]])
        if taken & set(diff):
            left.append(f"{w['id']}: changes {', '.join(sorted(taken & set(diff)))}, as a faster winner does")
            continue
        after = merged | {path: new for path, (_, new) in diff.items()}
        why = clash(after, [leaves(plain(recipes[i])) for i in [*used, w["id"]]])
        if why:
            left.append(f"{w['id']}: {why}")
            continue
        merged = after
        taken |= set(diff)
        used.append(w["id"])
    nested: dict = {}
    for path, value in merged.items():
        node = nested
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    try:
        return asdict(parse(nested | {"name": "combo", "description": "+".join(used)})), used, left
    except RecipeError:
        return None, used, left


def _integrate(state: dict, winners: list[dict]) -> tuple[dict | None, dict]:
    """(the proposed new best as {recipe, source, gate, speed} or None, evidence for the person and the report)."""
    s, n, best = state["settings"], state["round"], state["best"]
    cands = state["candidates"]
    recipes = {w["id"]: read_json(cands[w["id"]]["recipe_path"]) for w in winners}
    top = winners[0]
    top_pick = {"recipe": recipes[top["id"]], "source": top["id"], "gate": top["gate"], "speed": top["speed"]}
    evidence = {"best": f"{best['source']} ({best['measured']['speedup_vs_ar']:.2f}x ar)",
                "winners": [f"{w['id']} ({cands[w['id']]['agent']}): {_speed_text(w['speed'])}" for w in winners],
                "combination": None}
    if len(winners) == 1:
        return top_pick, evidence
    combo, used, left = combine(best["recipe"], winners, recipes, fused_fma_clash(s))
    if combo is None or len(used) < 2:
        evidence["combination"] = ("none: " + ("; ".join(left) if left and combo is not None else
                                              "the winners change the same fields, or together are not a valid recipe"))
        return top_pick, evidence
    key = recipe_key(combo)
    combo["name"] = f"combo-{key}"
    out = Path(s["out_dir"])
    path = write_json(round_dir(out, n) / f"combo-{key}.json", combo)
    emit(f"round {n}: evaluating the combination of {', '.join(used)}")

    def faster(res: dict) -> bool:
        """Measured faster than the best single winner and than the best by the needed gain, output checked."""
        speed = res["speed"]
        return bool(speed and speed["ok"] and (res.get("timed") or {}).get("passed") and res.get("top_tokens_per_s")
                    and speed["tokens_per_s"] > res["top_tokens_per_s"]
                    and speed["speedup_vs_best"] >= 1 + needed_gain(speed))

    def compute() -> dict:
        d = round_dir(out, n) / f"combo-{key}"
        g, sec = gate(s, str(path), d / "gate", gate_batch(s, combo))
        res = {"gate": g, "speed": None, "device_s": sec, "used": used}
        if not g["passed"]:
            return res
        # measured next to the best single winner, so the two are compared in one process
        speed, sec = compare(s, str(path), combo["name"], best, d / "bench", (cands[top["id"]]["recipe_path"],))
        res["speed"], res["device_s"] = speed, res["device_s"] + sec
        top_run = (speed.get("systems") or {}).get(recipes[top["id"]]["name"])
        res["top_tokens_per_s"] = top_run["tokens_per_s"] if top_run else None
        if speed["ok"]:  # what was timed must be the stock system's output, as for a single candidate
            timed, sec = check_timed_run(s, speed, combo["name"], g)
            res["timed"], res["device_s"] = timed, res["device_s"] + sec
        if faster(res):  # the coverage checks, as for a single candidate: only for a combination that would win
            cov, sec = coverage_gate(s, str(path), d / "gate-coverage", gate_batch(s, combo))
            res["gate"] = g | {"coverage": cov["checks"]} | ({} if cov["passed"] else {"passed": False,
                                                                                      "reason": cov["reason"]})
            res["device_s"] += sec
        return res

    res, _ = cached_evaluation(s, f"combo-{key}", compute)
    evidence["combination"] = (f"{'+'.join(used)}: gate {'passed' if res['gate']['passed'] else 'failed'}"
                               + (f", {_speed_text(res['speed'])}" if res["speed"] and res["speed"]["ok"] else ""))
    evidence["combination_device_s"] = res["device_s"]
    if res["gate"]["passed"] and "coverage" in res["gate"] and faster(res):
        return {"recipe": combo, "source": "+".join(used), "gate": res["gate"], "speed": res["speed"]}, evidence
    return top_pick, evidence


def _human_edit(state: dict, value) -> tuple[dict | None, dict, dict | None]:
    """A person's recipe patch at integration, validated and evaluated like any candidate (the same gate):
    (the pick or None, its candidate record, its evaluation or None)."""
    s, n, best = state["settings"], state["round"], state["best"]
    patch = value if isinstance(value, dict) else {}
    owner = next((FIELD_OWNERS[k] for k in patch if k in FIELD_OWNERS), "scheduler")
    rec = record({"agent": owner, "reason": "a person's edit at integration", "recipe_patch": value}, owner, "human",
                 plain(best["recipe"]), Path(s["out_dir"]), n, 99, 0, "human")
    if rec["status"] == "invalid":
        return None, rec, None
    res, _ = cached_evaluation(s, f"{rec['id']}-{rec['recipe_key']}",
                               lambda: evaluate_recipe(s, rec["recipe_path"], rec["id"], best, None))
    res = res | {"round": n}
    rec["status"] = "evaluated"
    if not res["beats_best"]:
        return None, rec, res
    return ({"recipe": read_json(rec["recipe_path"]), "source": f"human:{rec['id']}", "gate": res["gate"],
             "speed": res["speed"]}, rec, res)


def integrator(state: dict) -> dict:
    t0 = time.perf_counter()
    s, n, best = state["settings"], state["round"], state["best"]
    evaluations = state.get("evaluations", {})
    winners = sorted((evaluations[r["id"]] for r in this_round(state, "evaluated")
                      if evaluations.get(r["id"], {}).get("beats_best")),
                     key=lambda e: -e["speed"]["speedup_vs_best"])
    trail, device_s = [], 0.0
    if winners:
        pick, evidence = _integrate(state, winners)
        device_s += evidence.pop("combination_device_s", 0.0)
        why = f"{pick['source']}: {_speed_text(pick['speed'])}" + (
            f"; combination: {evidence['combination']}" if evidence["combination"] else "")
    else:
        pick, evidence = None, {"best": best["source"], "winners": [], "combination": None}
        why = f"no candidate passed the gate and beat {best['source']} by {MIN_GAIN:.0%} and the noise"
    evidence["proposal"] = why if pick else f"keep {best['source']} ({why})"
    stop, update = None, {}
    evaluated = bool(this_round(state, "evaluated"))
    if s["interactive"] and not evaluated:  # nothing was evaluated this round (all skipped): nothing to decide
        trail.append(decision(n, "integrator", "graph", f"no question: nothing evaluated, keep {best['source']}"))
    if s["interactive"] and evaluated:
        answer = ask("integration", n, evidence)
        action, value = answer["action"], answer["value"]
        if action == "skip":
            pick = None
            trail.append(decision(n, "integrator", "human", f"skip: keep {best['source']}"))
        elif action == "stop":
            pick, stop = None, "stopped by a person at integration"
            trail.append(decision(n, "integrator", "human", f"stop: keep {best['source']}"))
        elif action == "edit":
            pick, rec, res = _human_edit(state, value)
            update["candidates"], update["tried"] = {rec["id"]: rec}, [rec["id"]]
            if res is not None:
                device_s += res["device_s"]
                update["evaluations"] = {rec["id"]: res}
            note = rec["error"] if res is None else (res["failure"] or _speed_text(res["speed"]))
            trail.append(decision(n, "integrator", "human", f"edit {rec['id']}: "
                                  + ("adopted" if pick else "not adopted"), note))
        elif action == "invalid":
            pick = None
            trail.append(decision(n, "integrator", "human", f"answer not understood: keep {best['source']}", value))
        else:
            trail.append(decision(n, "integrator", "human", "approve"))
    update["trail"] = trail
    if pick:
        new = adopt(s, pick["recipe"], pick["source"], n, pick["gate"], pick["speed"])
        update["best"] = new
        trail.append(decision(n, "integrator", "graph", f"new best: {pick['source']}", why))
    else:
        trail.append(decision(n, "integrator", "graph", f"best stays {best['source']}", why))
    current = update.get("best", best)
    update["progression"] = [{"round": n, "source": current["source"],
                              "speedup_vs_ar": current["measured"]["speedup_vs_ar"],
                              "speedup_vs_stock": current["measured"]["speedup_vs_stock"],
                              "tokens_per_s": current["measured"]["tokens_per_s"]}]
    write_json(round_dir(Path(s["out_dir"]), n) / "integration.json", evidence | {"adopted": bool(pick)})
    return update | {"device_s": device_s, "elapsed_s": time.perf_counter() - t0} | (
        {"stop_reason": stop} if stop else {})
