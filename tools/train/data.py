"""Training samples from the target itself: its answers, decoded by the engine, and the states the head reads.

Each prompt (chat-templated by Engine.encode) gets the target's greedy answer and one sampled answer (ANSWER_SAMPLING),
both from `Engine.generate` with an AR recipe: the text the head must predict is the target's own. Then one target
forward (Transformer.forward with `aux_layers`) over prompt + answer captures, at every position, the outputs of
the head's three aux layers (what `fc` fuses), the last layer's output (the target's pre-norm final state: the
trainer turns it into the target's distribution over the draft vocabulary, whose rows are only known once every
answer is in) and the target's greedy next token (the full-vocabulary argmax, for the position mask and held-out
acceptance); samples of similar length share one right-padded forward (`capture_group`). No second model and no HF
generate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...engine.recipe import parse
from ...engine.sampling import SamplingParams

ANSWER_SAMPLING = SamplingParams(temperature=0.8, top_p=0.95)
ANSWER_CHUNK = 1024  # prompts decoded a call (between progress lines)
# Rows the data's engine decodes at once (continuous batching). SmolLM2's AR step is launch-bound up to hundreds of
# rows, so rows are nearly free tokens; the K/V cache is what bounds them (256 rows of 1,000 slots: 5.9 GB on
# SmolLM2-135M, 33 GB on Llama-3.1-8B).
ANSWER_ROWS = 256
CAPTURE_SAMPLES, CAPTURE_TOKENS = 32, 16384  # a capture forward's most samples and padded tokens


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


def answer_engine(target, rows: int = ANSWER_ROWS):
    """The AR engine that writes the prompts and answers. Not compiled: torch.compile builds each batch bucket's step
    and each prefill width anew (seconds each: 9.9 s for the B = 1 step on the H200, third lease), and the calls
    here drain through every bucket, where a CUDA graph of the uncompiled step is captured in milliseconds. On CUDA
    the fused layer (steps of up to 16 tokens; larger ones modular): a batch's tail, and every sampled step (run
    without a graph), launches 5 kernels a layer instead of some 13."""
    from ...engine.engine import Engine

    cuda = target.model.device.type == "cuda"
    return Engine(target, parse({"name": "train-data", "compile": False, "layer": "fused" if cuda else "modular",
                                 "batch": {"max_batch_size": rows}}))


class PhaseClock:
    """Wall seconds by phase of the data's build (data.json's `seconds`): where its minutes go."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}

    def add(self, phase: str, seconds: float, tokens: int = 0) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.tokens[phase] = self.tokens.get(phase, 0) + tokens

    def report(self) -> dict:
        return {phase: {"seconds": round(s, 2), **({"tokens": self.tokens[phase],
                                                     "tokens_per_second": round(self.tokens[phase] / s, 1)}
                                                    if self.tokens.get(phase) and s > 0 else {})}
                for phase, s in self.seconds.items()}


