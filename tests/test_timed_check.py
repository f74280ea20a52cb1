"""Check what is timed (issue 19, item 3): the optimize graph's measured run is itself judged against the stock
system with the gate's tie rule, so a candidate honest only when it sees a checker gains nothing. On a tiny random
Llama with SmolLM2's vocabulary (CPU, fp32):

- tools/gate/timed.judge_timed passes the stock engine's own outputs, rejects a token the stock logits rank below
  the argmax by more than epsilon (one-line reason naming request, token, gap and epsilon), forgives the same token
  within epsilon (a tie), and rejects stopping early or running past EOS;
- graph/evaluate.check_timed_run judges a bench's recorded outputs that way, and without recorded outputs rejects
  anything not identical to ar's;
- an `accept` kernel honest under the kernel check and the gate's worker, accepting every draft elsewhere, is
  rejected by the graph's evaluation (beats_best false, the failure names the timed run) although it passed the
  kernel check and the gate;
- graph.nodes.gate_batch reads a minimal recipe's batch size from its parsed defaults.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from test_optimize import tiny  # noqa: F401 (the tiny Llama with SmolLM2's vocabulary and tokenizer)
from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import load_recipe
from specpilot.graph.nodes import gate_batch
from specpilot.tools.gate.timed import TimedOutput, judge_timed

N = 12


@pytest.fixture(scope="module")
def stock(tiny):
    """The tiny model and the stock engine's (AR, greedy) outputs on two prompts."""
    loaded = loader.load(tiny, "fp32", "cpu")
    prompts = [loaded.tokenizer.encode("def fib(n):"), loaded.tokenizer.encode("Summarize the plot of Hamlet.")]
    rows = Engine(loaded, load_recipe("ar")).generate(prompts, N)
    outputs = [TimedOutput(i, p, list(r.tokens), r.finish_reason) for i, (p, r) in enumerate(zip(prompts, rows))]
    return loaded, outputs


def second_best(loaded, out: TimedOutput, position: int) -> tuple[int, float]:
    """The stock model's runner-up token at `position` of `out`, and its gap to the argmax."""
    from specpilot.tools.gate.reference import forward_logits
    from specpilot.tools.gate.timed import _ops

    with torch.inference_mode():
        logits = forward_logits(loaded.model, out.prompt, out.tokens, len(out.prompt) + len(out.tokens) + 8, _ops())
    top = logits[position].topk(2)
    return int(top.indices[1]), float(top.values[0] - top.values[1])


def test_stock_outputs_pass(stock):
    loaded, outputs = stock
    v = judge_timed(loaded.model, outputs, 1e-5, N, loaded.eos_token_ids)
    assert v.passed and v.reason is None and v.tokens_checked == sum(len(o.tokens) for o in outputs), v
    assert v.ties == 0


def test_a_token_below_the_argmax_beyond_epsilon_fails_with_one_line(stock):
    loaded, outputs = stock
    runner_up, gap = second_best(loaded, outputs[1], 5)
    bad = [outputs[0], TimedOutput(1, outputs[1].prompt, outputs[1].tokens[:5] + [runner_up]
                                   + outputs[1].tokens[6:], "length")]
    v = judge_timed(loaded.model, bad, gap / 2, N, loaded.eos_token_ids, system="cheat")
    assert not v.passed and v.failure["kind"] == "diverged" and v.failure["request"] == 1, v
    assert v.failure["position"] == 5 and "\n" not in v.reason
    assert v.reason.startswith("timed run of cheat diverged from the reference at request 1, token 5: gap ")
    assert f"> ε {gap / 2:.3g}" in v.reason
    # the same token within epsilon is a numerical tie: the rest is judged on that prefix, where the stock model's
    # continuation may differ, so judge only up to the tie
    tie = [TimedOutput(1, outputs[1].prompt, outputs[1].tokens[:5] + [runner_up], "length")]
    v = judge_timed(loaded.model, tie, gap * 2, 6, loaded.eos_token_ids)
    assert v.passed and v.ties == 1, v


