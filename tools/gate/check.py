"""Token-forcing gate: does a candidate (a recipe, maybe with a patch) give the stock system's greedy tokens?

    specpilot check --target T --recipe R --workload W [--limit K] [--max-new-tokens N] --out DIR

The stock system (same engine, `ar` recipe, batch 1, same dtype and device) decodes every salted prompt once; its
tokens, top-8 logits per position and numerical noise are cached (tools/gate/reference.py). The candidate decodes
the same prompts in its own process (tools/sandbox/candidate_client.py) and never sees the reference. Its tokens are compared
one by one; where it differs from the reference on a numerical tie (logit_ref(r) - logit_ref(c) <= epsilon) the
reference token is forced: the candidate continues from the prompt plus the reference up to and including that
token, and the comparison goes on. Any other difference fails the check. docs/GATE.md has the details.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...engine import loader
from ...engine.errors import SpecPilotError
from ...engine.recipe import load_recipe
from ...engine.workloads import WorkloadError, load_workload
from . import reference as gr
from ..sandbox.candidate_client import Candidate, CandidateFailure
from .report import GateReport

SAFETY = 4.0  # epsilon = SAFETY x measured noise; docs/GATE.md has the measurement behind the factor
FLOOR = 1e-6  # epsilon >= FLOOR x max |logit|, so a bit-exact stock system still tolerates last-bit differences
CONTEXT_TOKENS = 20


class GateInputError(SpecPilotError):
    """The check could not run as asked (target, recipe, workload, flags): exit 2, no verdict."""


@dataclass
class Verdict:
    """How a candidate continuation from `offset` compares with a question's reference."""
    kind: str  # done | tie | diverged | truncated | overrun
    position: int  # the first position that is not an exact match (or the reference's length when done)
    exact: int  # exact matches before it
    candidate_token: int | None = None
    margin: float | None = None  # logit_ref(r) - logit_ref(c); a lower bound when c is not in the stored top-8
    margin_exact: bool = True


def judge(ref: gr.QuestionRef, offset: int, candidate: list[int], epsilon: float) -> Verdict:
    n_ref = len(ref.tokens)
    for j, c in enumerate(candidate):
        pos = offset + j
        if pos >= n_ref:
            return Verdict("overrun", pos, j)
        if c == ref.tokens[pos]:
            continue
        lc = ref.logit_of(pos, c)
        exact = lc is not None
        margin = ref.ref_logit[pos] - (lc if exact else ref.top[pos][-1][1])
        return Verdict("tie" if exact and margin <= epsilon else "diverged", pos, j, c, margin, exact)
    if offset + len(candidate) < n_ref:
        return Verdict("truncated", offset + len(candidate), len(candidate))
    return Verdict("done", n_ref, len(candidate))


def epsilon_for(noise: float, max_abs_logit: float) -> tuple[float, float]:
    floor = FLOOR * max_abs_logit
    return max(SAFETY * noise, floor), floor


# Coverage (docs/GATE.md, "Coverage"): with coverage="long" the questions are two long cases built from the
# workload's first question, so that code paths of long inputs run: a prefill past LONG_PREFILL tokens in one
# forward, and a context past LONG_CONTEXT tokens (as long as the model's max positions allow, less the new tokens).
LONG_PREFILL = 256
LONG_CONTEXT = 8192
LONG_MARGIN = 128  # tokens past each threshold


