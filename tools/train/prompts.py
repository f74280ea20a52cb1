"""Where the training prompts come from: a JSONL file, or the target itself (Magpie-style self-instruct).

A file line is a Spec-Bench / MT-Bench question (`{"turns": ["first user turn", ...]}`: the first turn is used, as
later turns answer an earlier answer the target will not have given) or `{"prompt": "..."}`.

Self-instruct (Magpie, Xu et al. 2024): an aligned chat model given only its template's text up to where a user's
message begins writes a plausible user message. The prefix is read off the template by rendering a user turn around
a marker and keeping what precedes it (a default system prompt the template adds stays in it), and the target
samples from there until its end of turn.
"""
from __future__ import annotations

import json
from pathlib import Path

from ...engine.errors import SpecPilotError
from ...engine.sampling import SamplingParams

MARKER = "\uE000specpilot-user-turn\uE000"
SELF_INSTRUCT_TOKENS = 64  # the longest prompt the target is asked to write
SELF_INSTRUCT_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)
SELF_INSTRUCT_ROUNDS = 4  # batches of samples before giving up on reaching the count asked for


def read_prompt_file(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise SpecPilotError(f"prompt file not found: {path}")
    prompts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {line_no}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecPilotError(f"{where}: bad JSON ({e.msg})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("turns"), list) and item["turns"] \
                and isinstance(item["turns"][0], str):
            prompts.append(item["turns"][0])
        else:
            raise SpecPilotError(f'{where}: expected {{"turns": ["..."]}} or {{"prompt": "..."}}')
    if not prompts:
        raise SpecPilotError(f"prompt file {path} has no prompts")
    return prompts


def user_turn_prefix(tokenizer, target: str) -> str:
    """The chat template's text before a user message's content (refused without a chat template)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SpecPilotError(f"target {target} has no chat template to write its own prompts from: "
                             f"pass --prompts FILE.jsonl")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    if MARKER not in text:
        raise SpecPilotError(f"target {target}'s chat template does not show a user message's text: "
                             f"pass --prompts FILE.jsonl")
    return text[: text.index(MARKER)]


def self_instruct(engine, count: int, seed: int, accept, say=lambda line: None) -> list[str]:
    """Prompts the target writes from its user-turn prefix until `accept` (a filter over all texts written so far,
    returning those it keeps) keeps `count`, or SELF_INSTRUCT_ROUNDS batches of `count` samples were drawn; a
    progress line through `say` after each batch."""
    tokenizer = engine.target.tokenizer
    prefix_text = user_turn_prefix(tokenizer, engine.target.source)
    prefix = tokenizer.encode(prefix_text, add_special_tokens=False)
    written: list[str] = []
    kept: list[str] = []
    for round_no in range(SELF_INSTRUCT_ROUNDS):
        rows = engine.generate([prefix] * count, SELF_INSTRUCT_TOKENS, SELF_INSTRUCT_SAMPLING,
                               seed=seed + round_no)
        written += [tokenizer.decode(r.tokens, skip_special_tokens=True).strip() for r in rows]
        kept = accept(written)
        say(f"  self-instruct round {round_no + 1}: {len(written)} prompts written, {min(len(kept), count)}/{count} "
            f"kept")
        if len(kept) >= count:
            break
    return kept[:count]