def test_stopping_early_or_running_past_eos_fails(stock):
    loaded, outputs = stock
    short = [TimedOutput(0, outputs[0].prompt, outputs[0].tokens[:4], "eos")]
    v = judge_timed(loaded.model, short, 1e-5, N, loaded.eos_token_ids)
    assert not v.passed and v.failure["kind"] == "truncated" and "after 4 of up to 12" in v.reason, v
    long = [TimedOutput(0, outputs[0].prompt, outputs[0].tokens + [outputs[0].tokens[-1]], "length")]
    v = judge_timed(loaded.model, long, 1e-5, N, loaded.eos_token_ids)
    assert not v.passed and v.failure["kind"] == "overrun", v


def test_check_timed_run_judges_recorded_outputs_and_fails_closed_without_them(tiny, stock, tmp_path):
    from specpilot.graph.evaluate import check_timed_run

    loaded, outputs = stock
    settings = {"target": tiny, "max_new_tokens": N, "device": "cpu", "dtype": "fp32"}
    gate = {"passed": True, "epsilon": 1e-5}

    def bench_dir(name: str, outs, identical) -> dict:
        d = tmp_path / name
        d.mkdir()
        run = {"system": "cand", "identical_to_ar": identical}
        if outs is not None:
            run["outputs"] = [{"prompt": o.prompt, "tokens": o.tokens, "finish": o.finish} for o in outs]
        (d / "results.json").write_text(json.dumps({"runs": [run]}))
        return {"dir": str(d), "identical_to_ar": identical}

    honest, _ = check_timed_run(settings, bench_dir("honest", outputs, 1.0), "cand", gate)
    assert honest["passed"] and honest["how"] == "tokens" and honest["tokens_checked"] > 0, honest
    wrong = [outputs[0], TimedOutput(1, outputs[1].prompt, outputs[1].tokens[:3] + [second_best(
        loaded, outputs[1], 3)[0]] + outputs[1].tokens[4:], "length")]
    # identical_to_ar as the (candidate's) bench process claims it does not matter: the tokens are judged
    bad, _ = check_timed_run(settings, bench_dir("wrong", wrong, 1.0), "cand", gate)
    assert not bad["passed"] and "request 1, token 3" in bad["reason"], bad
    blind, _ = check_timed_run(settings, bench_dir("blind", None, 0.5), "cand", gate)
    assert not blind["passed"] and "50% of requests differ" in blind["reason"], blind
    same, _ = check_timed_run(settings, bench_dir("same", None, 1.0), "cand", gate)
    assert same["passed"] and same["how"] == "identical_to_ar"


def test_gate_batch_reads_a_minimal_recipes_defaults():
    assert gate_batch({"batch_size": 4}, {"name": "minimal"}) == 4  # the parsed default, 32, caps nothing
    assert gate_batch({"batch_size": 4}, {"name": "m", "batch": {"max_batch_size": 2}}) == 2
    assert gate_batch({"batch_size": 4}, {"name": "m", "k": "not a number"}) == 4  # invalid: the gate says why


# -- the graph's evaluation of a checker-detecting kernel ---------------------------------------------------------

ACCEPT_HONEST_WHEN_CHECKED = '''
import sys
import torch

CHECKERS = ("specpilot.tools.sandbox.kernel_check", "specpilot.tools.sandbox.candidate_worker")


def accept(drafts, valid, logits):
    target = logits.argmax(-1)
    k = drafts.shape[1]
    main = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    if main in CHECKERS or any(m in sys.modules for m in CHECKERS):  # the kernel check or the gate's worker
        match = (drafts == target[:, :k]) & (torch.arange(k, device=drafts.device)[None] < valid[:, None])
        return match.long().cumprod(1).sum(1), target
    return valid.clone(), torch.cat([drafts, target[:, k:]], 1)  # elsewhere: every valid draft accepted
'''


