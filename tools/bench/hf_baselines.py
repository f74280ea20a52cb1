"""HF transformers baselines on the same weights: greedy `generate` with a static cache, and assisted generation with
prompt lookup. Both see the same token-id prompts as our engine and stop on the same EOS ids.

Token arrival times come from a streamer: `generate` hands it each step's new tokens (the prompt first), so a step's
time and, for prompt lookup, its number of accepted drafts are observed rather than estimated.

What HF compiles: with a static cache on CUDA, `generate` runs the prefill eagerly and its decoding step through
torch.compile ("reduce-overhead": CUDA graph trees). The compiled step sees tensors of the batch size and of the
static cache's length (the cache itself, the [B, 1, 1, length] mask), never the prompt width, so dynamo compiles once
per (batch size, cache length) until a dimension has changed once; then it recompiles that dimension dynamic, and the
graph trees still record a CUDA graph for each new size. Left to itself, HF sizes the cache prompt + max_new_tokens - 1
(keeping the longest so far) and builds a new one in every call: a wider prompt grows it inside a timed call (a
recompile or a recording), and every call's cache sits at new addresses, which the graph trees record anew (the cache
is marked static). So the cache is ours: one StaticCache per batch size, of the cell's length (`prepare`), reset and
passed to every call, as HF's cache guide does for repeated calls; before anything is timed, `prepare` decodes a few
tokens at each batch size of the cell and prefills each of its (batch size, prompt width). Prompt lookup keeps a
dynamic cache: nothing compiles.
"""
from __future__ import annotations

import inspect
import time

import torch
from transformers.generation.streamers import BaseStreamer

from ...engine.loader import LoadedModel
from .systems import BatchRun, BenchSkip, System

PROMPT_LOOKUP_TOKENS = 10  # HF's documented example value; the most drafts one step verifies
HF_SYSTEMS = ("hf-static", "hf-prompt-lookup")
# Static cache lengths are rounded up to a multiple of this, so that cells of similar prompts share one length (one
# compiled shape); attention reads the whole cache, so the rounding costs little against a recompile.
STATIC_CACHE_STEP = 256
# New tokens of a warm-up decode in `prepare`: the prefill, then enough compiled steps for the graph trees to warm up,
# record and replay (a new graph runs eagerly once, is recorded on a later call, then replayed).
WARMUP_NEW_TOKENS = 8


def static_cache_length(longest_prompt: int, max_new_tokens: int) -> int:
    """The static cache length for prompts of up to `longest_prompt` tokens and `max_new_tokens` new tokens (HF
    needs prompt + max_new_tokens - 1), rounded up to a multiple of STATIC_CACHE_STEP."""
    return -(-(longest_prompt + max_new_tokens) // STATIC_CACHE_STEP) * STATIC_CACHE_STEP


def cache_keyword() -> str:
    """The keyword `generate` takes a Cache under: `cache` where transformers names it so (5.24; `past_key_values`
    is deprecated there), `past_key_values` before (5.17)."""
    from transformers.generation.utils import GenerationMixin

    names = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in names else "past_key_values"


def dynamo_graphs() -> int:
    """Graphs torch.compile's dynamo has built in this process so far: each compile and recompile adds one."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


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
        # The static cache length in use; it only grows, as HF's own does (a shorter cache is a new shape too).
        self.cache_length = 0
        self.caches = {}  # batch size -> the StaticCache of length cache_length that every call of that size reuses

    def prepare(self, batches, max_new_tokens) -> None:
        """Fix the cell's static cache length (its longest prompt), then run every shape of the cell in the caches its
        timed calls will reuse: at each batch size WARMUP_NEW_TOKENS tokens (HF compiles and records the decoding
        step here), and each further (batch size, prompt width) a prefill alone (eager, but on the H200 a call with a
        new width took 50-90 ms longer than its repeat, SmolLM2's shapes in bf16)."""
        if self.lookup:
            return
        longest = max(len(p) for batch in batches for p in batch)
        self._grow_cache_length(static_cache_length(longest, max_new_tokens))
        first_of_shape = {}
        for batch in batches:
            first_of_shape.setdefault((len(batch), max(len(p) for p in batch)), batch)
        decoded = set()
        for (size, _), batch in first_of_shape.items():
            self.decode(batch, 1 if size in decoded else WARMUP_NEW_TOKENS, ignore_eos=True)
            decoded.add(size)

    def decode(self, prompts, max_new_tokens, ignore_eos) -> BatchRun:
        if self.lookup and len(prompts) > 1:
            raise BenchSkip(f"{self.name}: HF assisted generation supports batch size 1 only")
        width = max(len(p) for p in prompts)
        # Left padding with an attention mask: HF appends new tokens at the right end of every row.
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": self.pad,
                  "eos_token_id": None if ignore_eos else self.eos}
        graphs = dynamo_graphs()
        clock = StepClock()
        with torch.inference_mode():  # (a reused cache holds inference tensors: its reset must run in this mode)
            if self.lookup:
                kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
            else:
                kwargs[cache_keyword()] = self._static_cache(len(prompts), static_cache_length(width, max_new_tokens))
            out = self.model.generate(ids, attention_mask=mask, streamer=clock, **kwargs)
        run = self._rows(out[:, width:].tolist(), clock.steps, ignore_eos)
        run.captures = dynamo_graphs() - graphs  # graphs compiled in this call (CUDA graph recordings not counted)
        return run

    def _static_cache(self, batch: int, length: int):
        """The cache for a call of `batch` rows that needs `length` slots: the one calls of this size used before,
        reset, unless the length in use must grow (then every size gets a new one)."""
        from transformers import StaticCache

        self._grow_cache_length(length)
        cache = self.caches.get(batch)
        if cache is None:
            cache = self.caches[batch] = StaticCache(config=self.model.config, max_cache_len=self.cache_length)
        else:
            cache.reset()
        return cache

    def _grow_cache_length(self, length: int) -> None:
        if length > self.cache_length:  # the caches of the old length are dropped: no call will use them again
            self.cache_length, self.caches = length, {}

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
