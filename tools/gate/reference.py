"""The gate's trusted side: the stock system's reference tokens, the logits behind them, and its own numerical noise.

The stock system is the same engine with the built-in `ar` recipe (autoregressive greedy, no speculation), batch 1,
on the same dtype and device as the candidate. For each salted prompt it gives:

- the reference tokens (stopping at EOS or max_new_tokens),
- for every generated position, the top-8 (token, logit) pairs and the reference token's own logit, from one
  teacher-forced forward over prompt + reference (the logits that predicted each token),
- the noise: max |Δ logit| between those logits and the logits the stock decode itself computed for the same
  positions (prefill, then one token per forward; read with a forward hook on the target while it decodes), over
  every position and vocabulary entry of every question.

A reference is cached as JSON under `<cache>/gate/<sha256>.json`, keyed by everything it depends on (docs/GATE.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...engine import loader
from ...engine.decode import cache_length
from ...engine.engine import Engine
from ...engine.errors import SpecPilotError
from ...engine.loader import LoadedModel
from ...engine.recipe import load_recipe
from ...engine.workloads import Question
from ...kernels import resolve as resolve_kernels
from ...kernels.builtin import attention_sdpa

FORMAT = 1  # bump when the cached content or its meaning changes
TOP = 8  # logits kept per position


@dataclass
class QuestionRef:
    question_id: str
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    top: list[list[list]]  # per position: [[token, logit], ...] best first, TOP of them
    ref_logit: list[float]  # per position: the logit of the reference token itself

    def logit_of(self, position: int, token: int) -> float | None:
        """The stock logit of `token` at `position` when it is among the stored top-8 (or is the reference)."""
        if token == self.tokens[position]:
            return self.ref_logit[position]
        for t, v in self.top[position]:
            if t == token:
                return v
        return None


@dataclass
class Reference:
    key: str
    salt: str
    questions: list[QuestionRef]
    noise: float  # max |logit(1-token steps) - logit(one multi-token forward)|
    max_abs_logit: float
    recomputed_steps: bool  # the step logits were recomputed (the engine's own could not be captured)
    seconds: float  # time the computation took (of the run that filled the cache)
    cached: bool = False


def model_source(target: str) -> str:
    """Where the target's config, weights and tokenizer live, without loading it (a GGUF is dequantized once)."""
    return str(loader.source_dir(target))


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as e:  # transformers raises many types for a missing or foreign tokenizer
        raise SpecPilotError(f"the gate needs the target's tokenizer (workloads are text) and could not load the "
                             f"one of {source}: {type(e).__name__}: {e}") from e


def salted_prompt(tokenizer, turn: str, salt: str) -> list[int]:
    """The first user turn behind a system turn carrying the nonce, through the chat template (else as a prefix)."""
    if tokenizer is None:
        raise SpecPilotError("the gate needs a target with a tokenizer (workloads are text; prompts are salted text)")
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": f"Session {salt}."}, {"role": "user", "content": turn}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer.encode(f"Session {salt}.\n\n{turn}"))