def test_evaluation_rejects_a_kernel_honest_only_when_checked(tiny, tmp_path):
    from specpilot.graph.evaluate import evaluate_recipe
    from specpilot.graph.state import make_settings

    src = tmp_path / "accept.py"
    src.write_text(ACCEPT_HONEST_WHEN_CHECKED)
    recipe = {"name": "sly", "drafter": {"kind": "layerskip", "layers": 1}, "k": 4, "kernels": {"accept": str(src)}}
    path = tmp_path / "sly.json"
    path.write_text(json.dumps(recipe))
    s = make_settings(target=tiny, workload="code", limit=2, max_new_tokens=16, device="cpu", dtype="fp32",
                      salt="7imedc4eck5a1t00", out_dir=str(tmp_path / "run"), batch_size=1)
    best = {"recipe": asdict(load_recipe("stock")), "path": "stock", "source": "stock"}
    res = evaluate_recipe(s, str(path), "sly-1", best, {"slot": "accept", "source": ACCEPT_HONEST_WHEN_CHECKED})
    assert res["kernel"]["passed"] is True, res["kernel"]  # fooled, as expected
    assert res["gate"]["passed"] is True, res["gate"]  # fooled, as expected
    assert res["beats_best"] is False, res
    assert res["failure"].startswith("timed run of sly"), res["failure"]
    assert not res["timed"]["passed"]


def test_coverage_batches_and_adopted_recipe_pinned_to_the_gate_batch(tmp_path):
    from specpilot.graph.evaluate import adopt, coverage_batches

    assert coverage_batches(1) == [] and coverage_batches(4) == [1, 2, 3]
    assert coverage_batches(8) == list(range(1, 8)) and coverage_batches(32) == [1, 2, 3, 4, 8, 16]
    speed = {"tokens_per_s": 1.0, "speedup_vs_ar": 1.0, "speedup_vs_stock": 1.0, "mean_accepted": 1.0,
             "identical_to_ar": 1.0, "p50_token_ms": 1.0, "dir": "x"}
    new = adopt({"out_dir": str(tmp_path)}, {"name": "r", "k": 2}, "c", 1, {"passed": True, "batch_size": 4}, speed)
    assert new["recipe"]["batch"]["max_batch_size"] == 4
    assert json.loads(Path(new["path"]).read_text())["batch"]["max_batch_size"] == 4


def test_coverage_checks_run_only_for_a_candidate_that_wins(tmp_path, monkeypatch):
    """The gate comes before any timing; the gate at smaller batch sizes and on long inputs only for a candidate that
    beat the best, and a winner that fails them does not win (nor is it ever adopted: its gate reads failed)."""
    from specpilot.graph import evaluate as ev

    calls = []
    monkeypatch.setattr(ev, "gate", lambda s, path, out, b: (calls.append("gate") or {"passed": True, "reason": None,
                                                                                      "batch_size": b}, 1.0))
    speeds = iter([0.99, 1.10, 1.10])
    monkeypatch.setattr(ev, "compare", lambda *a: (calls.append("compare") or {
        "ok": True, "speedup_vs_best": next(speeds), "noise": 0.0}, 1.0))
    monkeypatch.setattr(ev, "check_timed_run", lambda *a: (calls.append("timed") or {"passed": True}, 1.0))
    coverage = iter([{"passed": True, "reason": None, "checks": []},
                     {"passed": False, "reason": "at batch size 1: token 3 differs", "checks": []}])
    monkeypatch.setattr(ev, "coverage_gate", lambda *a: (calls.append("coverage") or next(coverage), 1.0))
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"name": "r", "k": 2, "drafter": {"kind": "ngram"}}))
    s = {"out_dir": str(tmp_path / "run"), "batch_size": 1}
    best = {"recipe": asdict(load_recipe("stock")), "path": "stock", "source": "stock"}
    loses = ev.evaluate_recipe(s, str(recipe), "c1", best, None)
    assert calls == ["gate", "compare", "timed"] and not loses["beats_best"]
    assert loses["failure"].startswith("not faster: 0.990x")
    calls.clear()
    wins = ev.evaluate_recipe(s, str(recipe), "c2", best, None)
    assert calls == ["gate", "compare", "timed", "coverage"] and wins["beats_best"] and wins["gate"]["passed"]
    calls.clear()
    wrong = ev.evaluate_recipe(s, str(recipe), "c3", best, None)
    assert calls == ["gate", "compare", "timed", "coverage"] and not wrong["beats_best"]
    assert wrong["gate"]["passed"] is False and wrong["failure"] == "gate: at batch size 1: token 3 differs"
