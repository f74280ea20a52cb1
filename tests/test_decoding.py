"""Decoding: greedy output equals HF's, speculative decoding is lossless (greedy: token-identical; sampling: same
distribution), ragged batches decode each row as if alone, and stop conditions cut exactly where they should."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from conftest import SMOLLM2_VOCAB, TINY_VOCAB, load_pair
from specpilot.engine.decode import Decoder, StopCondition
from specpilot.engine.drafters import Drafter, ModelDrafter, Proposal
from specpilot.engine.engine import Engine
from specpilot.engine.errors import SpecPilotError
from specpilot.engine.loader import load
from specpilot.engine.recipe import load_recipe, parse
from specpilot.engine.sampling import SamplingParams

KS = (1, 4, 8)
DRAFTERS = ("ngram", "layerskip", "model")


def recipe_for(drafter: str, k: int, layers: int = 1, draft_path: str = "draft", **extra):
    spec = {"ngram": {"kind": "ngram"}, "layerskip": {"kind": "layerskip", "layers": layers},
            "model": {"kind": "model", "model": draft_path}}[drafter]
    return parse({"drafter": spec, "k": k, "cuda_graphs": False, **extra})


def hf_greedy(hf, prompt: list[int], n: int, stop_at_eos: bool) -> list[int]:
    """HF's greedy continuation (new tokens only). Without EOS stopping it runs exactly n tokens."""
    ids = torch.tensor([prompt])
    kwargs = {} if stop_at_eos else {"eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


# -- tiny models: HF parity and the exactness matrix --------------------------------------------------------------
TINY_NEW = 32


def tiny_prompts() -> list[list[int]]:
    """Three prompts of different lengths; each repeats a random motif so an n-gram drafter finds matches."""
    g = torch.Generator().manual_seed(11)
    out = []
    for motif_len, reps in ((7, 3), (9, 1), (6, 5)):
        motif = torch.randint(0, TINY_VOCAB, (motif_len,), generator=g).tolist()
        out.append(motif * reps)
    return out  # lengths 21, 9, 30


@pytest.fixture(scope="session")
def tiny_reference(tiny):
    """HF's greedy continuation of each tiny prompt (never stopping at EOS): the ground truth for `tiny`."""
    return [hf_greedy(tiny.hf, p, TINY_NEW, stop_at_eos=False) for p in tiny_prompts()]


def test_tiny_ar_matches_hf_generate(tiny, tiny_reference):
    eng = Engine(tiny.loaded, load_recipe("ar"))
    prompts = tiny_prompts()
    for p, ref in zip(prompts, tiny_reference):
        (r,) = eng.generate([p], TINY_NEW, ignore_eos=True)
        assert len(ref) == TINY_NEW
        assert r.tokens == ref, tiny.family
        assert r.finish_reason == "length" and r.accepted == [0] * (TINY_NEW - 1)
    # the same prompts as one ragged batch: every row as if alone
    rows = eng.generate(prompts, TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference


@pytest.mark.parametrize("B", (1, 3))
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_tiny_speculative_greedy_is_exact(tiny, tiny_reference, tiny_draft, drafter, k, B):
    eng = Engine(tiny.loaded, recipe_for(drafter, k), draft=tiny_draft if drafter == "model" else None)
    assert eng.decoder.k == k and eng.decoder.drafter.name == drafter
    prompts = tiny_prompts()
    idx = [0, 1, 2] if B == 3 else [2]
    rows = eng.generate([prompts[i] for i in idx], TINY_NEW, ignore_eos=True)
    for i, r in zip(idx, rows):
        assert r.tokens == tiny_reference[i], (tiny.family, drafter, k, i)
        assert r.finish_reason == "length"
        assert all(0 <= a <= k for a in r.accepted)
        # tokens come from prefill (1) plus (accepted + 1) per step; the last step may be cut at the limit
        assert 1 + sum(a + 1 for a in r.accepted[:-1]) < TINY_NEW <= 1 + sum(a + 1 for a in r.accepted)


@pytest.mark.parametrize("drafter,k,adaptive", [(None, 0, False), ("ngram", 4, False), ("model", 8, False),
                                                ("ngram", 4, True)])
def test_tiny_overlap_changes_no_token(tiny, tiny_reference, tiny_draft, drafter, k, adaptive):
    """With the host one step behind the device, rows that finish early take part in one extra step; their output,
    stop reasons and acceptance counts must be those of the plain loop (with an adaptive draft length too: the
    budget lives on the device)."""
    def recipe(**extra):
        if not drafter:
            return parse(extra) if extra else load_recipe("ar")
        r = recipe_for(drafter, k, **extra)
        r.drafter.adaptive = adaptive
        return r

    eng = Engine(tiny.loaded, recipe(overlap=True), draft=tiny_draft if drafter == "model" else None)
    assert eng.decoder.overlap and eng.decoder.adaptive_drafts == adaptive
    plain = Engine(tiny.loaded, recipe(), draft=tiny_draft if drafter == "model" else None)
    for n in (5, TINY_NEW):
        rows = eng.generate(tiny_prompts(), n, ignore_eos=True)
        assert [r.tokens for r in rows] == [ref[:n] for ref in tiny_reference]
        base = plain.generate(tiny_prompts(), n, ignore_eos=True)
        assert [(r.accepted, r.finish_reason) for r in rows] == [(r.accepted, r.finish_reason) for r in base]


@pytest.mark.parametrize("drafter,k", [(None, 0), ("ngram", 4), ("model", 4)])
def test_tiny_prompts_padded_to_the_prefill_width_change_no_token(tiny, tiny_reference, tiny_draft, drafter, k):
    """With CUDA graphs, prompts are right-padded to a bucket width (one prefill graph a width) and the batch to a
    bucket size (here 3 rows to 4, one dead): the pad slots (here up to 64 - 9 = 55 of them) and the dead row must
    change no token of any row, with or without a drafter that prefills its own cache from the padded prompts."""
    recipe = recipe_for(drafter, k) if drafter else load_recipe("ar")
    eng = Engine(tiny.loaded, recipe, draft=tiny_draft if drafter == "model" else None)
    eng.decoder.bucketed = True  # as with CUDA graphs (the CPU prefills eagerly either way)
    widths = []
    forward = eng.decoder.model.forward
    eng.decoder.model.forward = lambda tokens, *a, **kw: widths.append(tokens.shape) or forward(tokens, *a, **kw)
    try:
        for rows in (tiny_prompts(), tiny_prompts()[1:2]):
            out = eng.generate(rows, TINY_NEW, ignore_eos=True)
            want = tiny_reference if len(rows) == 3 else tiny_reference[1:2]
            assert [r.tokens for r in out] == want, drafter
    finally:
        eng.decoder.model.forward = forward
    assert (4, 64) in widths and (1, 64) in widths  # the prefills ran at the padded width and batch size
    assert all(w[1] not in (9, 30) for w in widths)


def test_tiny_max_batch_size_splits_without_changing_output(tiny, tiny_reference):
    eng = Engine(tiny.loaded, recipe_for("ngram", 4, batch={"max_batch_size": 2}))
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference


def test_tiny_engine_reuse_across_batches(tiny, tiny_reference, tiny_draft):
    """One engine, several generate calls of different batch sizes and lengths (cache and drafter cache reuse)."""
    eng = Engine(tiny.loaded, recipe_for("model", 4), draft=tiny_draft)
    prompts = tiny_prompts()
    for order in ([2], [0, 1, 2], [1], [2, 0, 1], [0, 1, 2]):
        rows = eng.generate([prompts[i] for i in order], TINY_NEW, ignore_eos=True)
        assert [r.tokens for r in rows] == [tiny_reference[i] for i in order]


@pytest.mark.parametrize("k", (1, 4))
def test_tiny_self_draft_accepts_everything(tiny, tiny_reference, k):
    """The target as its own model drafter agrees with itself: every draft accepted (the all-accepted path,
    where the drafter must feed the last two tokens), and still exact."""
    eng = Engine(tiny.loaded, recipe_for("model", k), draft=tiny.loaded)
    (r,) = eng.generate([tiny_prompts()[0]], TINY_NEW, ignore_eos=True)
    assert r.tokens == tiny_reference[0]
    assert r.accepted == [k] * len(r.accepted)
    assert len(r.accepted) == math.ceil((TINY_NEW - 1) / (k + 1))
    assert r.mean_accepted == k + 1


# -- adversarial and oracle drafters ------------------------------------------------------------------------------
class WrongDrafter(Drafter):
    """Always proposes the same token, chosen to never be the target's choice."""

    name = "wrong"

    def __init__(self, token: int):
        self.token = token

    def propose(self, history, lengths, k, sampling, generator):
        B = history.shape[0]
        return Proposal(torch.full((B, k), self.token, dtype=torch.long),
                        torch.full((B,), k, dtype=torch.long))


class OracleDrafter(Drafter):
    """Knows each row's true greedy continuation: proposes `right` correct tokens, then wrong ones, with
    `valid` (default k) of them marked valid."""

    name = "oracle"

    def __init__(self, prompts, truth, right: int, vocab: int, valid: int | None = None):
        self.prompt_lens = [len(p) for p in prompts]
        self.truth, self.right, self.vocab, self.valid = truth, right, vocab, valid

    def propose(self, history, lengths, k, sampling, generator):
        rows = []
        for b, L in enumerate(lengths.tolist()):
            g = L - self.prompt_lens[b]  # index of the next token in the continuation
            true = self.truth[b][g: g + k]
            rows.append([t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(true)])
        valid = k if self.valid is None else self.valid
        return Proposal(torch.tensor(rows), torch.full((len(rows),), valid, dtype=torch.long))


def test_tiny_adversarial_drafter_is_harmless(tiny, tiny_reference):
    prompts = tiny_prompts()
    used = {t for ref in tiny_reference for t in ref}
    bad = next(t for t in range(TINY_VOCAB) if t not in used)
    for k in (1, 5):
        dec = Decoder(tiny.loaded.model, WrongDrafter(bad), k=k, cuda_graphs=False)
        rows = dec.generate(prompts, StopCondition(TINY_NEW, ()))
        assert [r.tokens for r in rows] == tiny_reference
        for r in rows:
            assert r.accepted == [0] * (TINY_NEW - 1) and r.mean_accepted == 1.0


def test_engine_adversarial_drafter_swapped_in(tiny, tiny_reference):
    """The same through an Engine whose drafter is replaced after construction."""
    used = {t for ref in tiny_reference for t in ref}
    bad = next(t for t in range(TINY_VOCAB) if t not in used)
    eng = Engine(tiny.loaded, recipe_for("ngram", 3))
    eng.decoder.drafter = WrongDrafter(bad)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference
    assert all(set(r.accepted) == {0} for r in rows)


@pytest.mark.parametrize("k,right", [(4, 0), (4, 1), (4, 3), (4, 4), (8, 5), (1, 1)])
def test_tiny_oracle_drafter_acceptance_counts(tiny, k, right):
    """With exactly `right` correct drafts per step, every step accepts exactly min(right, k)."""
    prompts = tiny_prompts()
    n = TINY_NEW
    truth = [hf_greedy(tiny.hf, p, n + k + 1, stop_at_eos=False) for p in prompts]
    dec = Decoder(tiny.loaded.model, OracleDrafter(prompts, truth, right, TINY_VOCAB), k=k, cuda_graphs=False)
    rows = dec.generate(prompts, StopCondition(n, ()))
    for r, t in zip(rows, truth):
        assert r.tokens == t[:n]
        assert r.accepted == [min(right, k)] * len(r.accepted)
        assert len(r.accepted) == math.ceil((n - 1) / (min(right, k) + 1))


def test_tiny_oracle_valid_limits_acceptance(tiny):
    """All k drafts are right but only `valid` of them are marked valid: no more than `valid` are accepted."""
    prompts = tiny_prompts()
    k, valid, n = 6, 2, TINY_NEW
    truth = [hf_greedy(tiny.hf, p, n + k + 1, stop_at_eos=False) for p in prompts]
    dec = Decoder(tiny.loaded.model, OracleDrafter(prompts, truth, k, TINY_VOCAB, valid=valid), k=k,
                  cuda_graphs=False)
    rows = dec.generate(prompts, StopCondition(n, ()))
    for r, t in zip(rows, truth):
        assert r.tokens == t[:n] and set(r.accepted) == {valid}


@pytest.mark.parametrize("right,want", [
    (0, [8, 7, 6, 5, 4, 3, 2, 1, 1]),        # every draft rejected: one fewer each step, never below 1
    (3, [8, 7, 6, 5, 4, 3, 5, 4]),           # 3 right: shrinks to 3, all 3 accepted, +2, then back
    (8, [8] * 4),                            # all right: stays at k
])
def test_tiny_adaptive_draft_length(tiny, right, want):
    """`drafter.adaptive`: the drafts a row verifies each step follow the +2 / -1 schedule within 1..k, the target
    sees only them as live tokens, and the output is still the reference."""
    prompts = tiny_prompts()[2:]
    k, n = 8, TINY_NEW
    truth = [hf_greedy(tiny.hf, p, n + k + 1, stop_at_eos=False) for p in prompts]
    dec = Decoder(tiny.loaded.model, OracleDrafter(prompts, truth, right, TINY_VOCAB), k=k, cuda_graphs=False,
                  adaptive_drafts=True)
    live = []
    hook = tiny.loaded.model.register_forward_pre_hook(
        lambda mod, args, kwargs: live.append(int(kwargs["live"].sum()) - 1) if kwargs.get("live") is not None
        else None, with_kwargs=True)
    try:
        [row] = dec.generate(prompts, StopCondition(n, ()))
    finally:
        hook.remove()
    assert row.tokens == truth[0][:n]
    assert live[:len(want)] == want and len(row.accepted) >= len(want)
    assert row.accepted[:len(want)] == [min(right, v) for v in want]


@pytest.mark.parametrize("drafter", ("ngram", "model"))
def test_tiny_adaptive_drafts_are_exact(tiny, tiny_reference, tiny_draft, drafter):
    eng = Engine(tiny.loaded, parse({"drafter": {"kind": drafter, "model": "draft", "adaptive": True} if drafter ==
                                     "model" else {"kind": "ngram", "adaptive": True}, "k": 4, "cuda_graphs": False}),
                 draft=tiny_draft if drafter == "model" else None)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference


class IntermittentDrafter(OracleDrafter):
    """The true continuation (all k right) while the next token's index g is in an even block of `period`, nothing
    (valid 0) in the odd blocks; records what it found at each call."""

    def __init__(self, prompts, truth, vocab: int, period: int):
        super().__init__(prompts, truth, right=10 ** 6, vocab=vocab)
        self.period, self.found = period, []

    def propose(self, history, lengths, k, sampling, generator):
        prop = super().propose(history, lengths, k, sampling, generator)
        g = lengths.tolist()[0] - self.prompt_lens[0]
        prop.valid.fill_(k if (g // self.period) % 2 == 0 else 0)
        self.found.append(int(prop.valid[0]))
        return prop


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_ar_after_miss(tiny, overlap):
    """`drafter.ar_after_miss`: a step is an AR step (the target sees one token) exactly when the drafter found
    nothing at the latest step the host has read (the step before; with overlap the one before that), and verifies
    k drafts otherwise; the drafter still runs in AR steps, and the output is the reference."""
    prompts, k, n = tiny_prompts()[2:], 3, TINY_NEW
    truth = [hf_greedy(tiny.hf, p, n + k + 1, stop_at_eos=False) for p in prompts]
    drafter = IntermittentDrafter(prompts, truth, TINY_VOCAB, period=6)
    dec = Decoder(tiny.loaded.model, drafter, k=k, cuda_graphs=False, overlap=overlap, ar_after_miss=True)
    widths = []
    hook = tiny.loaded.model.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    try:
        [row] = dec.generate(prompts, StopCondition(n, ()))
    finally:
        hook.remove()
    assert row.tokens == truth[0][:n]
    steps = widths[1:]  # after the prefill
    lag = 2 if overlap else 1
    assert len(steps) == len(drafter.found) >= dec.last_stats.steps
    want = [k + 1 if i < lag or drafter.found[i - lag] > 0 else 1 for i in range(len(steps))]
    assert steps == want
    assert dec.last_stats.ar_steps == steps.count(1) > 0 and steps.count(k + 1) > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_ar_after_miss_is_exact(tiny, tiny_reference, overlap):
    """The n-gram drafter with ar_after_miss on the ragged batch of three: every row's tokens are the reference."""
    eng = Engine(tiny.loaded, parse({"drafter": {"kind": "ngram", "adaptive": True, "ar_after_miss": True}, "k": 4,
                                     "cuda_graphs": False, "overlap": overlap}))
    assert eng.decoder.ar_after_miss
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference
    assert 0 < eng.decoder.last_stats.ar_steps < eng.decoder.last_stats.steps


def test_every_kind_of_step_is_captured_before_the_first(tiny, tiny_reference, monkeypatch):
    """With CUDA graphs, each kind of step a decoder may launch (with ar_after_miss: the verification and the AR
    step) is captured before the first step runs, none during decoding, and each step replays the graph of its kind.
    On the CPU, with the capture replaced by a recorder that runs the step eagerly."""
    eng = Engine(tiny.loaded, parse({"drafter": {"kind": "ngram", "ar_after_miss": True}, "k": 3,
                                     "cuda_graphs": False}))
    dec = eng.decoder
    events = []

    class Recorded:
        def __init__(self, st, sampling, drafts_k):
            self.run = lambda: dec._step(st, sampling, drafts_k)
            self.verify = drafts_k > 0

        def replay(self):
            events.append(("replay", self.verify))
            self.run()

    def capture(st, sampling, drafts_k):
        events.append(("capture", drafts_k > 0))
        return Recorded(st, sampling, drafts_k)

    prefill = dec._prefill

    def eager_prefill(*args):  # (the prefill's own graphs need CUDA streams)
        dec.cuda_graphs = False
        try:
            return prefill(*args)
        finally:
            dec.cuda_graphs = True

    monkeypatch.setattr(dec, "_capture", capture)
    monkeypatch.setattr(dec, "_prefill", eager_prefill)
    dec.cuda_graphs = True
    [row] = eng.generate(tiny_prompts()[:1], TINY_NEW, ignore_eos=True)
    assert row.tokens == tiny_reference[0]
    assert [verify for what, verify in events if what == "capture"] == [True, False]
    assert [what for what, _ in events[:3]] == ["capture", "capture", "replay"]  # captured before the first step
    assert {verify for what, verify in events if what == "replay"} == {True, False}  # both kinds of step ran


# -- stop conditions on the tiny models ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", (1, 2, 7, 13))
def test_tiny_length_stop_exact_count_despite_overshooting_steps(tiny, tiny_reference, n):
    eng = Engine(tiny.loaded, recipe_for("model", 8), draft=tiny.loaded)  # accepts all 8: steps overshoot n
    rows = eng.generate(tiny_prompts(), n, ignore_eos=True)
    for r, ref in zip(rows, tiny_reference):
        assert r.finish_reason == "length" and len(r.tokens) == n and r.tokens == ref[:n]


def test_tiny_eos_cut_inside_an_accepted_run(tiny, tiny_reference):
    """An EOS inside a run of accepted drafts ends the row right there; tokens after it in the step are dropped,
    and other rows of the batch go on unaffected."""
    prompts = tiny_prompts()
    ref = tiny_reference[2]
    # an id that rows 0 and 1 never produce, first produced by row 2 in the middle of a self-draft step of 9
    others = set(tiny_reference[0]) | set(tiny_reference[1])
    eos = next(t for i, t in enumerate(ref) if i >= 5 and i % 9 != 0 and t not in others and t not in ref[:i])
    cut = ref.index(eos) + 1
    for drafter, k in ((ModelDrafter(tiny.loaded.model), 8), (None, 0)):
        dec = Decoder(tiny.loaded.model, drafter, k=k, cuda_graphs=False, eos_token_ids=(eos,))
        rows = dec.generate(prompts, StopCondition(TINY_NEW))  # None: the decoder's own EOS ids
        assert rows[2].finish_reason == "eos" and rows[2].tokens == ref[:cut] and rows[2].tokens[-1] == eos
        assert [r.tokens for r in rows[:2]] == tiny_reference[:2]
        assert [r.finish_reason for r in rows[:2]] == ["length", "length"]
        # ignoring EOS: the same decoder runs to the limit
        rows = dec.generate(prompts, StopCondition(TINY_NEW, ()))
        assert rows[2].tokens == ref


def test_tiny_one_token_prompts(tiny, tiny_draft):
    """Prompts of one and two tokens (nothing for the n-gram drafter to match, the model drafter's first feed
    clamped at position 0) decode exactly like HF, with every drafter."""
    prompts = [[5], [200, 17]]
    refs = [hf_greedy(tiny.hf, p, 16, stop_at_eos=False) for p in prompts]
    for drafter in DRAFTERS:
        eng = Engine(tiny.loaded, recipe_for(drafter, 4), draft=tiny_draft if drafter == "model" else None)
        assert [r.tokens for r in eng.generate(prompts, 16, ignore_eos=True)] == refs, drafter


def test_stop_strings_without_tokenizer_is_a_specpilot_error(tiny_model_dir):
    """Stop strings need a tokenizer; a target without one must be refused with a SpecPilotError (the CLI's
    user-facing error), not crash with an AttributeError."""
    loaded = load(str(tiny_model_dir("llama")))
    assert loaded.tokenizer is None
    eng = Engine(loaded, load_recipe("ar"))
    with pytest.raises(SpecPilotError):
        eng.generate([tiny_prompts()[0]], 8, stop_strings=("x",), ignore_eos=True)


def _word_tokenizer(vocab: int, eos: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", unk_token="t0")


def test_stops_at_every_eos_id_of_the_generation_config(tiny_model_dir, tmp_path):
    """Like Llama-3-8B-Instruct: the tokenizer's eos_token is one id, generation_config.json lists several (the
    chat turn ends with another one). HF's generate stops at any of them; so must we."""
    import shutil

    from transformers import GenerationConfig

    src = tiny_model_dir("llama")
    path = tmp_path / "model"
    shutil.copytree(src, path)
    _, hf0 = load_pair(path)
    prompt = tiny_prompts()[0]
    free_run = hf_greedy(hf0, prompt, TINY_NEW, stop_at_eos=False)
    turn_end = free_run[10]  # the model "ends its turn" with this id at the latest at token 11
    eos = next(t for t in range(TINY_VOCAB) if t not in free_run)
    _word_tokenizer(TINY_VOCAB, eos).save_pretrained(path)
    GenerationConfig(eos_token_id=[eos, turn_end], pad_token_id=eos).save_pretrained(path)
    loaded, hf = load_pair(path)
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_id == eos
    ref = hf_greedy(hf, prompt, TINY_NEW, stop_at_eos=True)
    assert ref[-1] == turn_end and len(ref) <= 11
    (r,) = Engine(loaded, load_recipe("ar")).generate([prompt], TINY_NEW)
    why = f"HF stopped at id {turn_end} (listed in generation_config.json's eos_token_id); we did not"
    assert (len(r.tokens), r.finish_reason) == (len(ref), "eos"), why
    assert r.tokens == ref


# -- recipe-level errors through the engine -----------------------------------------------------------------------
def test_vocabulary_mismatch_is_refused(tiny_model_dir):
    target = load(str(tiny_model_dir("llama")))
    small = load(str(tiny_model_dir("llama", seed=5, vocab_size=8, num_hidden_layers=1)))
    with pytest.raises(SpecPilotError, match="vocabulary"):
        Engine(target, recipe_for("model", 4), draft=small)


def test_vocabulary_mismatch_via_recipe_path(tiny_model_dir):
    target = load(str(tiny_model_dir("llama")))
    path = tiny_model_dir("llama", seed=5, vocab_size=8, num_hidden_layers=1)
    with pytest.raises(SpecPilotError, match="vocabulary"):
        Engine(target, recipe_for("model", 4, draft_path=str(path)))


def test_layerskip_needs_fewer_layers_than_target(tiny_model_dir):
    target = load(str(tiny_model_dir("llama")))  # 2 layers
    with pytest.raises(SpecPilotError, match="drafter.layers"):
        Engine(target, recipe_for("layerskip", 4, layers=2))


# -- SmolLM2-135M: parity with HF and exactness on a real model ---------------------------------------------------
CHAT_PROMPTS = ("What is 2+2?", "List the days of the week.", "Write a Python function that returns the sum of a list.")


@pytest.fixture(scope="session")
def smol_chat(smollm2):
    loaded, hf = smollm2
    eng = Engine(loaded, load_recipe("ar"))
    prompts = [eng.encode(t) for t in CHAT_PROMPTS]
    refs = [hf_greedy(hf, p, 64, stop_at_eos=True) for p in prompts]
    return prompts, refs


def test_smollm2_ar_matches_hf_generate(smollm2, smol_chat):
    loaded, _ = smollm2
    eng = Engine(loaded, load_recipe("ar"))
    prompts, refs = smol_chat
    assert any(ref[-1] == 2 and len(ref) < 64 for ref in refs)  # one stops at EOS,
    assert any(len(ref) == 64 for ref in refs)  # one runs to the limit
    rows = eng.generate(prompts, 64)  # as one ragged batch, rows finishing at different steps
    for r, ref in zip(rows, refs):
        assert r.tokens == ref
        assert r.finish_reason == ("eos" if ref[-1] == loaded.tokenizer.eos_token_id else "length")
    assert "4" in rows[0].text and "Monday" in rows[1].text


def test_smollm2_stock_recipe_is_exact(smollm2, smol_chat):
    loaded, _ = smollm2
    eng = Engine(loaded, load_recipe("stock"))
    prompts, refs = smol_chat
    (r,) = eng.generate([prompts[0]], 64)
    assert r.tokens == refs[0] and r.finish_reason == "eos"


SMOL_NEW = 24
SMOL_TEXTS = (("Repeat this sentence five times: I like green apples and red cherries.", True),
              ("The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat", False),
              ("Write the alphabet in capital letters separated by spaces.", True))


@pytest.fixture(scope="session")
def smol_repetitive(smollm2):
    loaded, hf = smollm2
    eng = Engine(loaded, load_recipe("ar"))
    prompts = [eng.encode(t, chat=chat) for t, chat in SMOL_TEXTS]
    assert len({len(p) for p in prompts}) == 3
    return prompts, [hf_greedy(hf, p, SMOL_NEW, stop_at_eos=True) for p in prompts]


@pytest.mark.parametrize("drafter,k,B", [("ngram", 1, 1), ("ngram", 4, 3), ("ngram", 8, 1),
                                         ("layerskip", 4, 1), ("layerskip", 8, 3), ("model", 4, 3)])
def test_smollm2_speculative_greedy_is_exact(smollm2, smol_repetitive, smollm2_draft, drafter, k, B):
    loaded, _ = smollm2
    assert loaded.model.cfg.vocab_size == smollm2_draft.model.cfg.vocab_size == SMOLLM2_VOCAB
    eng = Engine(loaded, recipe_for(drafter, k, layers=10), draft=smollm2_draft if drafter == "model" else None)
    prompts, refs = smol_repetitive
    idx = [0, 1, 2] if B == 3 else [0]
    rows = eng.generate([prompts[i] for i in idx], SMOL_NEW)
    for i, r in zip(idx, rows):
        assert r.tokens == refs[i], (drafter, k, i)
    if drafter == "ngram":
        assert rows[0].mean_accepted > 1.5  # the repeated sentence is found in the prompt and accepted


def test_smollm2_ngram_accepts_on_repetitive_prompt(smollm2, smol_repetitive):
    loaded, _ = smollm2
    prompts, refs = smol_repetitive
    (r,) = Engine(loaded, load_recipe("stock")).generate([prompts[2]], SMOL_NEW)
    assert r.tokens == refs[2]
    assert r.mean_accepted > 2 and max(r.accepted) == 4
    assert len(r.accepted) < len(r.tokens) - 1  # fewer target steps than tokens


def test_smollm2_model_drafter_vocab_mismatch(smollm2, tiny_draft):
    loaded, _ = smollm2
    with pytest.raises(SpecPilotError, match="vocabulary"):
        Engine(loaded, recipe_for("model", 4), draft=tiny_draft)


# -- stop conditions on SmolLM2 (real tokenizer) ------------------------------------------------------------------
def test_smollm2_eos_stop(smollm2, smol_chat):
    loaded, _ = smollm2
    prompts, refs = smol_chat
    eos = loaded.tokenizer.eos_token_id
    for recipe in ("ar", "stock"):
        (r,) = Engine(loaded, load_recipe(recipe)).generate([prompts[0]], 64)
        assert r.finish_reason == "eos" and r.tokens[-1] == eos and eos not in r.tokens[:-1]
        assert len(r.tokens) < 64 and r.tokens == refs[0]
        assert "<|im_end|>" not in r.text  # special tokens are skipped in the text
    # ignore_eos goes on past it
    (r,) = Engine(loaded, load_recipe("ar")).generate([prompts[0]], len(refs[0]) + 3, ignore_eos=True)
    assert r.finish_reason == "length" and r.tokens[: len(refs[0])] == refs[0] and len(r.tokens) == len(refs[0]) + 3


def test_smollm2_length_stop(smollm2, smol_chat):
    loaded, _ = smollm2
    prompts, refs = smol_chat
    for recipe in ("ar", "stock"):
        (r,) = Engine(loaded, load_recipe(recipe)).generate([prompts[1]], 10)
        assert r.finish_reason == "length" and r.tokens == refs[1][:10]


@pytest.mark.parametrize("recipe", ("ar", "stock"))
def test_smollm2_stop_string(smollm2, smol_chat, recipe):
    loaded, _ = smollm2
    prompts, refs = smol_chat
    tok = loaded.tokenizer
    stop = "Wednesday"
    assert stop in tok.decode(refs[1])  # it would be generated
    eng = Engine(loaded, load_recipe(recipe))
    (r,) = eng.generate([prompts[1]], 64, stop_strings=(stop,))
    assert r.finish_reason == "stop"
    assert stop in r.text and len(r.tokens) < 64
    assert stop not in tok.decode(r.tokens[:-1])  # cut at the token that completes it
    assert r.tokens == refs[1][: len(r.tokens)]
    # several stop strings: the earliest one wins; one that never appears changes nothing
    (r2,) = eng.generate([prompts[1]], 64, stop_strings=("Friday", "Tuesday", "no such text"))
    assert r2.finish_reason == "stop" and "Tuesday" in r2.text and "Wednesday" not in r2.text
    (r3,) = eng.generate([prompts[0]], 64, stop_strings=("no such text",))
    assert r3.tokens == refs[0] and r3.finish_reason == "eos"


# -- speculative sampling: the output distribution is the target's ----------------------------------------------
SAMPLE_VOCAB = 8
SAMPLE_PROMPT = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # every token occurs, so the n-gram drafter always proposes


@pytest.fixture(scope="session")
def sampling_models(tiny_model_dir):
    """A vocab-8 target and a different vocab-8 draft model (p != q), with a small init so p is spread out."""
    t_loaded, t_hf = load_pair(tiny_model_dir("llama", seed=21, std=0.08, vocab_size=SAMPLE_VOCAB))
    d_loaded = load(str(tiny_model_dir("llama", seed=22, std=0.08, vocab_size=SAMPLE_VOCAB, num_hidden_layers=1)))
    return t_loaded, t_hf, d_loaded


def next_token_probs(hf, prefixes: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor(prefixes)).logits[:, -1].double().softmax(-1)


def warp(p: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Reference top-k then top-p renormalisation, written independently of the engine's `probabilities`."""
    p = p.clone()
    for row in p.view(-1, p.shape[-1]):
        order = sorted(range(len(row)), key=lambda i: -row[i].item())
        if top_k:
            for i in order[top_k:]:
                row[i] = 0.0
            row /= row.sum()
        if top_p < 1.0:  # keep the smallest prefix of the sorted distribution whose mass reaches top_p
            cum, keep = 0.0, set()
            for i in order:
                keep.add(i)
                cum += row[i].item()
                if cum >= top_p:
                    break
            for i in order:
                if i not in keep:
                    row[i] = 0.0
            row /= row.sum()
    return p


def sequence_distribution(hf, prompt: list[int], length: int, vocab: int, top_k=0, top_p=1.0) -> dict:
    """Exact probability of every continuation of `length` tokens under the (warped) model."""
    dist = {(): 1.0}
    for _ in range(length):
        seqs = list(dist)
        probs = warp(next_token_probs(hf, [prompt + list(s) for s in seqs]), top_k, top_p)
        dist = {s + (t,): dist[s] * probs[i, t].item() for i, s in enumerate(seqs) for t in range(vocab)}
    return dist


def chi_square_pvalue(counts: Counter, expected_probs: dict, n: int) -> tuple[float, float, int]:
    """Pearson's chi-square test of observed counts against probabilities; cells with expected count < 5 are
    pooled into one cell. Returns (statistic, p-value, degrees of freedom)."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, prob in expected_probs.items():
        e = prob * n
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
        else:
            cells.append((counts.get(key, 0), e))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    assert sum(o for o, _ in cells) == n, "a sample fell outside the expected support"
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    try:
        from scipy.stats import chi2

        p = float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty: (X/dof)^(1/3) is approximately normal
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        p = 0.5 * math.erfc(z / math.sqrt(2))
    return stat, p, dof


def sample_sequences(eng: Engine, length: int, n_samples: int, batch: int, sampling: SamplingParams,
                     seed0: int = 1000) -> tuple[Counter, list[int]]:
    counts, accepted = Counter(), []
    for call in range(n_samples // batch):
        rows = eng.generate([SAMPLE_PROMPT] * batch, length, sampling=sampling, seed=seed0 + call,
                            ignore_eos=True)
        for r in rows:
            assert len(r.tokens) == length
            counts[tuple(r.tokens)] += 1
            accepted += r.accepted
    return counts, accepted


ALPHA = 1e-4  # seeds are fixed, so a pass is deterministic; the small alpha leaves room for seed luck


@pytest.mark.parametrize("drafter,k,top_k,top_p", [("model", 4, 0, 1.0), ("ngram", 3, 0, 1.0), ("layerskip", 3, 0, 1.0),
                                                   ("model", 2, 3, 1.0), ("ngram", 2, 3, 1.0),
                                                   ("model", 3, 0, 0.7)])
def test_speculative_sampling_pair_distribution(sampling_models, drafter, k, top_k, top_p):
    target, hf, draft = sampling_models
    eng = Engine(target, recipe_for(drafter, k), draft=draft if drafter == "model" else None)
    sp = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    n = 4000
    counts, accepted = sample_sequences(eng, 2, n, 200, sp)
    exact = sequence_distribution(hf, SAMPLE_PROMPT, 2, SAMPLE_VOCAB, top_k, top_p)
    stat, p, dof = chi_square_pvalue(counts, exact, n)
    assert p > ALPHA, f"chi2={stat:.1f} dof={dof} p={p:.2g}"
    assert dof >= 8  # enough cells for the test to mean something
    # drafts were both accepted and rejected, so both branches of the rule shaped the sample
    assert 0 < sum(accepted) < len(accepted) * k
    if top_k:
        assert len({t for pair in counts for t in pair}) <= SAMPLE_VOCAB and all(
            exact.get(s, 0) > 0 for s in counts)  # nothing outside the top-3 support was ever sampled


@pytest.mark.parametrize("k", (1, 3))
def test_speculative_sampling_triple_distribution(tiny_model_dir, k):
    """Three tokens over a vocab of 4: covers the second and third draft positions, the bonus token after all
    drafts are accepted (k=1), and the residual distribution at a deeper rejection (k=3)."""
    t_loaded, hf = load_pair(tiny_model_dir("llama", seed=31, std=0.08, vocab_size=4))
    d_loaded = load(str(tiny_model_dir("llama", seed=32, std=0.08, vocab_size=4, num_hidden_layers=1)))
    eng = Engine(t_loaded, recipe_for("model", k), draft=d_loaded)
    n = 6000
    counts = Counter()
    prompt = [0, 1, 2, 3, 0]
    for call in range(n // 300):
        for r in eng.generate([prompt] * 300, 3, sampling=SamplingParams(temperature=1.0), seed=50 + call,
                              ignore_eos=True):
            counts[tuple(r.tokens)] += 1
    exact = sequence_distribution(hf, prompt, 3, 4)
    stat, p, dof = chi_square_pvalue(counts, exact, n)
    assert p > ALPHA, f"chi2={stat:.1f} dof={dof} p={p:.2g}"


def test_distribution_test_has_power(sampling_models, monkeypatch):
    """The chi-square check detects a subtly wrong rule (after a rejection, resample from p instead of the residual
    norm(max(p - q, 0))): guards against the distribution tests above passing vacuously, e.g. with p == q."""
    import specpilot.engine.decode as decode
    from specpilot.engine.sampling import categorical, probabilities, uniform

    def residual_is_p(drafts, valid, draft_probs, logits, params, generator):
        B, k = drafts.shape
        p = probabilities(logits, params)
        p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
        q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        u = uniform((B, k), generator, drafts.device)
        n_acc = ((u * q_d < p_d) & (torch.arange(k)[None] < valid[:, None])).long().cumprod(1).sum(1)
        rows = torch.arange(B)
        last = categorical(p[rows, n_acc], generator)
        tokens = torch.cat([drafts, drafts[:, :1]], 1)
        tokens[rows, n_acc] = last
        return n_acc, tokens

    target, hf, draft = sampling_models
    eng = Engine(target, recipe_for("model", 4), draft=draft)
    sp = SamplingParams(temperature=1.0)
    exact = sequence_distribution(hf, SAMPLE_PROMPT, 2, SAMPLE_VOCAB)
    monkeypatch.setattr(decode, "accept_sampled", residual_is_p)
    counts, _ = sample_sequences(eng, 2, 4000, 200, sp)
    _, p, _ = chi_square_pvalue(counts, exact, 4000)
    assert p < 1e-6


def test_sampling_rows_independent_and_seeded(sampling_models):
    target, _, draft = sampling_models
    eng = Engine(target, recipe_for("model", 4), draft=draft)
    sp = SamplingParams(temperature=1.0)
    a = [r.tokens for r in eng.generate([SAMPLE_PROMPT] * 50, 6, sampling=sp, seed=3, ignore_eos=True)]
    b = [r.tokens for r in eng.generate([SAMPLE_PROMPT] * 50, 6, sampling=sp, seed=3, ignore_eos=True)]
    c = [r.tokens for r in eng.generate([SAMPLE_PROMPT] * 50, 6, sampling=sp, seed=4, ignore_eos=True)]
    assert a == b  # the seed determines the sample
    assert a != c
    assert len({tuple(t) for t in a}) > 25  # identical prompts in one batch draw different samples


def test_greedy_ignores_seed_and_zero_temperature_is_greedy(tiny, tiny_reference):
    eng = Engine(tiny.loaded, recipe_for("ngram", 4))
    for seed in (0, 7):
        rows = eng.generate(tiny_prompts(), TINY_NEW, sampling=SamplingParams(temperature=0.0, top_k=5),
                            seed=seed, ignore_eos=True)
        assert [r.tokens for r in rows] == tiny_reference
