"""The bench with its cells in worker processes (tools/bench/worker.py; docs/BENCH.md, "A bench that survives a
fault"), forced on on the CPU: a system that kills its worker costs only itself, in that cell or (at its build) in
the run; a worker that dies while loading ends the run with error entries instead of a hang.

The faults are real: candidate kernel files (tests/broken_candidates style, written here) that abort their process,
one when it sees a batch of two rows, one as soon as it is imported. The CUDA-only half (a system that leaves the
context dead without killing the process) takes a GPU: on the CPU the worker's check of the context is a no-op.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import jsonschema
import pytest
import torch
from conftest import tiny_smol_vocab_dir
from test_bench import SCHEMA, check_consistent

from specpilot.engine.errors import SpecPilotError
from specpilot.tools.bench import run as bench_run
from specpilot.tools.bench.env import header

# rmsnorm as the built-in computes it, except that a batch of two rows aborts the process (SIGABRT): the bench's
# B = 2 cell, nowhere else (B = 1 cells decode one row at a time, and on the CPU no batch is padded to a bucket)
ABORTS_AT_B2 = '''import os

import torch


def rmsnorm(x, w, eps):
    if x.shape[0] == 2:
        os.abort()
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)
'''
# a kernel file that aborts its process when the engine imports it, i.e. while the system is being built
ABORTS_AT_IMPORT = '''import os

os.abort()


def rmsnorm(x, w, eps):
    return x
'''
BATCH_SIZES = [2, 1]  # the faulty cell first: the faulty system is tried again in the cell after it
MAX_NEW_TOKENS = 3
LIMIT = 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama with SmolLM2's vocabulary, saved with SmolLM2's tokenizer (the bench needs text)."""
    from transformers import AutoTokenizer

    from specpilot.engine import loader

    path = tiny_smol_vocab_dir(tmp_path_factory, "tiny-worker", 5, 64, 2, tied=False)
    AutoTokenizer.from_pretrained(str(loader.source_dir("smollm2-135m"))).save_pretrained(path)
    return path


def bench_args(target: Path, recipes: list[Path]):
    return bench_run.parse_args([f"--target={target}", "--workload=code", f"--limit={LIMIT}",
                                 f"--max-new-tokens={MAX_NEW_TOKENS}", *[f"--recipe={r}" for r in recipes]])


