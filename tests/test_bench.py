"""`specpilot bench`: results.json validates against its schema and is self-consistent; bad input fails clearly.

Two real runs through the CLI: a tiny random Llama with SmolLM2's vocabulary and tokenizer (every system including
the HF baselines, a multi-turn workload), and SmolLM2-135M itself (ar and stock). CPU timings here are noise; only
the arithmetic between the reported numbers is checked, never a speed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import tiny_smol_vocab_dir
from specpilot import cli
from specpilot.engine.errors import SpecPilotError
from specpilot.engine.workloads import Question
from specpilot.tools.bench.metrics import accepted_histogram, token_latencies
from specpilot.tools.bench.prompt_requests import build_requests, conversation, encode_conversation
from specpilot.tools.bench.report import PLOTS

SCHEMA = json.loads((Path(cli.__file__).parent / "tools" / "bench" / "schema.json").read_text())


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2):
    return smollm2[0].tokenizer


@pytest.fixture(scope="module")
def tiny_smol_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A random 2-layer Llama (hidden 64) with SmolLM2's vocabulary, saved with SmolLM2's tokenizer."""
    path = tiny_smol_vocab_dir(tmp_path_factory, "tiny-smol", 3, 64, 2, tied=False)
    smol_tokenizer.save_pretrained(path)
    return path