def answers(engine, prompts: list[list[int]], max_new_tokens: int, seed: int,
            say=lambda line: None, clock: PhaseClock | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) pairs: each prompt's greedy answer, then each prompt's sampled one. Decoded ANSWER_CHUNK
    prompts a call (the chunk at i sampled with seed + i), with a progress line through `say` after each (and each
    kind's wall time and tokens on `clock`)."""
    pairs = {}
    for kind, sampling in (("greedy", SamplingParams()), ("sampled", ANSWER_SAMPLING)):
        rows = []
        for i in range(0, len(prompts), ANSWER_CHUNK):
            started = time.perf_counter()
            chunk = engine.generate(prompts[i: i + ANSWER_CHUNK], max_new_tokens, sampling, seed=seed + i)
            seconds = time.perf_counter() - started
            rows += chunk
            made = sum(len(r.tokens) for r in chunk)
            if clock is not None:
                clock.add(f"{kind} answers", seconds, made)
            say(f"  {kind} answers: {len(rows)}/{len(prompts)} ({made / max(seconds, 1e-9):,.0f} tokens/s)")
        pairs[kind] = [(p, r.tokens) for p, r in zip(prompts, rows)]
    return pairs["greedy"] + pairs["sampled"]


@torch.inference_mode()
def capture(model, prompt: list[int], answer: list[int], aux_layers: tuple[int, ...]) -> Sample:
    """One sample's states, from one target forward over it alone."""
    return capture_group(model, [(prompt, answer)], aux_layers)[0]


@torch.inference_mode()
def capture_group(model, pairs: list[tuple[list[int], list[int]]], aux_layers: tuple[int, ...]) -> list[Sample]:
    """The samples of several (prompt, answer) pairs from one target forward, right-padded to the longest: the mask
    is causal by position, so a row's pad slots, past its end, change none of its own states (up to floating-point
    summation order: the batched matmuls may add in another order)."""
    device = model.device
    lengths = [len(p) + len(a) for p, a in pairs]
    B, T = len(pairs), max(lengths)
    tokens = torch.zeros(B, T, dtype=torch.long)
    for b, (p, a) in enumerate(pairs):
        tokens[b, : lengths[b]] = torch.tensor(p + a)
    tokens = tokens.to(device)
    cache = model.new_cache(B, T)
    last = model.cfg.n_layers - 1
    logits, states = model(tokens, torch.arange(T, device=device)[None].expand(B, T), cache,
                           aux_layers=(*aux_layers, last))
    greedy = logits.argmax(-1).cpu()
    del logits
    H = model.cfg.hidden_size
    states = states.cpu()
    tokens = tokens.cpu()
    return [Sample(tokens[b, :n].clone(), len(pairs[b][0]), states[b, :n, : 3 * H].clone(),
                   states[b, :n, 3 * H:].clone(), greedy[b, :n].clone()) for b, n in enumerate(lengths)]


def capture_groups(lengths: list[int], max_samples: int = CAPTURE_SAMPLES,
                   max_tokens: int = CAPTURE_TOKENS) -> list[list[int]]:
    """Indices grouped for capture: sorted by length (little padding), at most max_samples a group and at most
    max_tokens padded tokens (the logits [B, T, vocab] are the forward's largest tensor), a longer one alone."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        group = groups[-1] if groups else None
        if group and len(group) < max_samples and (len(group) + 1) * lengths[i] <= max_tokens:
            group.append(i)
        else:
            groups.append([i])
    return groups


def build_samples(engine, prompts: list[list[int]], max_new_tokens: int, seed: int,
                  aux_layers: tuple[int, ...], say=lambda line: None, clock: PhaseClock | None = None) -> list[Sample]:
    """The samples of each prompt's greedy and sampled answers (empty answers dropped), in that order; their states
    captured in groups (`capture_groups`), with a progress line through `say` at each tenth of them and the last
    (a line a group was 281 lines for 9,000 samples on the H100)."""
    model = engine.target.model
    pairs = [(p, a) for p, a in answers(engine, prompts, max_new_tokens, seed, say, clock) if a]
    out: list[Sample | None] = [None] * len(pairs)
    done = told = 0
    started = time.perf_counter()
    for group in capture_groups([len(p) + len(a) for p, a in pairs]):
        for i, sample in zip(group, capture_group(model, [pairs[i] for i in group], aux_layers)):
            out[i] = sample
        done += len(group)
        if done == len(pairs) or 10 * (done - told) >= len(pairs):
            say(f"  hidden states: {done}/{len(pairs)} samples")
            told = done
    if clock is not None:
        clock.add("hidden states", time.perf_counter() - started, sum(len(p) + len(a) for p, a in pairs))
    return out


def save_samples(path: Path, samples: list[Sample]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save([vars(s) for s in samples], tmp)
    tmp.replace(path)


def load_samples(path: Path) -> list[Sample]:
    return [Sample(**s) for s in torch.load(path, weights_only=True)]
