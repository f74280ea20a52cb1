"""The run directory: where every artifact of an optimize run lives, and the caches that let a node that runs again
(after `specpilot resume`, or when a person answers a question and LangGraph re-executes the node) skip the work
it already finished.

    DIR/run.json                      thread id and settings (what `resume` and `history` read)
    DIR/checkpoints.sqlite            LangGraph checkpoints, one per node
    DIR/baseline/                     round 1: the starting recipe's gate and the ar/stock measurement
    DIR/rounds/<n>/                   profile/, route.json, proposals of each agent, integration
    DIR/candidates/<id>/              candidate.json, recipe.json, kernel source, kernel_check.json, gate/, bench/
    DIR/evaluations/<key>.json        finished evaluations (key = candidate id + recipe hash)
    DIR/evaluations.jsonl             one line per evaluation started and finished: the count a resume is checked by
    DIR/remembered.jsonl              outcomes already written to memory
    DIR/recipe.json, report.md, progress.png
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints.sqlite"


def write_json(path: Path, data) -> Path:
    """Atomic: a process killed while writing leaves the previous file or none, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def cached_json(path: Path, compute):
    """The JSON at `path`, or compute() written there first: a decision or measurement made once per run."""
    path = Path(path)
    if path.is_file():
        return read_json(path)
    value = compute()
    write_json(path, value)
    return value


def recipe_key(recipe: dict) -> str:
    """Hash of what the engine runs: the recipe without its name, description and measurements."""
    body = {k: v for k, v in recipe.items() if k not in ("name", "description", "measured")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def round_dir(out: Path, round_: int) -> Path:
    return Path(out) / "rounds" / str(round_)


def candidate_dir(out: Path, cid: str) -> Path:
    return Path(out) / "candidates" / cid


def evaluation_path(out: Path, key: str) -> Path:
    return Path(out) / "evaluations" / f"{key}.json"


def log_evaluation(out: Path, key: str, event: str) -> None:
    """Appends {key, event: start|done, time}: after a resume, a finished key has exactly one `done`."""
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "evaluations.jsonl", "a") as f:
        f.write(json.dumps({"key": key, "event": event, "time": time.time()}) + "\n")


def evaluation_log(out: Path) -> list[dict]:
    path = Path(out) / "evaluations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def remembered(out: Path) -> set[str]:
    path = Path(out) / "remembered.jsonl"
    if not path.exists():
        return set()
    return {json.loads(line)["key"] for line in path.read_text().splitlines() if line.strip()}


def mark_remembered(out: Path, key: str, record_id: str) -> None:
    with open(Path(out) / "remembered.jsonl", "a") as f:
        f.write(json.dumps({"key": key, "record": record_id}) + "\n")
