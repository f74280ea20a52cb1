"""Training samples from the target itself: its answers, decoded by the engine, and the states the head reads.

Each prompt (chat-templated by Engine.encode) gets the target's greedy answer and one sampled answer (ANSWER_SAMPLING),
both from `Engine.generate` with an AR recipe: the text the head must predict is the target's own. Then one target
forward (Transformer.forward with `aux_layers`) over prompt + answer captures, at every position, the outputs of
the head's three aux layers (what `fc` fuses), the last layer's output (the target's pre-norm final state: the
trainer turns it into the target's distribution over the draft vocabulary, whose rows are only known once every
answer is in) and the target's greedy next token (the full-vocabulary argmax, for the position mask and held-out
acceptance). No second model and no HF generate.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...engine.recipe import load_recipe
from ...engine.sampling import SamplingParams

ANSWER_SAMPLING = SamplingParams(temperature=0.8, top_p=0.95)


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] int64: prompt + answer
    prompt_len: int
    states: torch.Tensor  # [T, 3 Ht] the aux layers' outputs, concatenated low, middle, high
    final: torch.Tensor  # [T, Ht] the last layer's output (before the final norm)
    greedy: torch.Tensor  # [T] int64: the target's argmax after each token

    @property
    def answer(self) -> list[int]:
        return self.tokens[self.prompt_len:].tolist()


def answer_engine(target):
    from ...engine.engine import Engine

    return Engine(target, load_recipe("ar"))


def answers(engine, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) pairs: each prompt's greedy answer, then each prompt's sampled one."""
    greedy = engine.generate(prompts, max_new_tokens)
    sampled = engine.generate(prompts, max_new_tokens, ANSWER_SAMPLING, seed=seed)
    return [(p, r.tokens) for p, r in zip(prompts, greedy)] + [(p, r.tokens) for p, r in zip(prompts, sampled)]


@torch.inference_mode()
def capture(model, prompt: list[int], answer: list[int], aux_layers: tuple[int, ...]) -> Sample:
    tokens = torch.tensor(prompt + answer, device=model.device)
    T = tokens.numel()
    cache = model.new_cache(1, T)
    last = model.cfg.n_layers - 1
    logits, states = model(tokens[None], torch.arange(T, device=model.device)[None], cache,
                           aux_layers=(*aux_layers, last))
    H = model.cfg.hidden_size
    return Sample(tokens.cpu(), len(prompt), states[0, :, : 3 * H].cpu(), states[0, :, 3 * H:].cpu(),
                  logits[0].argmax(-1).cpu())


def build_samples(engine, prompts: list[list[int]], max_new_tokens: int, seed: int,
                  aux_layers: tuple[int, ...]) -> list[Sample]:
    model = engine.target.model
    return [capture(model, p, a, aux_layers) for p, a in answers(engine, prompts, max_new_tokens, seed) if a]


def save_samples(path: Path, samples: list[Sample]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save([vars(s) for s in samples], tmp)
    tmp.replace(path)


def load_samples(path: Path) -> list[Sample]:
    return [Sample(**s) for s in torch.load(path, weights_only=True)]
