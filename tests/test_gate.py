"""The token-forcing gate: correct recipes pass, deliberately broken candidates fail for the right reason, ties are
forced, candidate crashes and timeouts fail, bad inputs are errors (exit 2), and epsilon covers the logit spread of
the kernel shapes a correct candidate uses (batch 4, k+1-token verification) on SmolLM2-135M in fp32."""
from __future__ import annotations

import hashlib
import json
from itertools import product
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import SMOLLM2_VOCAB, build_tiny_hf
from specpilot.engine.decode import cache_length
from specpilot.cli import main
from specpilot.tools.gate import reference as gr
from specpilot.tools.gate.check import Verdict, _compare, check, judge
from specpilot.tools.gate.report import GateReport

BROKEN = Path(__file__).parent / "broken_candidates"
SALT = "0123456789abcdef"  # shared by the tiny matrix: one reference, read from the cache by every other check
SMOL_SALT = "fedcba9876543210"
WORKLOAD, LIMIT, NEW = "summarize", 2, 24
DRAFTERS, KS, BATCHES = ("ngram", "layerskip", "model"), (1, 4, 8), (1, 4)


def _tiny_dir(root: Path, name: str, tokenizer, seed: int, layers: int, hidden: int) -> Path:
    """A random Llama with SmolLM2's vocabulary and tokenizer. Tied embeddings and std 0.1 make it repeat itself
    now and then (so drafts are sometimes accepted, sometimes rejected) while its margins stay far above the noise."""
    model = build_tiny_hf("LlamaConfig", seed=seed, std=0.1, vocab_size=SMOLLM2_VOCAB, hidden_size=hidden,
                          intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
    path = root / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    tokenizer = gr.load_tokenizer(gr.model_source("smollm2-135m"))
    target = _tiny_dir(root, "target", tokenizer, seed=0, layers=2, hidden=64)
    draft = _tiny_dir(root, "draft", tokenizer, seed=1, layers=1, hidden=32)
    recipes = root / "recipes"
    recipes.mkdir()
    for d, k in product(DRAFTERS, KS):
        spec = {"ngram": {"kind": "ngram"}, "layerskip": {"kind": "layerskip", "layers": 1},
                "model": {"kind": "model", "model": str(draft)}}[d]
        (recipes / f"{d}-k{k}.json").write_text(json.dumps({"name": f"{d}-k{k}", "drafter": spec, "k": k}))
    return SimpleNamespace(root=root, target=str(target), recipes=recipes, cache=root / "cache")


def run(env, name: str, recipe: str, **kw) -> GateReport:
    kw.setdefault("salt", SALT)
    return check(env.target, recipe, WORKLOAD, LIMIT, NEW, "cpu", "fp32", env.root / "out" / name,
                 cache_dir=env.cache, timeout_s=300, **kw)


BROKEN_CASES = {  # patch -> (recipe, expected failure kind)
    "accept_all": ("layerskip-k4", "divergence"),  # a layer-skip drafter always proposes k drafts
    "verify_with_layerskip": ("stock", "divergence"),
    "truncate": ("stock", "truncated"),
    "temperature": ("stock", "divergence"),
    "kv_off_by_one": ("layerskip-k4", "divergence"),  # drafts every step: rejections every few steps
}


@pytest.fixture(scope="module")
def tiny_reports(env):
    """Every tiny-model check: the passing matrix and the broken candidates. One after another: two candidates at
    once on two cores (each with its own intra-op threads) took several times longer than in turn."""
    jobs = {f"{d}-k{k}-B{b}": dict(recipe=str(env.recipes / f"{d}-k{k}.json"), batch_size=b)
            for d, k, b in product(DRAFTERS, KS, BATCHES)}
    for patch, (recipe, _) in BROKEN_CASES.items():
        path = recipe if recipe == "stock" else str(env.recipes / f"{recipe}.json")
        jobs[patch] = dict(recipe=path, patch=str(BROKEN / f"{patch}.py"))
    return {name: run(env, name, **kw) for name, kw in jobs.items()}  # the first computes and caches the reference


@pytest.mark.parametrize("drafter,k,batch", list(product(DRAFTERS, KS, BATCHES)))
def test_correct_recipe_passes(tiny_reports, drafter, k, batch):
    rep = tiny_reports[f"{drafter}-k{k}-B{batch}"]
    assert rep.passed, rep.reason
    assert rep.failure is None and rep.reason is None and rep.salt == SALT
    assert rep.recipe["k"] == k and rep.recipe["batch"]["max_batch_size"] == batch
    assert rep.tokens_checked == sum(q["reference_tokens"] for q in rep.per_question) == LIMIT * NEW
    assert rep.exact_matches + len(rep.ties) == rep.tokens_checked
    assert 0 < rep.epsilon < 1e-3 and rep.epsilon >= 4 * rep.noise


def test_matrix_shares_one_cached_reference(tiny_reports):
    cached = [r.reference_cached for r in tiny_reports.values()]
    assert cached.count(False) == 1
    assert len({r.epsilon for r in tiny_reports.values()}) == 1


@pytest.mark.parametrize("patch", list(BROKEN_CASES))
def test_broken_candidate_fails(tiny_reports, env, patch):
    rep, kind = tiny_reports[patch], BROKEN_CASES[patch][1]
    assert not rep.passed
    f = rep.failure
    assert f["kind"] == kind, rep.reason
    if kind == "divergence":
        assert "diverged at token" in rep.reason
        assert f["margin"] > rep.epsilon
        assert f["reference_token"]["id"] != f["candidate_token"]["id"]
        assert f["context"] and f["question_id"]
    else:
        assert rep.reason.endswith(f"truncated at {NEW // 2} of {NEW} tokens")
    saved = json.loads((env.root / "out" / patch / "report.json").read_text())
    assert saved["passed"] is False and saved["failure"]["kind"] == kind
    assert (env.root / "out" / patch / "summary.txt").read_text().startswith("specpilot check: FAIL")


def test_replayed_outputs_fail_under_a_fresh_salt(env):
    replay_file = Path("/tmp") / \
        f"specpilot-replay-{hashlib.sha256(str(Path(env.target).resolve()).encode()).hexdigest()[:16]}.json"
    replay_file.unlink(missing_ok=True)
    try:
        first = run(env, "replay-1", "stock", salt=None, patch=str(BROKEN / "replay_cache.py"))
        assert not replay_file.exists()  # the sandbox kept the candidate from recording its outputs
        # Salting must hold even where files could be left behind (a sandbox without namespaces): plant the first
        # run's outputs (its salted reference, from the gate's cache) where the candidate looks for them.
        [ref] = [r for r in map(json.loads, (p.read_text() for p in env.cache.glob("*.json")))
                 if r.get("salt") == first.salt]
        replay_file.write_text(json.dumps([q["tokens"] for q in ref["questions"]]))
        second = run(env, "replay-2", "stock", salt=None, patch=str(BROKEN / "replay_cache.py"))
    finally:
        replay_file.unlink(missing_ok=True)
    assert first.salt != second.salt
    assert first.passed, first.reason  # it really decoded the first time
    assert not second.passed and second.failure["kind"] == "divergence"
    assert second.failure["margin"] > second.epsilon


def test_candidate_killed_by_a_signal_is_named(env, tmp_path):
    patch = tmp_path / "segv.py"
    patch.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    report = run(env, "segv", "stock", patch=str(patch))
    assert not report.passed and report.failure["kind"] == "crashed"
    assert "killed by SIGSEGV" in report.reason, report.reason


@pytest.mark.parametrize("launcher", ["fork", "subprocess"])
def test_candidate_crash_is_a_failure(env, tmp_path, capsys, monkeypatch, launcher):
    """Exit 1 with the crash's stderr, whether the worker is forked (default) or a fresh `python -m` process."""
    monkeypatch.setenv("SPECPILOT_GATE_LAUNCH", launcher)
    patch = tmp_path / "crash.py"
    patch.write_text("raise RuntimeError('boom from the patch')\n")
    code = main(["check", "--target", env.target, "--recipe", "stock", "--workload", WORKLOAD, "--limit", "1",
                 "--max-new-tokens", "4", "--device", "cpu", "--patch", str(patch), "--salt", SALT,
                 "--cache-dir", str(env.cache), "--out", str(tmp_path / "out")])
    assert code == 1
    out = capsys.readouterr().out
    assert "FAIL: candidate crashed: RuntimeError: boom from the patch" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["failure"]["kind"] == "crashed" and "boom" in report["failure"]["stderr_tail"]


def test_candidate_output_cannot_corrupt_the_protocol(env, tmp_path):
    """What the candidate prints (Python or C level) goes to its stderr, not into the answers."""
    patch = tmp_path / "noisy.py"
    patch.write_text("import os\nprint('[1, 2, 3]')\nos.write(1, b'{\"id\": 0, \"tokens\": [[5]]}\\n')\n")
    rep = check(env.target, "stock", WORKLOAD, 1, 4, "cpu", "fp32", tmp_path / "out", salt=SALT, patch=str(patch),
                cache_dir=env.cache)
    assert rep.passed, rep.reason


def test_candidate_timeout_is_a_failure(env, tmp_path):
    patch = tmp_path / "hang.py"
    patch.write_text("import time\ntime.sleep(600)\n")
    rep = check(env.target, "stock", WORKLOAD, 1, 4, "cpu", "fp32", tmp_path / "out", salt=SALT, patch=str(patch),
                cache_dir=env.cache, timeout_s=2)
    assert not rep.passed and rep.failure["kind"] == "timed_out"
    assert rep.reason.startswith("candidate timed out")


def test_recipe_the_candidate_cannot_build_is_a_failure(env, tmp_path, tiny_model_dir):
    """A draft model with another vocabulary: the candidate reports it at startup; that is a verdict (exit 1)."""
    recipe = tmp_path / "mismatch.json"
    recipe.write_text(json.dumps({"drafter": {"kind": "model", "model": str(tiny_model_dir("llama"))}, "k": 2}))
    rep = check(env.target, str(recipe), WORKLOAD, 1, 4, "cpu", "fp32", tmp_path / "out", salt=SALT,
                cache_dir=env.cache)
    assert not rep.passed and rep.failure["kind"] == "startup"
    assert rep.reason.startswith("candidate could not start: vocabulary mismatch")


@pytest.mark.parametrize("args", [
    ["--workload", "no-such-workload"], ["--recipe", "missing-recipe.json"], ["--target", "/no/such/model"],
    ["--patch", "/no/such/patch.py"], ["--limit", "0"], ["--dtype", "fp8"], ["--batch-size", "0"],
    ["--recipe", "MISSING_DRAFT_MODEL"]])
def test_bad_inputs_exit_2(env, tmp_path, capsys, args):
    if "MISSING_DRAFT_MODEL" in args:
        recipe = tmp_path / "r.json"
        recipe.write_text(json.dumps({"drafter": {"kind": "model", "model": "/no/such/draft"}, "k": 2}))
        args = ["--recipe", str(recipe)]
    base = {"--target": env.target, "--recipe": "stock", "--workload": WORKLOAD, "--limit": "1", "--device": "cpu"}
    base.update(zip(args[::2], args[1::2]))
    argv = ["check", *[x for kv in base.items() for x in kv], "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specpilot: error:") and "\n" not in err


# -- the tie rule, on a synthetic reference -------------------------------------------------------------------------
def _ref(tokens, margins, finish="length"):
    """Reference whose top-8 at position p is the reference token at 5.0, token 99 at 5.0 - margins[p], then 6 more."""
    top = [[[t, 5.0], [99, 5.0 - m]] + [[90 + j, 1.0 - j] for j in range(6)] for t, m in zip(tokens, margins)]
    return gr.QuestionRef("q0", [1, 2, 3], list(tokens), finish, top, [5.0] * len(tokens))


class FakeCandidate:
    def __init__(self, answers):
        self.answers, self.jobs = list(answers), []

    def run(self, prompts, max_new_tokens):
        self.jobs.append((prompts, max_new_tokens))
        return self.answers.pop(0), ["length"] * len(prompts)


class FakeTokenizer:
    def decode(self, ids):
        return " ".join(f"<{i}>" for i in ids)


def _compare_with(ref, answers, eps=1e-5):
    rep = GateReport(False, None, "t", {}, "w", 1, 4, "s", eps, eps / 4, 4.0, 0.0, "fp32", "cpu")
    fake = FakeCandidate(answers)
    _compare(fake, gr.Reference("k", "s", [ref], eps / 4, 5.0, False, 0.0), FakeTokenizer(), 4, rep)
    return rep, fake


def test_tie_is_forced_and_comparison_goes_on():
    ref = _ref([10, 11, 12, 13], [1.0, 1.0, 1e-6, 1.0])
    rep, fake = _compare_with(ref, [[[10, 11, 99, 50]], [[13]]])
    assert rep.failure is None and rep.tokens_checked == 4 and rep.exact_matches == 3
    assert rep.ties == [{"question_id": "q0", "position": 2, "reference_token": {"id": 12, "text": "<12>"},
                         "candidate_token": {"id": 99, "text": "<99>"}, "margin": pytest.approx(1e-6)}]
    assert fake.jobs[1] == ([[1, 2, 3, 10, 11, 12]], 1)  # teacher-forced on the reference prefix


def test_divergences_truncation_and_overrun():
    ref = _ref([10, 11, 12, 13], [1.0, 1e-3, 1.0, 1.0], finish="eos")
    assert judge(ref, 0, [10, 99], 1e-5) == Verdict("diverged", 1, 1, 99, pytest.approx(1e-3), True)
    assert judge(ref, 0, [10, 11, 77], 1e-5) == Verdict("diverged", 2, 2, 77, 9.0, False)
    rep, _ = _compare_with(ref, [[[10, 11, 77]]])
    assert rep.failure["margin_kind"] == "> top-8 gap" and "not in the stock top-8" in rep.reason
    assert rep.failure["context"] == "<1> <2> <3> <10> <11>"
    rep, _ = _compare_with(ref, [[[10, 11]]])
    assert rep.reason == "question q0: truncated at 2 of 4 tokens"
    rep, _ = _compare_with(ref, [[[10, 11, 12, 13, 5]]])
    assert rep.reason == "question q0: ran past the reference's end (EOS at token 3)"


# -- SmolLM2-135M ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A passing `stock` check through the CLI (it computes and caches the reference the other tests reuse)."""
    root = tmp_path_factory.mktemp("gate-smol")
    argv = ["check", "--target", "smollm2-135m", "--recipe", "stock", "--workload", "code", "--limit", "2",
            "--max-new-tokens", "24", "--device", "cpu", "--dtype", "fp32", "--salt", SMOL_SALT,
            "--cache-dir", str(root / "cache"), "--out", str(root / "stock")]
    return SimpleNamespace(root=root, code=main(argv),
                           report=json.loads((root / "stock" / "report.json").read_text()))


def test_smollm2_stock_passes(smol):
    assert smol.code == 0, smol.report["reason"]
    r = smol.report
    assert r["passed"] and r["tokens_checked"] == r["exact_matches"] + len(r["ties"]) > 0
    assert r["epsilon"] == pytest.approx(max(4 * r["noise"], r["epsilon_floor"]))
    assert (smol.root / "stock" / "summary.txt").read_text().startswith("specpilot check: PASS")


def test_smollm2_broken_candidate_fails(smol):
    rep = check("smollm2-135m", "stock", "code", 2, 24, "cpu", "fp32", smol.root / "broken", salt=SMOL_SALT,
                patch=str(BROKEN / "accept_all.py"), cache_dir=smol.root / "cache")
    assert rep.reference_cached
    assert not rep.passed and rep.failure["kind"] == "divergence" and rep.failure["margin"] > rep.epsilon


# -- epsilon against the kernel shapes of correct candidates (SmolLM2-135M, fp32, CPU) ------------------------------
def _ops():
    from specpilot.kernels import resolve
    from specpilot.kernels.builtin import attention_sdpa

    step = resolve()
    return step._replace(attention=attention_sdpa), step  # the Decoder's prefill and step kernels


def batched_step_logits(model, prompts, refs, n, max_len):
    """Row 0's logits when len(prompts) rows decode together: one ragged prefill, then 1-token steps per row."""
    prefill, step = _ops()
    B, longest = len(prompts), max(map(len, prompts))
    cache = model.new_cache(B, max_len)
    padded = torch.zeros(B, longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    rows = [model(padded, torch.arange(longest)[None].expand(B, longest), cache, logits_at=(lengths - 1)[:, None],
                  ops=prefill)[0, 0]]
    for j in range(n - 1):
        tokens = torch.tensor([[r[j] if j < len(r) else 0] for r in refs])
        rows.append(model(tokens, (lengths + j)[:, None], cache, ops=step)[0, 0])
    return torch.stack(rows).float()


def verify_logits(model, prefilled, first, ref, k, n, L):
    """The logits of chain verification with every draft accepted: after the prompt's prefill (`prefilled`, its
    last row `first`), one forward of [last, d_1..d_k] at a time."""
    cache = model.new_cache(1, prefilled.max_len)
    cache.k.copy_(prefilled.k)
    cache.v.copy_(prefilled.v)
    rows, j = [first], 0
    while len(rows) < n:
        chunk = (ref[j: j + k + 1] + [0] * (k + 1))[: k + 1]
        rows += list(model(torch.tensor([chunk]), torch.arange(L + j, L + j + k + 1)[None], cache, ops=_ops()[1])[0])
        j += k + 1
    return torch.stack(rows[:n]).float()


def shape_spreads(model, questions: list[gr.QuestionRef], n: int) -> dict[str, float]:
    """max |logit(shape) - logit(one teacher-forced forward)| over the first n positions of questions[0], for the
    shapes a correct candidate decodes with: batch 4 and k+1-token verification (k = 1, 4, 8)."""
    q, prefill = questions[0], _ops()[0]
    max_len, L = cache_length(len(q.prompt), NEW, k=0), len(q.prompt)
    with torch.inference_mode():
        ref = gr.forward_logits(model, q.prompt, q.tokens[:n], max_len, prefill)
        others = [questions[i % len(questions)] for i in range(1, 4)]
        out = {"batch4": batched_step_logits(model, [q.prompt] + [o.prompt for o in others],
                                             [q.tokens] + [o.tokens for o in others], n, max_len)}
        cache = model.new_cache(1, max_len)
        first = model(torch.tensor([q.prompt]), torch.arange(L)[None], cache, logits_at=torch.tensor([[L - 1]]),
                      ops=prefill)[0, 0]
        out |= {f"verify_k{k}": verify_logits(model, cache, first, q.tokens, k, n, L) for k in KS}
        return {name: (x - ref).abs().max().item() for name, x in out.items()}


def test_epsilon_covers_batch_and_verification_shapes(smol):
    """A correct candidate picks c over r when its own logits say so; the gate's margin F(r) - F(c) is then at most
    2 max |logits - F|. So epsilon must be at least twice each shape's spread: measured here, not assumed."""
    from specpilot.engine.loader import load
    from specpilot.engine.workloads import load_workload

    source = gr.model_source("smollm2-135m")
    questions = load_workload("code", 2)
    tokenizer = gr.load_tokenizer(source)
    prompts = [gr.salted_prompt(tokenizer, q.turns[0], SMOL_SALT) for q in questions]
    key = gr.cache_key(source, "code", questions, 2, NEW, "fp32", "cpu", SMOL_SALT)
    ref = gr.load_cached(key, prompts, smol.root / "cache")  # the one the stock check computed
    assert ref is not None
    spreads = shape_spreads(load("smollm2-135m", "fp32", "cpu").model, ref.questions, n=16)
    epsilon = smol.report["epsilon"]
    print(f"noise {ref.noise:.3g}, epsilon {epsilon:.3g}, spreads {spreads}")
    assert all(2 * s <= epsilon for s in spreads.values()), (epsilon, spreads)


# -- coverage: long inputs (issue 19, item 4) ---------------------------------------------------------------------

# A candidate kernel wrong only where the gate's short questions never go: attention over a cache past 8,192
# positions, and any linear in a forward of more than 256 tokens (a long prefill).
WRONG_PAST_8192 = '''import torch
from specpilot.kernels.builtin import attention_math


def attention(q, k, v, mask):
    out = attention_math(q, k, v, mask)
    return torch.zeros_like(out) if k.shape[-2] > 8192 else out
'''
WRONG_PREFILL_PAST_256 = '''import torch.nn.functional as F


def linear(x, w, b=None):
    out = F.linear(x, w, b)
    if x.dim() == 3 and x.shape[1] > 256:
        out = out.clone()
        out[:, 256:] = 0
    return out
'''
LONG_NEW = 4


@pytest.fixture(scope="module")
def long_env(tmp_path_factory):
    """A tiny Llama whose positions reach past 8,192 (16,384), so the long-context case exceeds 8,192 tokens."""
    root = tmp_path_factory.mktemp("gate-long")
    model = build_tiny_hf("LlamaConfig", seed=0, std=0.1, vocab_size=SMOLLM2_VOCAB, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=16384, tie_word_embeddings=True, bos_token_id=None,
                          eos_token_id=None, pad_token_id=None)
    model.save_pretrained(root / "target")
    gr.load_tokenizer(gr.model_source("smollm2-135m")).save_pretrained(root / "target")
    recipes = {}
    for name, slot, src in (("stock", None, None), ("past8192", "attention", WRONG_PAST_8192),
                            ("prefill256", "linear", WRONG_PREFILL_PAST_256)):
        body = {"name": name, "drafter": {"kind": "ngram"}, "k": 4}
        if slot:
            (root / f"{name}.py").write_text(src)
            body["kernels"] = {slot: str(root / f"{name}.py")}
        (root / f"{name}.json").write_text(json.dumps(body))
        recipes[name] = str(root / f"{name}.json")

    def gate(name: str, coverage: str | None) -> GateReport:
        return check(str(root / "target"), recipes[name], "code", 2, LONG_NEW, "cpu", "fp32",
                     root / "out" / f"{name}-{coverage}", salt=SALT, batch_size=1, timeout_s=300,
                     cache_dir=root / "cache", coverage=coverage)
    return gate


def test_long_cases_reach_past_8192_and_256_tokens(long_env):
    rep = long_env("stock", "long")
    assert rep.passed, rep.reason
    lengths = {q["question_id"]: q["prompt_tokens"] for q in rep.per_question}
    assert lengths["long-context"] > 8192 and 256 < lengths["long-prefill"] < 1024, lengths


@pytest.mark.parametrize("name", ["past8192", "prefill256"])
def test_kernel_wrong_only_on_long_inputs_fails_the_long_cases(long_env, name):
    short = long_env(name, None)  # the workload's own questions: short prompts, short contexts
    assert short.passed, short.reason
    rep = long_env(name, "long")
    assert not rep.passed and rep.failure["kind"] == "divergence", rep.reason
    # a kernel wrong past 8,192 cache slots: the long-context case needs them, and with it in the call every
    # request's cache has them (continuous batching sizes the cache for the call's longest prompt), so the first
    # long case may already diverge
    expected = {"long-context", "long-prefill"} if name == "past8192" else {"long-prefill"}
    assert rep.failure["question_id"] in expected, rep.failure


def test_long_questions_respect_the_models_positions():
    from specpilot.engine.workloads import load_workload
    from specpilot.tools.gate.check import long_questions

    tok = gr.load_tokenizer(gr.model_source("smollm2-135m"))
    qs = load_workload("code", 1)
    for positions, expect_context in ((16384, True), (8192, True), (300, False)):
        long = long_questions(tok, qs, SALT, 16, positions)
        lens = {q.question_id: len(gr.salted_prompt(tok, q.turns[0], SALT)) for q in long}
        assert ("long-context" in lens) == expect_context, lens
        if positions >= 8192:
            assert lens["long-prefill"] > 256 and lens["long-context"] + 16 + 8 < positions, lens
        if positions > 8192 + 256:
            assert lens["long-context"] > 8192, lens
