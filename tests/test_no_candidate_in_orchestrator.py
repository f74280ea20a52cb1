"""The orchestrator never imports candidate code (issue 19, item 1): the graph's bench and profile of a recipe that
names a kernel file run it in a sandboxed child. The kernel's module-level code records its process id (in a marker
file where the sandbox lets it write, and on stderr); the test process must not have imported it (a guard on
kernels.load_candidate, sys.modules), and the pid it recorded must be another process's. A tiny random Llama with
SmolLM2's tokenizer on CPU keeps each child to seconds."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import tiny_smol_vocab_dir
from specpilot import kernels
from specpilot.engine.loader import source_dir
from specpilot.graph import measure
from specpilot.tools.bench.run import parse_args, run_bench
from specpilot.tools.profile.profiler import profile
from specpilot.tools.sandbox import process

KERNEL = '''
import json, os, sys
print(f"candidate-pid {os.getpid()}", file=sys.stderr, flush=True)
try:  # the sandbox's filesystem may be read-only here: then stderr is the only record
    with open(MARKER, "a") as f:
        print(json.dumps({"pid": os.getpid()}), file=f)
except OSError:
    pass
import torch.nn.functional as F


def linear(x, w, b=None):
    return F.linear(x, w, b)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tiny_smol_vocab_dir(tmp_path_factory, "tiny-smol-sandbox", 3, 64, 2, tied=False)
    AutoTokenizer.from_pretrained(str(source_dir("smollm2-135m"))).save_pretrained(path)
    return path


@pytest.fixture
def candidate(tmp_path, monkeypatch):
    """A recipe naming a kernel file by a path relative to the cwd; the test process refuses to load any candidate."""
    marker = tmp_path / "marker.jsonl"
    (tmp_path / "kern").mkdir()
    (tmp_path / "kern" / "linear_marker.py").write_text(KERNEL.replace("MARKER", repr(str(marker))))
    recipe = tmp_path / "cand.json"
    recipe.write_text(json.dumps({"name": "cand", "drafter": {"kind": "ngram"}, "k": 2,
                                  "kernels": {"linear": "kern/linear_marker.py"}}))
    monkeypatch.chdir(tmp_path)

    def refuse(slot, path):
        raise AssertionError(f"candidate {path} loaded in the orchestrator")

    monkeypatch.setattr(kernels, "load_candidate", refuse)
    results = []
    real = process.run_python

    def recording(*a, **kw):
        results.append(real(*a, **kw))
        return results[-1]

    monkeypatch.setattr(process, "run_python", recording)
    return recipe, marker, results


def candidate_pids(marker: Path, results: list) -> list[int]:
    pids = [json.loads(line)["pid"] for line in marker.read_text().splitlines()] if marker.exists() else []
    for r in results:
        pids += [int(p) for p in re.findall(r"candidate-pid (\d+)", r.stderr_tail)]
    return pids


def not_imported_here(kernel: Path) -> None:
    here = [name for name, m in list(sys.modules.items())
            if name.startswith("specpilot_candidate_") or getattr(m, "__file__", None) == str(kernel)]
    assert not here, here


def settings(model_dir: Path) -> dict:
    return {"target": str(model_dir), "workload": "code", "limit": 1, "batch_size": 1, "max_new_tokens": 4,
            "bench_repeats": 1, "profile_repeats": 1, "device": "cpu", "dtype": "fp32"}


def test_graph_bench_runs_a_kernel_file_in_the_sandbox(model_dir, candidate, tmp_path):
    recipe, marker, results = candidate
    result, _ = measure.bench(settings(model_dir), [str(recipe)], tmp_path / "bench")
    assert result["ok"], result["error"]
    assert set(result["systems"]) == {"ar", "stock", "cand"} and not result["errors"]
    assert result["systems"]["cand"]["tokens_per_s"] > 0 and result["systems"]["cand"]["identical_to_ar"] == 1.0
    written = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert written["header"]["target"] == str(model_dir) and (tmp_path / "bench" / "report.md").is_file()
    [r] = results
    assert r.ok, r.stderr_tail
    pids = candidate_pids(marker, results)
    assert pids and os.getpid() not in pids
    not_imported_here(tmp_path / "kern" / "linear_marker.py")


def test_graph_profile_runs_a_kernel_file_in_the_sandbox(model_dir, candidate, tmp_path):
    recipe, marker, results = candidate
    prof, _ = measure.profile(settings(model_dir), str(recipe), tmp_path / "profile")
    assert prof["meta"]["recipe"] == "cand" and prof["meta"]["target"] == str(model_dir)
    assert prof["step"]["tokens_per_s"] > 0 and prof["gaps"]
    assert json.loads((tmp_path / "profile" / "profile.json").read_text())["meta"] == prof["meta"]
    [r] = results
    pids = candidate_pids(marker, results)
    assert pids and os.getpid() not in pids
    not_imported_here(tmp_path / "kern" / "linear_marker.py")


def test_without_a_sandbox_candidate_code_is_refused(model_dir, candidate, tmp_path):
    recipe, marker, results = candidate
    args = parse_args([f"--target={model_dir}", f"--recipe={recipe}", "--limit=1", "--max-new-tokens=2",
                       "--device=cpu", f"--out={tmp_path / 'b'}"])
    with pytest.raises(Exception, match="run only in the sandbox"):
        run_bench(args)
    with pytest.raises(Exception, match="run only in the sandbox"):
        profile(str(model_dir), str(recipe), limit=1, max_new_tokens=2, device="cpu")
    assert not results and not marker.exists()


def test_a_crashing_kernel_file_is_one_line_and_the_caller_lives(model_dir, candidate, tmp_path):
    recipe, marker, results = candidate
    (tmp_path / "kern" / "linear_marker.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    result, _ = measure.bench(settings(model_dir), [str(recipe)], tmp_path / "bench")
    assert not result["ok"] and "killed by SIGSEGV" in result["error"], result["error"]
    assert "\n" not in result["error"]


def test_agent_tools_run_a_kernel_file_in_the_sandbox(model_dir, candidate, tmp_path):
    from specpilot.tools import agent_tools

    recipe, marker, results = candidate
    bench = agent_tools.benchmark_recipe(str(recipe), target=str(model_dir), limit=1, max_new_tokens=4,
                                         device="cpu", dtype="fp32", out_dir=str(tmp_path / "bench"))
    assert bench.ok, bench.error
    prof = agent_tools.profile(str(recipe), target=str(model_dir), limit=1, max_new_tokens=4, device="cpu",
                               dtype="fp32", out_dir=str(tmp_path / "profile"), repeats=1)
    assert prof.ok, prof.error
    assert len(results) == 2 and all(r.ok for r in results)
    pids = candidate_pids(marker, results)
    assert pids and os.getpid() not in pids
    not_imported_here(tmp_path / "kern" / "linear_marker.py")
