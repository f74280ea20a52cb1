"""Broken candidate: stops early.

Every row is cut to half its length (at least one token) and reported as finished by length, as an engine that
miscounts its token budget would.
"""
from specpilot.engine.engine import Engine

_generate = Engine.generate


def generate(self, prompts, max_new_tokens, *args, **kwargs):
    rows = _generate(self, prompts, max_new_tokens, *args, **kwargs)
    for r in rows:
        r.tokens = r.tokens[: max(1, len(r.tokens) // 2)]
        r.finish_reason = "length"
    return rows


Engine.generate = generate
