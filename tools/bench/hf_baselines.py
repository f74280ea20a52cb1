"""HF transformers baselines on the same weights: greedy `generate` with a static cache, and assisted generation with
prompt lookup. Both see the same token-id prompts as our engine and stop on the same EOS ids.

Token arrival times come from a streamer: `generate` hands it each step's new tokens (the prompt first), so a step's
time and, for prompt lookup, its number of accepted drafts are observed rather than estimated.
"""
from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from ...engine.loader import LoadedModel
from .systems import BatchRun, BenchSkip, System

PROMPT_LOOKUP_TOKENS = 10  # HF's documented example value; the most drafts one step verifies
HF_SYSTEMS = ("hf-static", "hf-prompt-lookup")


class StepClock(BaseStreamer):
    """Records when each `put` (one decoding step's tokens, [B] or [1, n]) arrives, and its width."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.steps: list[tuple[float, int]] = []  # (seconds since t0, tokens per row)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate streams the prompt first
            self.prompt_seen = True
            return
        self.steps.append((time.perf_counter() - self.t0, value.shape[-1] if value.dim() > 1 else 1))

    def end(self) -> None:
        pass


def load_hf_model(target: LoadedModel):
    """HF's own model class on the target's weights (the directory our loader read), same device and dtype."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target.source, dtype=target.model.dtype)
    return model.to(target.model.device).eval()


class HFSystem(System):
    def __init__(self, name: str, hf_model, target: LoadedModel):
        if name not in HF_SYSTEMS:
            raise ValueError(f"unknown HF baseline {name!r} (known: {', '.join(HF_SYSTEMS)})")
        self.name, self.model, self.device = name, hf_model, target.model.device
        self.lookup = name == "hf-prompt-lookup"
        self.k = PROMPT_LOOKUP_TOKENS if self.lookup else 0
        self.eos = list(target.eos_token_ids)
        tok_pad = getattr(target.tokenizer, "pad_token_id", None)
        self.pad = tok_pad if tok_pad is not None else (self.eos[0] if self.eos else 0)

    def decode(self, prompts, max_new_tokens, ignore_eos) -> BatchRun:
        if self.lookup and len(prompts) > 1:
            raise BenchSkip(f"{self.name}: HF assisted generation supports batch size 1 only")
        width = max(len(p) for p in prompts)
        # Left padding with an attention mask: HF appends new tokens at the right end of every row.
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": self.pad,
                  "eos_token_id": None if ignore_eos else self.eos}
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        else:
            kwargs["cache_implementation"] = "static"
        clock = StepClock()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, streamer=clock, **kwargs)
        return self._rows(out[:, width:].tolist(), clock.steps, ignore_eos)

    def _rows(self, generated: list[list[int]], steps: list[tuple[float, int]], ignore_eos: bool) -> BatchRun:
        run = BatchRun([], [], [], [])
        # Each token's arrival time, in order: every step adds `width` tokens to every row.
        arrivals = [t for t, width in steps for _ in range(width)]
        for tokens in generated:
            n = len(tokens)
            if not ignore_eos:  # finished rows are padded to the longest row; a row ends at its first EOS
                n = next((i + 1 for i, tok in enumerate(tokens) if tok in self.eos), n)
            run.tokens.append(tokens[:n])
            run.token_times.append(arrivals[:n])
            run.finish_reasons.append("eos" if n and tokens[n - 1] in self.eos and not ignore_eos else "length")
            run.accepted.append(self._accepted(steps, n))
        return run

    def _accepted(self, steps: list[tuple[float, int]], n: int) -> list[int]:
        """Drafts accepted per verification step of a row that got n tokens."""
        if not self.lookup:
            return [0] * max(n - 1, 0)  # greedy AR: the prefill token, then one token per step
        # Prompt lookup verifies from its first forward on: every step is a verification, width - 1 accepted.
        out, seen = [], 0
        for _, width in steps:
            if seen >= n:
                break
            out.append(min(width, n - seen) - 1)
            seen += width
        return out
