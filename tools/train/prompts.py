"""Where the training prompts come from: a JSONL file, or the target itself (Magpie-style self-instruct).

A file line is a Spec-Bench / MT-Bench question (`{"turns": ["first user turn", ...]}`: the first turn is used, as
later turns answer an earlier answer the target will not have given) or `{"prompt": "..."}`.

Self-instruct (Magpie, Xu et al. 2024): an aligned chat model given only its template's text up to where a user's
message begins writes a plausible user message. The prefix is read off the template by rendering a user turn around
a marker and keeping what precedes it (a default system prompt the template adds stays in it), and the target
samples from there until its end of turn.

A prompt mix (`--prompt-mix`): `chat` is that alone; `tasks` (the default) splits the prompts evenly between the
FAMILIES below, each a generic task framing written into the user turn for the target to continue, as Magpie does
with the bare prefix. Left alone a small chat model writes short open requests almost only; a head trained on their
answers never learns to copy from a long context or to predict code and math. The openers are framings the target
fills, never benchmark text, and what it writes goes through the same dedup and benchmark filters as any prompt.
"""
from __future__ import annotations

import json
from pathlib import Path

from ...engine.errors import SpecPilotError
from ...engine.sampling import SamplingParams

MARKER = "\uE000specpilot-user-turn\uE000"
SELF_INSTRUCT_TOKENS = 64  # the longest prompt the target is asked to write (open chat)
SELF_INSTRUCT_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)
SELF_INSTRUCT_ROUNDS = 4  # batches of samples before giving up on reaching the count asked for

# (name, the user turn's opening text the target continues, the most tokens it writes after it)
FAMILIES = (
    # open chat: the bare user-turn prefix, today's Magpie prompts (short requests, questions, chit-chat)
    ("chat", "", SELF_INSTRUCT_TOKENS),
    # code: answers that are code, which open chat almost never asks for
    ("code", "Write a Python function that", 96),
    # math: step-by-step arithmetic and reasoning answers
    ("math", "Solve this math word problem step by step:\n\n", 128),
    # summarization: the target writes a long text, and the answer copies and condenses it (copying from context)
    ("summarization", "Summarize the following text.\n\n", 384),
    # reading comprehension: a passage and (usually) a question on it, answered from the passage (RAG-like)
    ("reading", "Read the text below and answer the question at the end.\n\n", 384),
)
PROMPT_MIXES = {"chat": FAMILIES[:1], "tasks": FAMILIES}


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


def joined(opener: str, written: str) -> str:
    """The kept prompt: the opener and the target's continuation (stripped), a space between them where the opener
    ends in a word and the continuation starts with one (a tokenizer may or may not decode the leading space)."""
    if opener and not opener[-1].isspace() and written[:1].isalnum():
        return f"{opener} {written}"
    return opener + written


def quotas(count: int, families: int) -> list[int]:
    """`count` split round-robin: the first `count % families` families get one more."""
    return [count // families + (1 if i < count % families else 0) for i in range(families)]


def write_prompts(engine, count: int, seed: int, accept, mix: str = "chat", say=lambda line: None) \
        -> list[tuple[str, str]]:
    """(family, prompt) pairs the target writes from its user-turn prefix, each family of the mix continuing its
    opener, until `accept` (a filter over all texts written so far, returning those it keeps) keeps each family's
    share of `count` (round-robin: shares within one), or SELF_INSTRUCT_ROUNDS batches were drawn; a family still
    short then is made up from the others' surplus. A batch draws each unfinished family's share, with seed
    seed + round * families + the family's index (`chat`: seed + round, as before the mix). Interleaved in the
    result: family by family, first prompts first. A progress line through `say` after each batch."""
    families = PROMPT_MIXES[mix]
    tokenizer = engine.target.tokenizer
    prefix_text = user_turn_prefix(tokenizer, engine.target.source)
    prefixes = [tokenizer.encode(prefix_text + opener, add_special_tokens=False) for _, opener, _ in families]
    share = quotas(count, len(families))
    written: list[str] = []
    family_of: dict[str, str] = {}  # a text's family: the first to write it (dedup keeps the first)
    by_family: dict[str, list[str]] = {name: [] for name, _, _ in families}
    for round_no in range(SELF_INSTRUCT_ROUNDS):
        for index, (name, opener, max_tokens) in enumerate(families):
            if len(by_family[name]) >= share[index]:
                continue
            rows = engine.generate([prefixes[index]] * share[index], max_tokens, SELF_INSTRUCT_SAMPLING,
                                   seed=seed + round_no * len(families) + index)
            for r in rows:
                text = tokenizer.decode(r.tokens, skip_special_tokens=True).strip()
                if opener and not text:
                    continue  # an opener with nothing after it is no prompt
                text = joined(opener, text)
                written.append(text)
                family_of.setdefault(text, name)
        kept = accept(written)
        by_family = {name: [] for name, _, _ in families}
        for text in kept:
            by_family[family_of[text]].append(text)
        have = sum(min(len(by_family[name]), n) for (name, _, _), n in zip(families, share))
        split = "" if len(families) == 1 else " (" + ", ".join(f"{name} {min(len(by_family[name]), n)}/{n}" for
                                                               (name, _, _), n in zip(families, share)) + ")"
        say(f"  self-instruct round {round_no + 1}: {len(written)} prompts written, {have}/{count} kept{split}")
        if have >= count:
            break
    picked = [by_family[name][:n] for (name, _, _), n in zip(families, share)]
    spare = [t for (name, _, _), n in zip(families, share) for t in by_family[name][n:]]
    short = count - sum(map(len, picked))
    out: list[tuple[str, str]] = []
    for i in range(max(map(len, picked), default=0)):
        out += [(family_of[rows[i]], rows[i]) for rows in picked if i < len(rows)]
    out += [(family_of[t], t) for t in spare[:max(short, 0)]]
    return out


def self_instruct(engine, count: int, seed: int, accept, say=lambda line: None, mix: str = "chat") -> list[str]:
    """The prompts of `write_prompts`, without their families."""
    return [text for _, text in write_prompts(engine, count, seed, accept, mix, say)]
