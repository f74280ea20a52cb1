"""The mechanism memory in a JSON-lines file (memory/jsonl_store.py), for machines without chromadb: opened by a
path ending in .jsonl, the same interface and scores as the Chroma store (similar by deployment distance, search by
word match), failures and other versions flagged, the export format on disk, and the memory CLI on it. Nothing here
imports chromadb (the graph-level check is in test_optimize.py)."""
from __future__ import annotations

import json

import pytest

from specpilot.cli import main
from specpilot.graph.candidates import Candidate
from specpilot.memory import JsonlMemory, MemoryStoreError, open_memory
from specpilot.memory.base import Outcome
from specpilot.memory import records
from specpilot.tools.profile.costmodel import DeviceCeilings, ModelShape

SMOLLM2 = ModelShape(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64)
H200 = DeviceCeilings("NVIDIA H200", 4.13e12, 775e12, 9.09e-6, 1.06e-6, 2.59e-6)
CPU = DeviceCeilings("cpu", 2.0e10, 2.0e11, 5e-6, 5e-6, 5e-6)
VERSIONS = {"specpilot": "0.1.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0",
            "driver": "580.159.04"}


def deployment(ceilings=H200, device="cuda", batch=1, dtype="bf16"):
    return records.describe_deployment(target="smollm2-135m", architecture="llama", shape=SMOLLM2, dtype=dtype,
                                       weight_format="native", drafter="ngram", device=device, ceilings=ceilings,
                                       batch_size=batch, workload_mix="code")


def outcome(dep, reason, patch, speedup=None, failure=None, when="2026-11-20T10:00:00+00:00") -> Outcome:
    results = {} if speedup is None else {"speedup_vs_ar": speedup}
    return Outcome(Candidate("algorithm", reason, patch).to_dict(), dep, results, {"passed": failure is None},
                   failure, dict(VERSIONS), when, run="runs/opt-1")


@pytest.fixture
def memory(tmp_path):
    mem = open_memory(tmp_path / "memory.jsonl", fresh=False)
    h200, cpu = deployment(), deployment(CPU, "cpu", dtype="fp32")
    ids = {
        "ngram_h200": mem.record(outcome(h200, "n-gram prompt lookup drafter, k = 8", {"k": 8}, 1.68)),
        "overlap_h200": mem.record(outcome(h200, "overlap the host's token read with the device", {"overlap": True},
                                           1.63, when="2026-11-20T10:01:00+00:00")),
        "ngram_cpu": mem.record(outcome(cpu, "n-gram prompt lookup drafter, k = 2", {"k": 2}, 1.2,
                                        when="2026-11-20T10:02:00+00:00")),
        "failed_h200": mem.record(outcome(h200, "Triton rmsnorm kernel", {"kernels": {"rmsnorm": "triton"}},
                                          failure="gate: token 17 differs", when="2026-11-20T10:03:00+00:00")),
    }
    return mem, ids


def test_a_jsonl_path_opens_the_file_memory(tmp_path, monkeypatch):
    assert isinstance(open_memory(tmp_path / "a.jsonl"), JsonlMemory)
    monkeypatch.setenv("SPECPILOT_MEMORY", str(tmp_path / "env.jsonl"))
    mem = open_memory()
    assert isinstance(mem, JsonlMemory) and mem.location == str(tmp_path / "env.jsonl")


def test_records_are_kept_once_in_the_export_format(memory):
    mem, ids = memory
    dep = deployment()
    again = mem.record(outcome(dep, "n-gram prompt lookup drafter, k = 8", {"k": 8}, 1.68))
    assert again == ids["ngram_h200"] and mem.count() == 4  # the same outcome twice is one record
    lines = [json.loads(line) for line in mem.path.read_text().splitlines()]
    assert [row["id"] for row in lines] == list(ids.values()) and set(lines[0]) == {"id", "outcome"}
    assert [rid for rid, _ in mem.records()] == list(ids.values())  # oldest first
    assert mem.get(ids["overlap_h200"]).candidate["recipe_patch"] == {"overlap": True}
    with pytest.raises(KeyError, match="no record 'nope'"):
        mem.get("nope")
    assert len(mem.outcomes()) == 4


