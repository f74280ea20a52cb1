"""Broken candidate: replays cached outputs from an earlier run.

On its first use it decodes normally and records each row's tokens, keyed by the question's position in the first
job, in a file at a fixed location (/tmp, one file per target; not $TMPDIR, which the sandbox points at the
candidate's own temp dir); on later runs it answers the first
job from that file without decoding. The sandbox stops the recording (its file system is read-only outside the
candidate's temp dir); a file planted there by someone else is still replayed, and salting (a fresh nonce in every
check's prompts) makes the replayed tokens wrong.
"""
import hashlib
import json
import sys
from pathlib import Path

from specpilot.engine.decode import RowResult
from specpilot.engine.engine import Engine

_generate = Engine.generate
_target = sys.argv[sys.argv.index("--target") + 1]
PATH = Path("/tmp") / f"specpilot-replay-{hashlib.sha256(_target.encode()).hexdigest()[:16]}.json"
_first_job = [True]


def generate(self, prompts, max_new_tokens, *args, **kwargs):
    first, _first_job[0] = _first_job[0], False
    if first and PATH.is_file():
        recorded = json.loads(PATH.read_text())
        return [RowResult(prompt=list(p), tokens=recorded[i], finish_reason="length") for i, p in enumerate(prompts)]
    rows = _generate(self, prompts, max_new_tokens, *args, **kwargs)
    if first:
        try:
            PATH.write_text(json.dumps([r.tokens for r in rows]))
        except OSError:  # the sandbox's file system is read-only outside the candidate's own temp dir
            pass
    return rows


Engine.generate = generate