def bench(out: Path, *args: str) -> dict:
    assert cli.main(["bench", *args, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def check_consistent(results: dict) -> None:
    """Schema, and every derived number recomputed from the numbers it derives from."""
    jsonschema.validate(results, SCHEMA, cls=jsonschema.Draft202012Validator)
    runs = {(r["system"], r["workload"], r["batch_size"]): r for r in results["runs"]}
    for (system, workload, b), run in runs.items():
        assert run["tokens"] / run["seconds"] == pytest.approx(run["tokens_per_s"], rel=1e-9)
        ar = runs[("ar", workload, b)]
        assert run["speedup_vs_ar"] == pytest.approx(run["tokens_per_s"] / ar["tokens_per_s"], rel=1e-9)
        hist = run["accepted_histogram"]
        assert len(hist) == run["draft_tokens"] + 1
        if sum(hist):
            tau = sum((a + 1) * c for a, c in enumerate(hist)) / sum(hist)
            assert run["mean_accepted"] == pytest.approx(tau, rel=1e-9)
        assert sum(run["finish_reasons"].values()) == run["requests"]
        if run["live_rows_per_step"] is not None:  # our engine: at most the cell's rows, at least one
            assert 1 <= run["live_rows_per_step"] <= b
        budget = run["time_budget"]
        if budget is not None:  # our engine: its steps' time within the cell's wall time, the drain within them
            assert 0 < budget["steps_s"] <= run["seconds"]
            assert budget["drain_s"] <= budget["steps_s"] and budget["drain_steps"] >= 1
        else:
            assert run["live_rows_per_step"] is None  # only an HF baseline has neither
        assert run["p50_token_ms"] <= run["p99_token_ms"]
        assert run["ttft_ms"] <= run["p99_request_ms"]
        assert run["warmup_seconds"] > 0  # every measured system warmed up in its cell: at least one decode
    assert all(runs[("ar", w, b)]["identical_to_ar"] == 1.0 for _, w, b in runs)


@pytest.fixture(scope="module")
def tiny_run(tiny_smol_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-tiny")
    recipe = tmp / "ngram-k2.json"  # named like a built-in on purpose: the bench must rename it
    recipe.write_text(json.dumps({"name": "stock", "drafter": {"kind": "ngram"}, "k": 2}))
    out = tmp / "out"
    results = bench(out, "--target", str(tiny_smol_dir), "--workload", "chat,code", "--limit", "2",
                    "--batch-sizes", "1,2,3", "--max-new-tokens", "8", "--baselines", "hf",
                    "--recipe", str(recipe), "--recipe", "stock")
    return out, results


def test_tiny_bench_is_consistent(tiny_run):
    _, results = tiny_run
    check_consistent(results)
    systems = {r["system"] for r in results["runs"]}
    assert systems == {"ar", "stock", "stock-2", "hf-static", "hf-prompt-lookup"}
    chat = [r for r in results["runs"] if r["workload"] == "chat" and r["system"] == "ar"]
    assert all(r["requests"] == 4 for r in chat)  # two questions of two turns each


def test_tiny_bench_lossless_systems_match_ar(tiny_run):
    _, results = tiny_run
    for run in results["runs"]:
        if run["system"] in ("ar", "stock", "stock-2"):  # fp32 and greedy: speculation must not change a token
            assert run["identical_to_ar"] == 1.0, run


def test_tiny_bench_records_what_it_timed(tiny_run):
    _, results = tiny_run
    by_cell = {(r["system"], r["workload"], r["batch_size"]): r for r in results["runs"]}
    for (system, workload, batch), run in by_cell.items():
        outputs = run["outputs"]
        assert len(outputs) == run["requests"] and sum(len(o["tokens"]) for o in outputs) == run["tokens"]
        ar = by_cell[("ar", workload, batch)]["outputs"]
        assert [o["prompt"] for o in outputs] == [o["prompt"] for o in ar]  # the same requests, in order
        same = sum(o["tokens"] == a["tokens"] for o, a in zip(outputs, ar)) / len(outputs)
        assert same == run["identical_to_ar"]


def test_tiny_bench_records_each_engine_s_cache(tiny_run):
    """cache_slots: the static KV cache an engine run decoded in, long enough for every request it timed (prompt and
    answer), never shorter than in an earlier cell of the run (it only grows), and null for an HF baseline."""
    _, results = tiny_run
    seen: dict[str, int] = {}
    for run in results["runs"]:  # (in the cells' order)
        if run["system"].startswith("hf"):
            assert run["cache_slots"] is None
            continue
        assert run["cache_slots"] >= max(len(o["prompt"]) + len(o["tokens"]) for o in run["outputs"])
        assert run["cache_slots"] >= seen.get(run["system"], 0)
        seen[run["system"]] = run["cache_slots"]
    assert len(seen) == 3  # ar, stock and the recipe named like it (stock-2)


def test_tiny_bench_captures_nothing_while_timing(tiny_run):
    _, results = tiny_run
    engine_runs = [r for r in results["runs"] if not r["system"].startswith("hf-")]
    assert engine_runs and all(r["captures_while_timed"] == 0 for r in engine_runs), \
        [(r["system"], r["workload"], r["batch_size"], r["captures_while_timed"]) for r in engine_runs]


def test_tiny_bench_records_errors_and_goes_on(tiny_run):
    _, results = tiny_run
    cells = {(r["system"], r["workload"], r["batch_size"]) for r in results["runs"]}
    errors = {(e["system"], e["workload"], e["batch_size"]): e["message"] for e in results["errors"]}
    for workload in ("chat", "code"):
        assert ("hf-prompt-lookup", workload, 1) in cells
        assert ("hf-prompt-lookup", workload, 2) not in cells
        assert "batch size 1 only" in errors[("hf-prompt-lookup", workload, 2)]
    # code has 2 requests: at batch size 3 its first request comes again to fill one batch, and the runs say so;
    # chat (4 requests) runs at 3 as one timed call (continuous batching: the fourth request takes the first row to
    # finish; HF decodes a batch of 3 and a batch of 1), nothing repeated
    code3 = [r for r in results["runs"] if r["workload"] == "code" and r["batch_size"] == 3]
    assert {r["system"] for r in code3} == {"ar", "stock", "stock-2", "hf-static"}
    assert all(r["batches"] == 1 and r["requests"] == 3 and r["repeated_requests"] == 1 for r in code3)
    ar3 = next(r for r in code3 if r["system"] == "ar")
    assert ar3["outputs"][2] == ar3["outputs"][0]  # the repeated request decodes as it did the first time
    chat3 = [r for r in results["runs"] if r["workload"] == "chat" and r["batch_size"] == 3]
    assert {r["system"] for r in chat3} == {"ar", "stock", "stock-2", "hf-static"}
    assert all(r["batches"] == 1 and r["requests"] == 4 and r["repeated_requests"] == 0 for r in chat3)


def test_tiny_bench_writes_report_and_plots(tiny_run):
    out, results = tiny_run
    report = (out / "report.md").read_text()
    assert "## chat" in report and "## code" in report and "batch size 1 only" in report
    for name in PLOTS:
        assert (out / name).stat().st_size > 0
    head = results["header"]
    assert head["command"].startswith("specpilot bench --target")
    assert head["torch"] and head["transformers"] and head["device"] == "cpu"


def test_smollm2_bench(tmp_path):
    results = bench(tmp_path, "--workload", "code", "--limit", "2", "--batch-sizes", "1", "--max-new-tokens", "16")
    check_consistent(results)
    runs = {r["system"]: r for r in results["runs"]}
    assert set(runs) == {"ar", "stock"}
    assert runs["stock"]["mean_accepted"] >= 1.0
    assert runs["stock"]["identical_to_ar"] == 1.0
    # smollm2-135m's stock is the chain of its packaged EAGLE-3 head (engine/recipe.stock_recipe)
    assert results["header"]["recipes"]["stock"]["drafter"]["kind"] == "eagle3"


@pytest.mark.parametrize("broken", ["load", "decode"])
def test_failing_hf_baseline_costs_only_itself(tiny_smol_dir, tmp_path, monkeypatch, broken):
    from specpilot.tools.bench import run as bench_module
    from specpilot.tools.bench import hf_baselines

    def fail(*args, **kwargs):
        raise RuntimeError("no such kernel for this architecture")

    if broken == "load":
        monkeypatch.setattr(bench_module, "load_hf_model", fail)
    else:
        monkeypatch.setattr(hf_baselines.HFSystem, "decode", fail)
    results = bench(tmp_path, "--target", str(tiny_smol_dir), "--workload", "math", "--limit", "1",
                    "--max-new-tokens", "4", "--baselines", "hf")
    check_consistent(results)
    assert {r["system"] for r in results["runs"]} == {"ar", "stock"}
    failed = {e["system"] for e in results["errors"] if "no such kernel" in e["message"]}
    assert failed == {"hf-static", "hf-prompt-lookup"}
    if broken == "load":
        assert all("cannot run on this target" in e["message"] for e in results["errors"])


def test_turn_prompts_carry_the_first_answer(smol_tokenizer):
    questions = [Question("a", "chat", ("first question?", "follow-up?", "third?")), Question("b", "chat", ("only",))]
    asked = []

    def answer(prompts):
        asked.append(prompts)
        return [f"ANSWER-{len(asked)}-{i}" for i in range(len(prompts))]

    requests = build_requests(questions, smol_tokenizer, answer)
    assert [(r.question_id, r.turn) for r in requests] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert [len(p) for p in asked] == [1, 1]  # only turns that have a following turn are answered
    assert requests[0].prompt == encode_conversation(smol_tokenizer, [{"role": "user", "content": "first question?"}])
    second, third = (smol_tokenizer.decode(r.prompt) for r in requests[1:3])
    assert "ANSWER-1-0" in second and second.index("first question?") < second.index("ANSWER-1-0") < \
        second.index("follow-up?")
    assert "ANSWER-1-0" in third and "ANSWER-2-0" in third
    assert conversation(("x", "y"), ["ax"])[1] == {"role": "assistant", "content": "ax"}


def test_latency_and_acceptance_arithmetic():
    # two tokens from prefill at 1 s, one at 2 s, two sharing a step at 4 s: gaps 1, then 2 / 2 each
    assert token_latencies([1.0, 1.0, 2.0, 4.0, 4.0]) == [1.0, 1.0, 1.0]
    assert accepted_histogram([[0, 2, 2], [1]], 2) == [1, 1, 2]


def test_unknown_workload_fails_before_loading(capsys):
    code = cli.main(["bench", "--target", "/no/such/model", "--workload", "code,no-such-workload"])
    err = capsys.readouterr().err
    assert code != 0 and "specpilot: error:" in err and "no-such-workload" in err and "model" not in err


@pytest.mark.parametrize("lines, expected", [
    (['{"turns": ["fine"]}', '{"turns": ["broken"'], "line 2"),
    ([], "empty"),
])
def test_bad_workload_file_names_the_problem(tmp_path, capsys, lines, expected):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(lines))
    code = cli.main(["bench", "--target", "/no/such/model", "--workload", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code != 0 and expected in err and err.count("\n") == 1


def test_cell_requests_caps_each_cell(tiny_smol_dir, tmp_path):
    """--cell-requests 1: a B = 1 cell decodes one request, a B = 2 cell two; the results stay consistent."""
    results = bench(tmp_path / "out", "--target", str(tiny_smol_dir), "--workload", "code", "--limit", "3",
                    "--batch-sizes", "1,2", "--max-new-tokens", "4", "--cell-requests", "1")
    check_consistent(results)
    assert results["header"]["cell_requests"] == 1
    assert {(r["batch_size"], r["requests"]) for r in results["runs"]} == {(1, 1), (2, 2)}


def test_repeats_give_each_ratio_its_range_over_the_repeats(tiny_smol_dir, tmp_path, monkeypatch):
    """--repeats 3: every run keeps each repeat's tok/s (its reported tok/s that of the median repeat, ratios paired
    repeat by repeat); the report's and the experiments' tables give each ratio's lowest and highest in one repeat,
    which hold the cell's own ratio. One repeat: no range, and the tables say nothing of one."""
    import importlib.util

    from specpilot.tools.bench.report import speedup_range, workload_table

    spec = importlib.util.spec_from_file_location("harness", Path(__file__).parents[1] / "benchmarks" / "harness.py")
    harness = importlib.util.module_from_spec(spec)  # benchmarks/harness.py: the experiments' tables
    monkeypatch.setitem(sys.modules, "harness", harness)  # (its dataclasses look their module up there)
    spec.loader.exec_module(harness)

    recipe = tmp_path / "ngram.json"
    recipe.write_text(json.dumps({"name": "ngram-chain", "drafter": {"kind": "ngram"}, "k": 2}))
    args = ("--target", str(tiny_smol_dir), "--workload", "code", "--limit", "2", "--batch-sizes", "1,2",
            "--max-new-tokens", "4", "--recipe", str(recipe))
    results = bench(tmp_path / "three", *args, "--repeats", "3")
    check_consistent(results)
    cells = {}
    for run in results["runs"]:
        repeats = run["tokens_per_s_repeats"]
        assert len(repeats) == 3 and sorted(repeats)[1] == pytest.approx(run["tokens_per_s"], rel=1e-9)
        cells.setdefault(run["batch_size"], {})[run["system"]] = run
    for cell in cells.values():
        low, high = speedup_range(cell["ngram-chain"], cell["ar"])
        ratios = [a / b for a, b in zip(cell["ngram-chain"]["tokens_per_s_repeats"], cell["ar"]["tokens_per_s_repeats"])]
        assert (low, high) == (min(ratios), max(ratios)) and speedup_range(cell["ar"], cell["ar"]) is None
        assert harness.ratio_range(cell["ngram-chain"], cell["ar"]) == (low, high)
    text = harness.bench_table(results, "ar")
    assert "replica noise" in text and f"{low:.2f}-{high:.2f}" in text
    assert f"{low:.2f}-{high:.2f}x" in workload_table(results["runs"])
    once = bench(tmp_path / "one", *args)
    assert all(r["tokens_per_s_repeats"] is None for r in once["runs"])
    assert "replica noise" not in harness.bench_table(once, "ar")
    # a bench stopped before its first cell (its results.json: the header alone) says so, with its errors
    stopped = {"header": once["header"], "runs": [], "errors": [{"message": "boom"}]}
    assert harness.bench_table(stopped, "ar") == ("No cell finished (the bench stopped before its first: its step's "
                                                  "log says why).\n\nbench error: boom")


def test_engine_bench_side_by_side(tiny_smol_dir, tmp_path):
    """`tools/engine_bench` (the H200 benchmark of issue #2) on the CPU: every system decodes every prompt, the
    speculative and HF systems give the AR tokens, and the table's numbers are the rows' numbers (never a speed)."""
    import statistics

    from specpilot.tools.bench import engine_bench

    engine_bench.main(["--target", str(tiny_smol_dir), "--device", "cpu", "--max-new-tokens", "8", "--limit", "2",
                       "--workloads", "code", "--systems", "ar,ngram-k4", "--hf", "dynamic", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "engine_bench.json").read_text())
    rows = result["rows"]
    assert {(r["system"], r["prompt"]) for r in rows} == {(s, p) for s in ("ar", "ngram-k4", "hf-dynamic")
                                                          for p in (0, 1)}
    assert all(r["tokens"] == 8 and r["prompt_tokens"] > 0 for r in rows)
    assert all(r["prefill_s"] is None for r in rows if r["system"] == "hf-dynamic")
    assert all(0 < r["prefill_s"] < r["seconds"] for r in rows if r["system"] != "hf-dynamic")
    table = {t["system"]: t for t in result["table"]}
    assert table["ar"]["identical_to_ar"] == 1.0 and table["ngram-k4"]["identical_to_ar"] == 1.0
    assert table["hf-dynamic"]["identical_to_ar"] == 1.0  # HF's greedy tokens on the same weights
    for name, t in table.items():
        own = [r for r in rows if r["system"] == name]
        assert t["tokens_per_s"] == pytest.approx(statistics.median(r["tokens"] / r["seconds"] for r in own))
    assert table["ar"]["tau"] == 1.0 and table["ngram-k4"]["tau"] >= 1.0
    assert result["floor_s"] == pytest.approx(result["weight_bytes"] / result["copy_bandwidth"])


def test_engine_bench_without_our_ar(tiny_smol_dir, tmp_path, capsys):
    """Without the `ar` system (and without HF) the table is relative to the first system, and nothing is compared
    with AR tokens it did not decode."""
    from specpilot.tools.bench import engine_bench

    engine_bench.main(["--target", str(tiny_smol_dir), "--device", "cpu", "--max-new-tokens", "4", "--limit", "1",
                       "--workloads", "code", "--systems", "ngram-k4", "--hf", "", "--out", str(tmp_path)])
    [row] = json.loads((tmp_path / "engine_bench.json").read_text())["table"]
    assert row["system"] == "ngram-k4" and row["identical_to_ar"] is None
    assert "over ngram-k4's" in capsys.readouterr().out


def test_tiny_bench_counts_step_kinds(tiny_run):
    """Each engine run counts its steps by kind: ar only AR steps, stock (k = 4, no controller) only k = 4 steps, as
    many as its rows' longest verification count per batch; HF runs count none."""
    _, results = tiny_run
    for r in results["runs"]:
        kinds = r["step_kinds"]
        if r["system"].startswith("hf-"):
            assert kinds == {}
        elif r["system"] == "ar":
            assert set(kinds) == {"0"} and kinds["0"] > 0
        elif r["system"] == "stock":
            assert set(kinds) == {"4"} and kinds["4"] >= max(1, r["tokens"] // r["requests"] // 5)


def test_every_engine_bench_system_is_a_valid_recipe_named_as_listed():
    """engine_bench's systems (the experiments' --systems) parse as recipes, each dict named by its key; the n-gram
    tree is the policy's shape: 3 branches of 4 drafts."""
    from specpilot.engine.recipe import load_recipe, parse
    from specpilot.tools.bench.engine_bench import SYSTEMS

    for name, spec in SYSTEMS.items():
        recipe = load_recipe(spec) if isinstance(spec, str) else parse(spec)
        assert isinstance(spec, str) or recipe.name == name
    tree = parse(SYSTEMS["ngram2-tree3x4-fused-overlap"])
    assert tree.verification == "tree" and len(tree.tree.paths) == 12 and max(map(len, tree.tree.paths)) == 4


def test_speedup_plot_is_over_our_fastest_ar_where_a_run_measured_it():
    """speedup_vs_batch.png: each system's tok/s over `ar-fused-overlap` in the same cell where the run measured it
    (the ratio issue #20's bar reads), else the bench's own speedup over `ar`."""
    from specpilot.tools.bench import report

    class Axes:
        def __init__(self):
            self.lines, self.labels = {}, {}

        def plot(self, xs, ys, marker=None, label=None):
            self.lines[label] = (list(xs), [round(y, 3) for y in ys])

        def axhline(self, *a, **k):
            pass

        def set(self, **k):
            self.labels.update(k)

        def set_xscale(self, *a, **k):
            pass

        def legend(self, **k):
            pass

    class Plt:
        def __init__(self):
            self.axes, self.title = [], None

        def subplots(self, rows, cols, figsize=None, squeeze=True):
            self.axes = [Axes() for _ in range(cols)]
            plt = self

            class Fig:
                def suptitle(self, text):
                    plt.title = text

                def tight_layout(self):
                    pass

                def savefig(self, path, dpi=None):
                    pass
            return Fig(), [self.axes]

    def run(system, b, tps, ar_tps):
        return {"system": system, "workload": "chat", "batch_size": b, "tokens_per_s": tps,
                "speedup_vs_ar": tps / ar_tps}

    runs = [run("ar", 1, 100.0, 100.0), run("ar-fused-overlap", 1, 200.0, 100.0), run("spec", 1, 260.0, 100.0),
            run("ar", 8, 400.0, 400.0), run("ar-fused-overlap", 8, 500.0, 400.0), run("spec", 8, 450.0, 400.0)]
    plt = Plt()
    report.plot_speedup(plt, {"header": {"workloads": ["chat"]}, "runs": runs}, None)
    [ax] = plt.axes
    assert ax.lines["spec"] == ([1, 8], [1.3, 0.9]) and ax.lines["ar"] == ([1, 8], [0.5, 0.8])
    assert "ar-fused-overlap" in plt.title and ax.labels["ylabel"] == "speedup vs ar-fused-overlap"
    plt = Plt()
    report.plot_speedup(plt, {"header": {}, "runs": [r for r in runs if r["system"] != "ar-fused-overlap"]}, None)
    assert plt.axes[0].lines["spec"] == ([1, 8], [2.6, 1.125]) and plt.axes[0].labels["ylabel"] == "speedup vs ar"


@pytest.mark.parametrize("device, lead_in", [("cuda", 0.2), ("cuda", 0.0), ("cpu", 0.2)])
def test_each_timed_call_follows_its_own_lead_in(monkeypatch, device, lead_in):
    """On CUDA each timed call of a cell comes right after the same system's untimed decodes of its warm-up batch,
    for at least --lead-in seconds, whichever system ran before it in the rotation: what the GPU did just before
    (its clocks) is then the system's own load. --lead-in 0 and a system on the CPU have none."""
    import time
    from types import SimpleNamespace

    from specpilot.tools.bench import run as bench_run
    from specpilot.tools.bench.prompt_requests import BenchRequest

    calls = []

    class Fake:
        def __init__(self, name):
            self.name, self.device = name, SimpleNamespace(type=device)

        def prepare(self, batches, max_new_tokens):
            pass

        def run(self, prompts, max_new_tokens, ignore_eos, concurrency):
            t0 = time.perf_counter()
            time.sleep(0.02)
            calls.append((self.name, len(prompts), t0, time.perf_counter()))
            return SimpleNamespace(seconds=0.02)

    class Progress:
        n = 0

        def update(self, k):
            self.n += k

        def set_postfix_str(self, text):
            pass

    measured = {}
    monkeypatch.setattr(bench_run.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench_run.Bench, "_add_runs", lambda self, systems, w, b, runs, timed, repeated=0, warm=None:
                        measured.update(runs))
    args = SimpleNamespace(cell_requests=None, repeats=2, max_new_tokens=4, ignore_eos=False, waves=1,
                           batching="continuous", lead_in=lead_in)
    bench = bench_run.Bench(args, None, {})
    requests = [BenchRequest(f"q{i}", 0, [1, 2, 3 + i]) for i in range(4)]
    bench.measure_cell([Fake("a"), Fake("b")], "code", 2, requests, Progress())

    assert {name: len(runs[0]) for name, runs in measured.items()} == {"a": 2, "b": 2}
    timed = [i for i, call in enumerate(calls) if call[1] == 4]  # the cell's 4 requests in one call, B = 2
    assert [calls[i][0] for i in timed] == ["a", "b", "b", "a"]  # (the rotation)
    assert [call[:2] for call in calls[:2]] == [("a", 2), ("b", 2)]  # each system's warm-up batch
    if device == "cpu" or lead_in == 0:
        assert len(calls) == 2 + len(timed)
        return
    for i in timed:
        name, j = calls[i][0], i - 1
        while calls[j][:2] == (name, 2) and j > 1:
            j -= 1
        lead = calls[j + 1: i]  # the same system's untimed decodes of its warm-up batch right before
        assert lead and all(c[:2] == (name, 2) for c in lead)
        assert lead[-1][3] - lead[0][2] >= lead_in - 0.005  # the lead-in's seconds (less the bench's own µs around)
        assert len(lead) == 1 or lead[-2][3] - lead[0][2] < lead_in  # and not a decode more than they need


@pytest.mark.parametrize("isolate", ["0", "1"])
def test_a_resumed_bench_keeps_its_finished_cells_and_measures_the_rest(tiny_smol_dir, tmp_path, monkeypatch,
                                                                        isolate):
    """`--resume` (a bench stopped at a time limit, continued in a later call), its cells in this process and in a
    worker (CUDA's default): the cells results.json had finished are kept as they were, not measured again; the
    others are measured; an error entry of a cell that never finished goes; the header lists both runs' batch sizes
    and names the cells carried. Settings that change how a cell is measured refuse to resume (one line naming the
    setting); with every cell done nothing is loaded."""
    from specpilot.tools.bench import run as bench_run

    monkeypatch.setenv(bench_run.ISOLATE_ENV, isolate)

    out = tmp_path / "out"
    common = ["--target", str(tiny_smol_dir), "--workload", "code", "--limit", "2", "--max-new-tokens", "4"]
    first = bench(out, *common, "--batch-sizes", "1")
    # as a run stopped inside B = 2's cell leaves it: a system's error entry there, no run
    stopped = {**first, "errors": [{"system": "stock", "workload": "code", "batch_size": 2, "message": "cut"}]}
    (out / "results.json").write_text(json.dumps(stopped))
    resumed = bench(out, *common, "--batch-sizes", "1,2", "--resume")
    check_consistent(resumed)
    one = [r for r in resumed["runs"] if r["batch_size"] == 1]
    assert one == first["runs"]  # carried whole: the same seconds, the same tokens
    assert {r["system"] for r in resumed["runs"] if r["batch_size"] == 2} == {"ar", "stock"}
    assert not any(e["message"] == "cut" for e in resumed["errors"])
    assert resumed["header"]["batch_sizes"] == [1, 2]
    assert resumed["header"]["resumed"]["cells"] == [["code", 1]]
    assert resumed["header"]["resumed"]["date"] == first["header"]["date"]
    report = (out / "report.md").read_text()
    assert "| ar | 2 |" in report and f"resumed: 1 cell kept from the run of {first['header']['date']}" in report

    with pytest.raises(SpecPilotError, match="max_new_tokens 4.*this run has 5"):
        bench_run.run_bench(bench_run.parse_args([*common[:-1], "5", "--batch-sizes", "1,2", "--resume",
                                                  "--out", str(out)]))
    with pytest.raises(SpecPilotError, match="--resume needs --out"):
        bench_run.run_bench(bench_run.parse_args([*common, "--resume"]))

    def no_load(*a, **kw):
        raise AssertionError("loaded a model with nothing to measure")

    monkeypatch.setattr(bench_run.loader, "load", no_load)
    again = bench(out, *common, "--batch-sizes", "2,1", "--resume")
    assert again["runs"] == resumed["runs"]