def measure_isolated(args, out: Path, timeout_s: float = 300):
    """measure() with the cells in workers, in a thread: a run that hangs fails here instead of hanging the tests."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        job = pool.submit(bench_run.measure, args, BATCH_SIZES, bench_run.load_workloads("code", LIMIT),
                          bench_run.recipes_to_measure(args.recipe, args.target), "cpu", "fp32", out, isolate=True)
        return job.result(timeout=timeout_s)
    finally:
        pool.shutdown(wait=False)


def broken_recipes(tmp: Path) -> tuple[Path, Path]:
    """`boom` (aborts at B = 2) and `dud` (aborts when built): recipe files naming the kernel files above."""
    (tmp / "aborts_at_b2.py").write_text(ABORTS_AT_B2)
    (tmp / "aborts_at_import.py").write_text(ABORTS_AT_IMPORT)
    boom, dud = tmp / "boom.json", tmp / "dud.json"
    boom.write_text(json.dumps({"name": "boom", "kernels": {"rmsnorm": str(tmp / "aborts_at_b2.py")}}))
    dud.write_text(json.dumps({"name": "dud", "kernels": {"rmsnorm": str(tmp / "aborts_at_import.py")}}))
    return boom, dud


@pytest.fixture(scope="module")
def broken_run(tiny_dir, tmp_path_factory):
    """ar, stock, boom and dud, cells B = 2 then B = 1: the first worker dies building dud, the second in boom's
    B = 2 warm-up, the third finishes the run."""
    tmp = tmp_path_factory.mktemp("broken-bench")
    args = bench_args(tiny_dir, list(broken_recipes(tmp)))
    bench = measure_isolated(args, tmp / "out")
    return args, tmp / "out", bench.results


def test_a_crash_in_one_cell_costs_that_system_that_cell(broken_run):
    _, _, results = broken_run
    cells = {(r["system"], r["workload"], r["batch_size"]) for r in results["runs"]}
    # every other system measured in the faulty cell; the faulty system and all others in the cell after it
    assert cells == {("ar", "code", 2), ("stock", "code", 2), ("ar", "code", 1), ("stock", "code", 1),
                     ("boom", "code", 1)}
    errors = {(e["system"], e["workload"], e["batch_size"]): e["message"] for e in results["errors"]}
    message = errors[("boom", "code", 2)]
    assert "SIGABRT" in message and "measured again without boom" in message and "\n" not in message
    assert [e for e in results["errors"] if e["system"] == "boom"] == [
        {"system": "boom", "workload": "code", "batch_size": 2, "message": message}]


def test_a_crash_while_building_leaves_only_that_system_out(broken_run):
    _, _, results = broken_run
    [dud] = [e for e in results["errors"] if e["system"] == "dud"]
    assert (dud["workload"], dud["batch_size"]) == (None, None)
    assert "SIGABRT" in dud["message"] and "left out of the run" in dud["message"]
    assert len(results["errors"]) == 2  # dud's and boom's, nothing else
    assert not [r for r in results["runs"] if r["system"] == "dud"]


def test_the_surviving_runs_are_whole_and_compared_in_one_process(broken_run):
    _, out, results = broken_run
    check_consistent(results)
    for run in results["runs"]:
        assert run["requests"] == LIMIT and len(run["outputs"]) == LIMIT
        # fp32 greedy, each cell's systems in one process: the same tokens as ar (boom's rmsnorm is the built-in's)
        assert run["identical_to_ar"] == 1.0, run["system"]
    # results.json is the run: every cell, every error, rewritten after the last one
    assert json.loads((out / "results.json").read_text()) == results
    assert "boom" in (out / "report.md").read_text()


def test_the_header_comes_from_the_worker_as_the_in_process_bench_writes_it(broken_run):
    args, _, results = broken_run
    head = results["header"]
    here = header(args, torch.device("cpu"), "fp32", ["code"], BATCH_SIZES,
                  bench_run.recipes_to_measure(args.recipe, args.target))
    assert set(head) == set(here)
    assert set(head["recipes"]) == {"ar", "stock", "boom", "dud"}  # what each system ran, from the worker
    assert {k: v for k, v in head.items() if k != "date"} == {k: v for k, v in here.items() if k != "date"}


def test_a_worker_that_dies_while_loading_ends_the_run_with_errors(tiny_dir, tmp_path, monkeypatch):
    # A real death in the worker's model load: Python's audit hook (installed by a sitecustomize on the worker's
    # PYTHONPATH) aborts the process when it opens the target's config.json; this process never imports it.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"CONFIG = {str(tiny_dir / 'config.json')!r}\n"
        "sys.addaudithook(lambda event, args: os.abort() if event == 'open' and str(args[0]) == CONFIG else None)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    args = bench_args(tiny_dir, [])
    bench = measure_isolated(args, tmp_path / "out", timeout_s=120)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results == bench.results
    jsonschema.validate(results, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert results["runs"] == []
    assert [(e["system"], e["workload"], e["batch_size"]) for e in results["errors"]] == [(None, "code", 2),
                                                                                          (None, "code", 1)]
    assert all("SIGABRT" in e["message"] and "while loading the target" in e["message"] for e in results["errors"])
    assert results["header"]["device"] == "cpu" and results["header"]["target"] == str(tiny_dir)
    assert (tmp_path / "out" / "report.md").is_file()


def test_the_sandboxed_bench_measures_in_a_worker_inside_the_sandbox(tiny_dir, tmp_path, monkeypatch):
    """A recipe of candidate kernel files runs the whole bench in the sandbox (run_bench, bench_in_sandbox): with
    isolation on (decided by the caller, handed to the child), the child's worker runs there too, and boom's crash
    costs boom its cell, not the sandboxed bench its results."""
    from specpilot.tools.sandbox import process

    boom, _ = broken_recipes(tmp_path)
    monkeypatch.setenv(bench_run.ISOLATE_ENV, "1")  # not in the sandbox's environment: the payload carries it
    args = bench_run.parse_args([f"--target={tiny_dir}", "--workload=code", f"--limit={LIMIT}", "--batch-sizes=2",
                                 f"--max-new-tokens={MAX_NEW_TOKENS}", f"--recipe={boom}", f"--out={tmp_path / 'out'}"])
    assert bench_run.run_bench(args, sandbox=process) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    check_consistent(results)
    assert {(r["system"], r["batch_size"]) for r in results["runs"]} == {("ar", 2), ("stock", 2)}
    [error] = results["errors"]
    assert (error["system"], error["workload"], error["batch_size"]) == ("boom", "code", 2)
    assert "SIGABRT" in error["message"]


def test_isolation_is_on_for_cuda_and_when_asked(monkeypatch):
    monkeypatch.delenv(bench_run.ISOLATE_ENV, raising=False)
    assert bench_run.isolation_wanted("cuda") and bench_run.isolation_wanted("cuda:1")
    assert not bench_run.isolation_wanted("cpu")
    assert bench_run.isolation_wanted("cpu", isolate=True) and not bench_run.isolation_wanted("cuda", isolate=False)
    monkeypatch.setenv(bench_run.ISOLATE_ENV, "1")
    assert bench_run.isolation_wanted("cpu")
    assert not bench_run.isolation_wanted("cpu", isolate=False)  # the caller's word beats the environment's
    monkeypatch.setenv(bench_run.ISOLATE_ENV, "0")
    assert not bench_run.isolation_wanted("cuda")
    monkeypatch.setenv(bench_run.ISOLATE_ENV, "yes")
    with pytest.raises(SpecPilotError, match="SPECPILOT_BENCH_ISOLATE"):
        bench_run.isolation_wanted("cuda")