def _fingerprint(source: str) -> list:
    """What identifies the model's files: path, and name/size/mtime of every file in its directory."""
    path = Path(source)
    if not path.is_dir():
        return [source]
    files = sorted(p for p in path.iterdir() if p.is_file())
    return [str(path.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def cache_key(source: str, workload: str, questions: list[Question], limit: int | None, max_new_tokens: int,
              dtype: str, device: str, salt: str) -> str:
    fields = {"format": FORMAT, "model": _fingerprint(source), "workload": workload,
              "questions": [[q.question_id, q.turns[0]] for q in questions], "limit": limit,
              "max_new_tokens": max_new_tokens, "dtype": str(loader.parse_dtype(dtype)), "device": device,
              "salt": salt, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def forward_logits(model, prompt: list[int], tokens: list[int], max_len: int, ops) -> torch.Tensor:
    """[len(tokens), V] fp32: the logits that predicted each token, from one forward over prompt + tokens[:-1]."""
    seq = torch.tensor([prompt + tokens[:-1]], device=model.device)
    positions = torch.arange(seq.shape[1], device=model.device)[None]
    at = torch.arange(len(prompt) - 1, seq.shape[1], device=model.device)[None]
    return model(seq, positions, model.new_cache(1, max_len), logits_at=at, ops=ops)[0].float()


def stepwise_logits(model, prompt: list[int], tokens: list[int], max_len: int, prefill_ops, step_ops) -> torch.Tensor:
    """The same logits as AR decoding computes them: prefill the prompt, then feed each token alone at its slot."""
    dev = model.device
    cache = model.new_cache(1, max_len)
    seq = torch.tensor([prompt], device=dev)
    pos = torch.arange(len(prompt), device=dev)[None]
    rows = [model(seq, pos, cache, logits_at=torch.tensor([[len(prompt) - 1]], device=dev), ops=prefill_ops)[0, 0]]
    for j, tok in enumerate(tokens[:-1]):
        p = torch.tensor([[len(prompt) + j]], device=dev)
        rows.append(model(torch.tensor([[tok]], device=dev), p, cache, ops=step_ops)[0, 0])
    return torch.stack(rows).float()


def _decode_capturing(engine: Engine, prompt: list[int], max_new_tokens: int):
    """Decode one prompt with the stock engine, keeping the logits of each of its forwards (the AR step logits)."""
    captured: list[torch.Tensor] = []
    handle = engine.target.model.register_forward_hook(lambda mod, args, out: captured.append(out[0, -1].float()))
    try:
        [row] = engine.generate([prompt], max_new_tokens)
    finally:
        handle.remove()
    return row, captured


def compute(loaded: LoadedModel, question_ids: list[str], prompts: list[list[int]], max_new_tokens: int,
            key: str, salt: str) -> Reference:
    t0 = time.perf_counter()
    recipe = load_recipe("ar")
    recipe.batch.max_batch_size = 1
    recipe.cuda_graphs = False  # a replayed graph runs the captured kernels (same numbers) but skips the hook
    engine = Engine(loaded, recipe)
    step_ops = resolve_kernels(recipe.kernels)
    prefill_ops = step_ops._replace(attention=attention_sdpa)  # what the Decoder's prefill uses
    model = loaded.model
    out, noise, max_abs, recomputed = [], 0.0, 0.0, False
    with torch.inference_mode():
        for qid, prompt in zip(question_ids, prompts):
            row, captured = _decode_capturing(engine, prompt, max_new_tokens)
            if not row.tokens:
                raise SpecPilotError(f"the stock system generated no token for question {qid}")
            ref = torch.tensor(row.tokens, device=model.device)
            max_len = cache_length(len(prompt), max_new_tokens, k=0)  # the length AR decoding attends over
            steps = torch.stack(captured[: len(row.tokens)]) if len(captured) >= len(row.tokens) else None
            if steps is None or not torch.equal(steps.argmax(-1), ref):
                # the capture does not line up with the tokens (an engine change): recompute the steps ourselves
                steps, recomputed = stepwise_logits(model, prompt, row.tokens, max_len, prefill_ops, step_ops), True
            logits = forward_logits(model, prompt, row.tokens, max_len, prefill_ops)
            noise = max(noise, (steps - logits).abs().max().item())
            max_abs = max(max_abs, logits.abs().max().item())
            vals, idx = logits.topk(min(TOP, logits.shape[-1]), dim=-1)
            top = [[[t, v] for t, v in zip(ti, vi)] for ti, vi in zip(idx.tolist(), vals.tolist())]
            out.append(QuestionRef(qid, list(prompt), list(row.tokens), row.finish_reason, top,
                                   logits.gather(1, ref[:, None])[:, 0].tolist()))
    return Reference(key, salt, out, noise, max_abs, recomputed, time.perf_counter() - t0)


def load_cached(key: str, prompts: list[list[int]], cache_dir: Path) -> Reference | None:
    """The cached reference for `key`, or None."""
    path = cache_dir / f"{key}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if (data.get("format") != FORMAT or data.get("key") != key
                or [q["prompt"] for q in data["questions"]] != prompts):
            return None
        data.pop("format")
        data["questions"] = [QuestionRef(**q) for q in data["questions"]]
        return Reference(**{**data, "cached": True})
    except (OSError, ValueError, TypeError, KeyError):
        return None  # unreadable or foreign: recomputed and overwritten


def compute_and_store(load: Callable[[], LoadedModel], question_ids: list[str], prompts: list[list[int]],
                      max_new_tokens: int, key: str, salt: str, cache_dir: Path) -> Reference:
    """Load the target with `load`, compute the reference, write it to the cache and let go of the model."""
    loaded = load()
    cuda = loaded.model.device.type == "cuda"
    ref = compute(loaded, question_ids, prompts, max_new_tokens, key, salt)
    del loaded
    if cuda:  # the candidate loads its own copy next
        torch.cuda.empty_cache()
    data = {"format": FORMAT, **asdict(ref)}
    data.pop("cached")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / f"{key}.json"
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")  # (the grid gates in threads)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)  # readers never see a half-written file
    except OSError:
        pass  # an unwritable cache costs time, not correctness
    return ref

