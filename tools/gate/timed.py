"""Check what is timed (docs/GATE.md, "The timed run"): every output of a measured run, judged with the stock
system's own logits, so that a candidate honest only when it sees a checker gains nothing from it.

The gate checks a candidate on its own salted prompts; the benchmark then times it, and a candidate that can tell
the two apart (an environment variable, a module name, a counter of calls) could be right for the gate and fast and
wrong for the clock. Here each timed output (prompt, tokens, finish) is judged by the trusted engine in this process
(the stock model, package code only, the candidate's dtype and device): one teacher-forced forward over
prompt + tokens gives, at every position i, the logits F that predicted token i, and the output passes iff every
token is the stock system's greedy choice up to a numerical tie, `max F - F(token_i) <= epsilon` (the gate's
epsilon, the gate's tie rule: a token chosen over the argmax by a correct kernel differs by at most
2 max |X - F| <= epsilon), and it stops where greedy decoding stops (at EOS, or after max_new_tokens). After a tie
the rest is judged on the candidate's own prefix, which is the greedy continuation of a correct choice.

`judge_timed(model, outputs, epsilon, ...)` is the pure judgement; `check_timed(...)` loads the target.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ...engine.decode import cache_length
from ...kernels import resolve as resolve_kernels
from ...kernels.builtin import attention_sdpa
from .reference import forward_logits


@dataclass
class TimedOutput:
    request: int  # its index in the timed run (workload order)
    prompt: list[int]
    tokens: list[int]  # the generated tokens, EOS included when it stopped the row
    finish: str | None = None  # eos | length, as the bench recorded it


@dataclass
class TimedVerdict:
    passed: bool
    reason: str | None  # one line naming the first failure
    requests_checked: int = 0
    tokens_checked: int = 0
    ties: int = 0  # tokens that were not the stock argmax but within epsilon of it
    epsilon: float | None = None
    failure: dict | None = None  # {kind: diverged / truncated / overrun / empty, request, position, gap, ...}
    details: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _ops():
    from ...engine.recipe import load_recipe

    return resolve_kernels(load_recipe("ar").kernels)._replace(attention=attention_sdpa)  # the gate's prefill ops


def judge_timed(model, outputs: list[TimedOutput], epsilon: float, max_new_tokens: int, eos_ids,
                ignore_eos: bool = False, system: str = "the candidate") -> TimedVerdict:
    """The first timed output that is not the stock system's greedy decode (up to ties within `epsilon`) fails."""
    eos = set(eos_ids or ())
    verdict = TimedVerdict(True, None, epsilon=epsilon)
    ops = _ops()

    def fail(kind: str, out: TimedOutput, position: int | None, text: str, **extra) -> TimedVerdict:
        verdict.passed = False
        verdict.failure = {"kind": kind, "request": out.request, "position": position, **extra}
        verdict.reason = f"timed run of {system} {text}"
        return verdict

    with torch.inference_mode():
        for out in outputs:
            tokens = list(out.tokens)
            if not tokens:
                return fail("empty", out, 0, f"emitted no token for request {out.request}")
            if len(tokens) > max_new_tokens:
                return fail("overrun", out, max_new_tokens, f"ran past max_new_tokens {max_new_tokens} at request "
                                                            f"{out.request} ({len(tokens)} tokens)")
            max_len = cache_length(len(out.prompt), len(tokens), k=0)
            logits = forward_logits(model, list(out.prompt), tokens, max_len, ops)  # [T, V]
            best_val, best_tok = logits.max(-1)
            mine = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
            gaps = (best_val - mine).tolist()
            verdict.requests_checked += 1
            for i, (tok, gap) in enumerate(zip(tokens, gaps)):
                verdict.tokens_checked += 1
                if gap > epsilon:
                    return fail("diverged", out, i,
                                f"diverged from the reference at request {out.request}, token {i}: gap {gap:.3g} > "
                                f"ε {epsilon:.3g} (emitted {tok}, the stock system's choice {int(best_tok[i])})",
                                token=tok, reference_token=int(best_tok[i]), gap=gap, epsilon=epsilon)
                if tok != int(best_tok[i]):
                    verdict.ties += 1
                    verdict.details.append({"request": out.request, "position": i, "token": tok,
                                            "reference_token": int(best_tok[i]), "gap": gap})
                if tok in eos and not ignore_eos and i < len(tokens) - 1:
                    return fail("overrun", out, i + 1, f"ran past its own EOS at request {out.request}, token {i}")
            if not ignore_eos and tokens[-1] not in eos and len(tokens) < max_new_tokens:
                return fail("truncated", out, len(tokens), f"stopped at request {out.request} after {len(tokens)} "
                                                           f"of up to {max_new_tokens} tokens without an EOS")
    return verdict


def check_timed(target: str, outputs: list[TimedOutput], epsilon: float, max_new_tokens: int, device: str,
                dtype: str, ignore_eos: bool = False, system: str = "the candidate") -> TimedVerdict:
    """judge_timed with the target loaded here (the stock engine's model: package code only)."""
    from ...engine import loader

    loaded = loader.load(target, dtype, device)
    try:
        return judge_timed(loaded.model, outputs, epsilon, max_new_tokens, loaded.eos_token_ids, ignore_eos, system)
    finally:
        cuda = loaded.model.device.type == "cuda"
        del loaded
        if cuda:
            torch.cuda.empty_cache()
