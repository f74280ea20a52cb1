"""Broken candidate: replays cached outputs from an earlier run.

On its first use it decodes normally and records each row's tokens, keyed by the question's position in the first
job, in a file at a fixed location (the temp directory, one file per target); on later runs it answers the first
job from that file without decoding. Salting (a fresh nonce in every check's prompts) makes the replayed tokens wrong.
"""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

from specpilot.engine.decode import RowResult
from specpilot.engine.engine import Engine

_generate = Engine.generate
_target = sys.argv[sys.argv.index("--target") + 1]
PATH = Path(tempfile.gettempdir()) / f"specpilot-replay-{hashlib.sha256(_target.encode()).hexdigest()[:16]}.json"
_first_job = [True]


def generate(self, prompts, max_new_tokens, *args, **kwargs):
    first, _first_job[0] = _first_job[0], False
    if first and PATH.is_file():
        recorded = json.loads(PATH.read_text())
        return [RowResult(prompt=list(p), tokens=recorded[i], finish_reason="length") for i, p in enumerate(prompts)]
    rows = _generate(self, prompts, max_new_tokens, *args, **kwargs)
    if first:
        PATH.write_text(json.dumps([r.tokens for r in rows]))
    return rows


Engine.generate = generate
