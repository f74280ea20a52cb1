"""Synthetic targets (issue #24 item 1): a published architecture's shapes with random weights drawn on the device
from a fixed seed, a directory like any target's (config.json marked synthetic, the packaged SmolLM2's tokenizer),
so every tool that takes a target takes one."""
from __future__ import annotations

import pytest
import torch

from specpilot.engine import loader, synthetic
from specpilot.engine.engine import Engine
from specpilot.engine.errors import SpecPilotError
from specpilot.engine.recipe import parse

TINY = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 50000, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
              "rope_theta": 500000.0, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 50000, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
              "rope_theta": 1000000.0, "tie_word_embeddings": True},
}


@pytest.fixture
def tiny_synthetic(monkeypatch, tmp_path):
    """`synthetic:tiny-<family>` targets in a cache of their own (the tokenizer still from the real packaged one)."""
    text_source = loader.source_dir(synthetic.TOKENIZER_SOURCE)
    monkeypatch.setattr(synthetic, "TOKENIZER_SOURCE", str(text_source))
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path)
    for family, config in TINY.items():
        monkeypatch.setitem(synthetic.CONFIGS, f"tiny-{family}", config)
    return tmp_path


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_synthetic_target_has_its_shapes_seeded_weights_and_text(tiny_synthetic, family):
    target = f"synthetic:tiny-{family}"
    a, b = loader.load(target, "fp32", "cpu"), loader.load(target, "fp32", "cpu")
    cfg = a.model.cfg
    assert (cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
        (50000, 64, 2, 4, 2, 16)
    assert cfg.qk_norm == (family == "qwen3") and cfg.tie_embeddings == (family == "qwen3")
    assert (a.model.lm_head is a.model.embed) == cfg.tie_embeddings
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name  # the same seed: the same weights
    assert a.model.layers[0].wqkv.std().item() == pytest.approx(1 / 64 ** 0.5, rel=0.1)  # N(0, 1 / fan-in)
    w2 = a.model.layers[0].w2  # writes to the residual stream: smaller
    assert w2.std().item() == pytest.approx(synthetic.RESIDUAL_WRITE_SCALE / 128 ** 0.5, rel=0.1)
    assert "synthetic" in a.source and a.eos_token_ids == ()
    ids = a.tokenizer.encode("Summarize the following text.")
    assert ids and max(ids) < 49152 and a.tokenizer.decode([49152 + 7]) == ""  # ids past the tokenizer: no text


def test_a_synthetic_target_decodes_to_its_limit_and_speculation_keeps_its_tokens(tiny_synthetic):
    target = loader.load("synthetic:tiny-llama", "fp32", "cpu")
    ar = Engine(target, parse({"name": "ar"}))
    prompts = [ar.encode("Write a haiku about the sea."), ar.encode("What is 12 times 7?")]
    reference = [r.tokens for r in ar.generate(prompts, 24)]
    assert [len(t) for t in reference] == [24, 24]  # no end-of-sequence id: every request runs to its limit
    spec = Engine(target, parse({"name": "ng", "drafter": {"kind": "ngram"}, "k": 4}))
    assert [r.tokens for r in spec.generate(prompts, 24)] == reference


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_synthetic_targets_greedy_token_wins_by_a_margin(tiny_synthetic, family):
    """At every position the top logit beats the next by more than the other logits' standard deviation (it grows as
    sqrt(hidden): ~60 at 8B), so no bf16 summation order changes a greedy token and the replay drafter's AR reference
    is what verification emits. The first draw's margins here were 0.002 at the least, 0.13 at the median."""
    model = loader.load(f"synthetic:tiny-{family}", "fp32", "cpu").model
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    logits = model(ids, torch.arange(40)[None], model.new_cache(1, 64))[0]
    top = logits.topk(2, -1).values
    assert ((top[:, 0] - top[:, 1]) / logits.std(-1)).min() > 1.5


def test_an_unknown_synthetic_target_is_refused_in_one_line(tiny_synthetic):
    with pytest.raises(SpecPilotError, match=r"unknown synthetic target 'synthetic:llama-9b': one of .*llama-3.1-8b"):
        loader.load("synthetic:llama-9b", "fp32", "cpu")


def test_the_published_configurations_have_the_published_sizes():
    """Parameter counts of the three configurations as our engine builds them, against the models' published sizes
    (tied embeddings counted once)."""
    from transformers import AutoConfig

    from specpilot.engine.model import ModelConfig
    from specpilot.tools.profile.costmodel import ModelShape

    published = {"llama-3.1-8b": 8_030_261_248, "llama-3.2-1b": 1_235_814_400, "qwen3-8b": 8_190_735_360}
    for name, count in published.items():
        config = {k: v for k, v in synthetic.CONFIGS[name].items() if k not in ("model_type", "architectures")}
        hf = AutoConfig.for_model(synthetic.CONFIGS[name]["model_type"], **config)
        assert ModelShape.from_config(ModelConfig.from_hf(hf)).params == count, name


def test_the_weight_read_floor_counts_what_a_step_reads(tiny_synthetic):
    """An AR step reads every weight once, but of an untied embedding table one row a token: the floor leaves the
    table out (a sixteenth of an 8B target's bytes), and counts a tied one once, as the LM head."""
    from specpilot.tools.bench.engine_bench import step_weight_bytes

    for family in TINY:
        model = loader.load(f"synthetic:tiny-{family}", "fp32", "cpu").model
        every = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
        table = model.embed.numel() * 4
        assert step_weight_bytes(model) == (every if model.cfg.tie_embeddings else every - table)


def test_every_commands_target_help_names_every_synthetic_target(capsys):
    """--target's shared help lists exactly the synthetic architectures the loader knows, in every command."""
    from specpilot import cli
    from specpilot.tools.argtypes import SYNTHETIC_NAMES, TARGET_HELP

    assert set(SYNTHETIC_NAMES) == set(synthetic.CONFIGS)
    for command in ("generate", "bench", "optimize", "train-drafter"):
        assert cli.main([command, "--help"]) == 0
        shown = " ".join(capsys.readouterr().out.split())
        assert " ".join(TARGET_HELP.split()) in shown, command


def test_optimize_replays_acceptance_only_on_a_synthetic_target(tiny_synthetic, tiny_model_dir):
    """`optimize --acceptance`: a synthetic target takes a profile the replay drafter takes; a real target, whose
    drafters the run measures, and a profile that rises are refused, each in one line naming the flag; the
    deployment says which targets are synthetic."""
    from specpilot.graph.nodes import _synthetic
    from specpilot.graph.run import check_acceptance

    check_acceptance("synthetic:tiny-llama", [0.8, 0.6, 0.5])
    with pytest.raises(SpecPilotError, match=r"^--acceptance replays drafts on a synthetic target"):
        check_acceptance(str(tiny_model_dir("llama")), [0.8, 0.6])
    with pytest.raises(SpecPilotError, match=r"^--acceptance: .*drafter.acceptance") as e:
        check_acceptance("synthetic:tiny-llama", [0.5, 0.7])
    assert "\n" not in str(e.value)
    assert _synthetic("synthetic:tiny-llama") and not _synthetic(str(tiny_model_dir("llama")))


def test_optimize_on_a_synthetic_target_measures_replayed_chains(tiny_synthetic, tmp_path, monkeypatch):
    """`specpilot optimize` on a synthetic target with --acceptance, end to end on the CPU: the algorithm agent's
    drafters are replayed chains (no other drafter can predict random weights' text), each passes the token-forcing
    gate (verification is real) and is measured beside ar and stock (the bench names their systems NAME-replay; the
    graph still finds them)."""
    import importlib
    import io
    import json
    import pkgutil

    from specpilot.graph.providers import policy
    from specpilot.graph.run import load_state, optimize

    # Whether a chain is proposed is the cost model's price on this CPU, calibrated by the run's own timings (CI
    # twice priced every chain below the least gain, in the full suite only): this test is about what the graph does
    # with the chains, so every one is proposed (the prices are tested with given step times in test_providers.py).
    # The policy's modules read MIN_GAIN by name (the router, each agent's catalog), so it is patched in every module
    # of the package that has one: the package's re-export alone reaches none of them.
    modules = [policy, *(importlib.import_module(m.name)
                         for m in pkgutil.iter_modules(policy.__path__, policy.__name__ + "."))]
    for module in modules:
        if hasattr(module, "MIN_GAIN"):
            monkeypatch.setattr(module, "MIN_GAIN", -1.0)
    target = str(loader.source_dir("synthetic:tiny-llama"))  # a directory: the gate's sandboxed child loads it too
    out = tmp_path / "run"
    code = optimize(dict(target=target, acceptance=[0.95, 0.9, 0.85, 0.8], workload="code", limit=2,
                         max_new_tokens=16, budget_rounds=1, max_candidates=2, device="cpu", dtype="fp32",
                         profile_repeats=1, memory=str(tmp_path / "memory.jsonl"), out_dir=str(out)),
                    stderr=io.StringIO())
    assert code == 0
    state = load_state(out)
    algorithm = {cid: c["candidate"]["recipe_patch"] for cid, c in state["candidates"].items()
                 if c["agent"] == "algorithm"}
    replayed = {cid: p for cid, p in algorithm.items() if p["drafter"]["kind"] == "replay"}
    # Besides replayed chains the agent proposes AR (turn speculation off), now that no gain is too small
    assert replayed and all(p == {"drafter": {"kind": "none"}, "k": 0} for cid, p in algorithm.items()
                            if cid not in replayed), algorithm
    for cid in replayed:
        ev = state["evaluations"][cid]
        assert ev["gate"]["passed"], ev["gate"]
        assert ev["speed"]["ok"] and ev["speed"]["tokens_per_s"] > 0 and ev["speed"]["mean_accepted"] > 1.0
    assert json.loads((out / "run.json").read_text())["settings"]["acceptance"] == [0.95, 0.9, 0.85, 0.8]
