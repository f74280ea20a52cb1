"""The requests a benchmark sends: every turn of every workload question, as token ids, identical for all systems.

A turn's prompt is the conversation so far through the target's chat template: [user t1] for the first turn,
[user t1, assistant a1, user t2] for the second, and so on. The assistant turns are one fixed system's greedy answers
(the same-engine AR's), computed once before measuring, so every system decodes exactly the same prompts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...engine.errors import SpecPilotError
from ...engine.workloads import Question


@dataclass(frozen=True)
class BenchRequest:
    question_id: str
    turn: int  # 0-based index into the question's turns
    prompt: list[int]


def conversation(turns: tuple[str, ...], answers: list[str]) -> list[dict]:
    """Chat messages for the turn after `answers`: the user turns so far interleaved with the answers to them."""
    messages = []
    for i, text in enumerate(turns[: len(answers) + 1]):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def encode_conversation(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ready for the assistant's next turn."""
    if tokenizer is None:
        raise SpecPilotError("benchmarking needs a target with a tokenizer (workloads are text)")
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    # No template (a base model): the plain text of the conversation, turns separated by blank lines.
    return tokenizer.encode("\n\n".join(m["content"] for m in messages))


def build_requests(questions: list[Question], tokenizer,
                   answer: Callable[[list[list[int]]], list[str]]) -> list[BenchRequest]:
    """One request per turn, in question order then turn order.

    `answer(prompts)` returns the reference system's answer text to each prompt; it is asked only for turns that
    have a following turn, once per turn depth (all questions' turn t together).
    """
    answers: list[list[str]] = [[] for _ in questions]  # by position: hand-written files may repeat ids
    prompts: list[list[list[int]]] = [[] for _ in questions]
    depth = max((len(q.turns) for q in questions), default=0)
    for t in range(depth):
        live = [i for i, q in enumerate(questions) if len(q.turns) > t]
        for i in live:
            prompts[i].append(encode_conversation(tokenizer, conversation(questions[i].turns, answers[i])))
        need_answer = [i for i in live if len(questions[i].turns) > t + 1]
        if need_answer:
            for i, text in zip(need_answer, answer([prompts[i][t] for i in need_answer])):
                answers[i].append(text)
    return [BenchRequest(q.question_id, t, p) for q, ps in zip(questions, prompts) for t, p in enumerate(ps)]