def max_positions(source: str) -> int | None:
    """The model's max_position_embeddings (config.json, or its text_config), None when it does not say."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (config, config.get("text_config") or {}):
        if isinstance(c.get("max_position_embeddings"), int):
            return c["max_position_embeddings"]
    return None


def long_questions(tokenizer, questions: list, salt: str, max_new_tokens: int, positions: int | None) -> list:
    """A long-prefill question (prompt LONG_PREFILL + LONG_MARGIN tokens) and a long-context one (prompt
    LONG_CONTEXT + LONG_MARGIN tokens, or as long as `positions` allows after max_new_tokens and a verification
    step's slack), each the workload's first question after numbered filler lines of the workload's text."""
    from ...engine.workloads import Question

    base = questions[0].turns[0]
    overhead = len(gr.salted_prompt(tokenizer, "", salt))
    room = (positions - max_new_tokens - 64) if positions else None
    out = []
    for qid, want in (("long-prefill", LONG_PREFILL + LONG_MARGIN), ("long-context", LONG_CONTEXT + LONG_MARGIN)):
        want = min(want, room) if room else want
        if want <= LONG_PREFILL + 1 and qid == "long-context":
            continue  # the model's positions leave no room past the prefill case
        tail = list(tokenizer.encode(f"\n\n{base}"))
        filler, lines, n = [], [], 0
        while len(filler) < want - overhead - len(tail):
            n += 1
            line = f"({n}) {' '.join((q.turns[0] for q in questions))}\n"
            lines.append(line)
            filler += tokenizer.encode(line)
        keep = max(0, want - overhead - len(tail))
        for _ in range(8):  # decoding and encoding again may merge or split tokens: trim until it fits
            text = tokenizer.decode(filler[:keep]) + tokenizer.decode(tail)
            over = len(gr.salted_prompt(tokenizer, text, salt)) - want
            if over <= 0:
                break
            keep = max(0, keep - over)
        out.append(Question(qid, "coverage", (text,)))
    return out


def _absolute_if_path(spec: str) -> str:
    return str(Path(spec).resolve()) if spec and Path(spec).exists() else spec


def _inputs(target, recipe, workload, limit, max_new_tokens, device, dtype, patch, batch_size, timeout_s):
    if max_new_tokens < 1 or (limit is not None and limit < 1) or timeout_s <= 0:
        raise GateInputError("--max-new-tokens, --limit and the timeout must be positive")
    loader.parse_dtype(dtype)
    loader.check_device(device)
    rec = load_recipe(recipe, target)
    if batch_size is not None:
        if batch_size < 1:
            raise GateInputError(f"--batch-size must be >= 1, got {batch_size}")
        rec.batch.max_batch_size = batch_size
    if rec.drafter.kind == "model":  # the candidate runs elsewhere: a relative draft model path must survive that
        loader.resolve(rec.drafter.model)  # a missing draft model is a bad recipe (exit 2), not a bad candidate
        rec.drafter.model = _absolute_if_path(rec.drafter.model)
    try:
        questions = load_workload(workload, limit)
    except WorkloadError as e:
        raise GateInputError(str(e)) from e
    if not questions:
        raise GateInputError(f"workload {workload!r} has no questions")
    if patch is not None and not Path(patch).is_file():
        raise GateInputError(f"patch file not found: {patch}")
    return rec, questions


def check(target: str, recipe: str, workload: str, limit: int | None, max_new_tokens: int, device: str, dtype: str,
          out_dir: Path, salt: str | None = None, patch: str | None = None, batch_size: int | None = None,
          timeout_s: float = 600, cache_dir: Path | None = None, coverage: str | None = None) -> GateReport:
    """Run one check and write out_dir/report.json and out_dir/summary.txt. Raises SpecPilotError (GateInputError
    and the loader's and recipe parser's errors) when the check cannot run; a bad candidate is a report, not an error.
    coverage="long": the questions are the long cases (long_questions) instead of the workload's."""
    t0 = time.perf_counter()
    rec, questions = _inputs(target, recipe, workload, limit, max_new_tokens, device, dtype, patch, batch_size,
                             timeout_s)
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GateInputError(f"cannot create the output directory {out_dir}: {e}") from e
    salt = salt or secrets.token_hex(8)
    source = gr.model_source(target)
    tokenizer = gr.load_tokenizer(source)
    if coverage == "long":
        questions = long_questions(tokenizer, questions, salt, max_new_tokens, max_positions(source))
    elif coverage is not None:
        raise GateInputError(f"coverage {coverage!r}: expected 'long' or none")
    prompts = [gr.salted_prompt(tokenizer, q.turns[0], salt) for q in questions]
    key = gr.cache_key(source, workload, questions, limit, max_new_tokens, dtype, device, salt)
    report = GateReport(False, None, target, asdict(rec), workload, limit, max_new_tokens, salt, None, None, SAFETY,
                        None, dtype, device, patch, batch_size)
    cache = Path(cache_dir) if cache_dir is not None else loader.cache_root() / "gate"
    ref = gr.load_cached(key, prompts, cache)
    if ref is None:  # computed before the candidate starts, so the two never hold the weights at the same time
        ref = gr.compute_and_store(lambda: loader.load(target, dtype, device), [q.question_id for q in questions],
                                   prompts, max_new_tokens, key, salt, cache)
    report.epsilon, report.epsilon_floor = epsilon_for(ref.noise, ref.max_abs_logit)
    report.noise, report.reference_cached, report.reference_seconds = ref.noise, ref.cached, ref.seconds
    patch_path = str(Path(patch).resolve()) if patch else None
    candidate = Candidate(_absolute_if_path(target), rec.to_json(), dtype, device, patch_path, timeout_s)
    try:
        _compare(candidate, ref, tokenizer, max_new_tokens, report)
    finally:
        candidate.cleanup()
    report.passed = report.failure is None
    report.seconds = time.perf_counter() - t0
    report.write(out_dir)
    return report


def _tok(tokenizer, t: int) -> dict:
    try:
        text = tokenizer.decode([t])
    except Exception:  # a candidate can answer any integer; the report must still be written
        text = "<not a token id>"
    return {"id": t, "text": text}


def _compare(candidate: Candidate, ref: gr.Reference, tokenizer, max_new_tokens: int, report: GateReport) -> None:
    eps = report.epsilon
    per = [{"question_id": q.question_id, "prompt_tokens": len(q.prompt), "reference_tokens": len(q.tokens),
            "reference_finish": q.finish_reason, "checked": 0, "exact_matches": 0, "ties": 0, "status": "not checked",
            "candidate_finish": None} for q in ref.questions]
    report.per_question = per
    failures: dict[int, tuple[dict, str]] = {}
    try:
        rows, reasons = candidate.run([q.prompt for q in ref.questions], max_new_tokens)
        work = [(i, 0, rows[i], reasons[i]) for i in range(len(rows))]
        while work:
            i, offset, tokens, finish = work.pop(0)
            q, st = ref.questions[i], per[i]
            v = judge(q, offset, tokens, eps)
            st["exact_matches"] += v.exact
            st["checked"] += v.exact + (v.kind in ("tie", "diverged"))
            st["candidate_finish"] = finish
            if v.kind == "tie":
                st["ties"] += 1
                r = q.tokens[v.position]
                report.ties.append({"question_id": q.question_id, "position": v.position,
                                    "reference_token": _tok(tokenizer, r),
                                    "candidate_token": _tok(tokenizer, v.candidate_token), "margin": v.margin})
                nxt = v.position + 1
                if nxt < len(q.tokens):  # force the reference token and let the candidate go on from there
                    [row], [why] = candidate.run([q.prompt + q.tokens[:nxt]], max_new_tokens - nxt)
                    work.insert(0, (i, nxt, row, why))
                    continue
                st["status"] = "pass"
            elif v.kind == "done":
                st["status"] = "pass"
            else:
                st["status"] = "fail"
                failures[i] = _failure(q, v, finish, eps, tokenizer)
    except CandidateFailure as e:
        tail = e.stderr_tail.strip()
        last = tail.splitlines()[-1][-300:] if tail else ""
        if e.kind != "crashed":
            reason = e.message
        elif not last:
            reason = f"{e.message} (no output on stderr)"  # e.g. "candidate crashed: killed by SIGSEGV (...)"
        elif "killed by" in e.message:
            reason = f"{e.message}: {last}"
        else:
            reason = f"candidate crashed: {last}"  # a Python exception's own last line says what happened
        report.failure, report.reason = {"kind": e.kind, "message": e.message, "stderr_tail": e.stderr_tail}, reason
    report.tokens_checked = sum(s["checked"] for s in per)
    report.exact_matches = sum(s["exact_matches"] for s in per)
    if report.failure is None and failures:
        report.failure, report.reason = failures[min(failures)]


def _failure(q: gr.QuestionRef, v: Verdict, finish: str, eps: float, tokenizer) -> tuple[dict, str]:
    pos, qid = v.position, q.question_id
    ctx = (q.prompt + q.tokens[:pos])[-CONTEXT_TOKENS:]
    f = {"kind": v.kind if v.kind != "diverged" else "divergence", "question_id": qid, "position": pos,
         "context": tokenizer.decode(ctx), "context_tokens": ctx, "reference_length": len(q.tokens),
         "reference_finish": q.finish_reason, "candidate_finish": finish, "epsilon": eps}
    if v.kind == "diverged":
        r, c = _tok(tokenizer, q.tokens[pos]), _tok(tokenizer, v.candidate_token)
        f.update(reference_token=r, candidate_token=c, margin=v.margin,
                 margin_kind="exact" if v.margin_exact else "> top-8 gap")
        m = f"{v.margin:.4g}" if v.margin_exact else f"> {v.margin:.4g} (candidate token not in the stock top-8)"
        return f, (f"question {qid}: diverged at token {pos}: reference {r['text']!r} ({r['id']}) vs candidate "
                   f"{c['text']!r} ({c['id']}), margin {m} > epsilon {eps:.3g}")
    if v.kind == "truncated":
        return f, f"question {qid}: truncated at {pos} of {len(q.tokens)} tokens"
    end = f"EOS at token {len(q.tokens) - 1}" if q.finish_reason == "eos" else f"max_new_tokens {len(q.tokens)}"
    return f, f"question {qid}: ran past the reference's end ({end})"