def test_similar_ranks_closer_deployments_and_flags_failures(memory):
    mem, ids = memory
    hits = mem.similar(deployment(), k=10)
    assert [h.id for h in hits] == [ids["ngram_h200"], ids["overlap_h200"], ids["ngram_cpu"], ids["failed_h200"]]
    assert hits[0].similarity == pytest.approx(1.0) and hits[0].score == pytest.approx(1.68)
    assert hits[2].similarity < 0.2  # another device class is at least 1 away
    failed = hits[-1]
    assert failed.score == pytest.approx(0.0) and "failed" in failed.flags
    assert "failure: gate: token 17 differs" in failed.flags
    assert mem.similar(deployment(), k=1)[0].id == ids["ngram_h200"] and mem.similar(deployment(), k=0) == []
    # hits are what the graph hands the provider
    assert set(hits[0].to_dict()) == {"id", "score", "similarity", "flags", "outcome"}


def test_similar_falls_back_to_matching_keys_for_partial_descriptors(tmp_path):
    mem = JsonlMemory(tmp_path / "m.jsonl")
    partial = {"architecture": "llama", "device_name": "cpu", "batch_size": 1}
    rid = mem.record(outcome(partial, "two drafts", {"k": 2}, 1.1))
    [hit] = mem.similar({"architecture": "llama", "device_name": "cpu", "batch_size": 8})
    assert hit.id == rid and hit.similarity == pytest.approx(2 / 3)


def test_search_by_words_and_other_versions_flagged(memory, tmp_path):
    mem, ids = memory
    hits = mem.search("n-gram prompt lookup", k=10)
    assert {h.id for h in hits[:2]} == {ids["ngram_h200"], ids["ngram_cpu"]}
    assert ids["overlap_h200"] not in {h.id for h in hits}  # no word in common: no match
    assert hits[0].similarity >= hits[-1].similarity > 0
    [kernel] = mem.search("rmsnorm kernel", k=1)
    assert kernel.id == ids["failed_h200"] and "failed" in kernel.flags
    assert "re-verify" in kernel.flags  # recorded under other versions than this process has
    same = JsonlMemory(mem.path, versions=VERSIONS)
    assert "re-verify" not in same.search("rmsnorm", k=1)[0].flags


def test_export_import_and_a_chroma_export_opens_as_memory(memory, tmp_path):
    mem, ids = memory
    exported = tmp_path / "export.jsonl"
    assert mem.export_jsonl(exported) == 4
    copy = JsonlMemory(tmp_path / "copy.jsonl")
    assert copy.import_jsonl(exported) == 4 and copy.import_jsonl(exported) == 4 and copy.count() == 4
    assert copy.export_jsonl(tmp_path / "again.jsonl") == 4
    assert (tmp_path / "again.jsonl").read_text() == exported.read_text()
    # an export (Chroma's export_jsonl writes the same lines) is itself a memory
    assert [rid for rid, _ in JsonlMemory(exported).records()] == list(ids.values())


def test_bare_outcome_lines_are_read(tmp_path):
    path = tmp_path / "old.jsonl"
    o = outcome(deployment(), "two drafts", {"k": 2}, 1.1)
    path.write_text(json.dumps(o.to_dict()) + "\n")
    mem = JsonlMemory(path)
    assert mem.records() == [(records.record_id(o), o)]


def test_a_corrupted_file_names_its_line_and_fresh_keeps_it_aside(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x", "outcome": {"candidate": {}}}\nnot json\n')
    with pytest.raises(MemoryStoreError, match=r"bad.jsonl, line 1: not an outcome record .*--memory-fresh"):
        JsonlMemory(path)
    mem = open_memory(path, fresh=True)
    assert mem.count() == 0 and mem.moved_aside.read_text().endswith("not json\n")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(MemoryStoreError, match="is not a file"):
        JsonlMemory(tmp_path / "dir.jsonl")


def test_memory_cli_on_a_jsonl_file(memory, capsys):
    mem, ids = memory
    where = ["--memory", str(mem.path)]
    assert main(["memory", "list", *where]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(ids.values())
    assert main(["memory", "search", "overlap host device", "-k", "1", "--json", *where]) == 0
    assert json.loads(capsys.readouterr().out)[0]["id"] == ids["overlap_h200"]
    assert main(["memory", "show", ids["failed_h200"], *where]) == 0
    assert "failed" in json.loads(capsys.readouterr().out)["flags"]
