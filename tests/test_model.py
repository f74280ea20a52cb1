"""Our Transformer against HF transformers on the same weights, the static KV cache, and the loader's errors."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specpilot.engine.errors import SpecPilotError
from specpilot.engine.loader import load

REL_TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def our_logits(model, ids: torch.Tensor, max_len: int = 256) -> torch.Tensor:
    """Full-sequence logits [B, T, V] from one forward into a fresh cache."""
    B, T = ids.shape
    cache = model.new_cache(B, max_len)
    with torch.inference_mode():
        return model(ids, torch.arange(T)[None].expand(B, T), cache)


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def random_ids(n: int, seed: int, vocab: int = 256, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


# -- logits against HF ------------------------------------------------------------------------------------------
def test_tiny_logits_match_hf(tiny):
    ids = random_ids(40, seed=1)  # longer than mistral's 16-token sliding window
    ref = hf_logits(tiny.hf, ids)
    ours = our_logits(tiny.loaded.model, ids)
    assert ours.shape == ref.shape == (1, 40, 256)
    assert rel_err(ours, ref) < REL_TOL, tiny.family
    # the test would notice a wrong model: logits vary a lot across positions
    assert (ref[0, 1:] - ref[0, :-1]).abs().max() > 1.0


def test_tiny_config_features_are_loaded(tiny):
    """Each family really exercises what it is meant to (guards against a fixture silently losing a feature)."""
    cfg, model = tiny.loaded.model.cfg, tiny.loaded.model
    if tiny.family == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 16
    if tiny.family == "qwen2":
        assert model.layers[0].bqkv is not None and cfg.tie_embeddings and model.lm_head is model.embed
    if tiny.family == "llama3rope":
        assert model.layers[0].bo is not None and model.layers[0].bqkv is not None
        from specpilot.engine.model import rope_inv_freq
        import transformers
        plain = rope_inv_freq(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4))[0]
        assert not torch.allclose(model.inv_freq, plain)  # llama3 scaling changed the low frequencies
    if tiny.family == "mistral":
        assert set(cfg.sliding_windows) == {16}
    if tiny.family == "llama":
        assert not cfg.tie_embeddings and model.lm_head is not model.embed


def test_qwen2_mixed_full_and_sliding_layers(tiny_model_dir):
    """Qwen2 with use_sliding_window: layer 0 full attention, layer 1 an 8-token window (per-layer masks)."""
    from conftest import load_pair

    loaded, hf = load_pair(tiny_model_dir("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert loaded.model.cfg.sliding_windows == (None, 8)
    ids = random_ids(30, seed=9)
    ours = our_logits(loaded.model, ids)
    assert rel_err(ours, hf_logits(hf, ids)) < REL_TOL
    cache = loaded.model.new_cache(1, 64)
    with torch.inference_mode():
        inc = torch.cat([loaded.model(ids[:, a:b], torch.arange(a, b)[None], cache)
                         for a, b in ((0, 5), (5, 6), (6, 19), (19, 30))], 1)
    assert rel_err(inc, ours) < 1e-5


def test_tiny_incremental_prefill_then_chunks(tiny):
    """Prefill a prefix, then feed the rest in uneven chunks at the right positions: same logits as one forward."""
    ids = random_ids(37, seed=2)
    model = tiny.loaded.model
    full = our_logits(model, ids)
    cache = model.new_cache(1, 64)
    pieces = []
    bounds = [0, 11, 12, 15, 23, 24, 37]
    with torch.inference_mode():
        for a, b in zip(bounds, bounds[1:]):
            pieces.append(model(ids[:, a:b], torch.arange(a, b)[None], cache))
    inc = torch.cat(pieces, 1)
    assert rel_err(inc, full) < 1e-5
    assert rel_err(inc, hf_logits(tiny.hf, ids)) < REL_TOL


def test_tiny_stale_cache_slots_are_ignored(tiny):
    """Slots past a query's position (e.g. rejected drafts) must not influence it, and get overwritten."""
    ids = random_ids(30, seed=3)
    model = tiny.loaded.model
    full = our_logits(model, ids)
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(ids[:, :20], torch.arange(20)[None], cache)
        junk = random_ids(8, seed=99)
        model(junk, torch.arange(20, 28)[None], cache)  # "rejected drafts" at 20..27
        again = model(ids[:, 20:30], torch.arange(20, 30)[None], cache)
    assert rel_err(again, full[:, 20:30]) < 1e-5


def test_tiny_ragged_batch_rows_equal_single_rows(tiny):
    """Two prompts of different lengths, right-padded into one forward: each row's logits equal its own forward."""
    model = tiny.loaded.model
    a, b = random_ids(29, seed=4), random_ids(13, seed=5)
    padded = torch.zeros(2, 29, dtype=torch.long)
    padded[0], padded[1, :13] = a[0], b[0]
    padded[1, 13:] = 7  # pad id: any token
    batch = our_logits(model, padded)
    assert rel_err(batch[0:1], our_logits(model, a)) < 1e-5
    assert rel_err(batch[1:2, :13], our_logits(model, b)) < 1e-5


def test_tiny_logits_at_selects_positions(tiny):
    model = tiny.loaded.model
    ids = random_ids(20, seed=6, batch=2)
    full = our_logits(model, ids)
    cache = model.new_cache(2, 64)
    at = torch.tensor([[19], [7]])
    with torch.inference_mode():
        picked = model(ids, torch.arange(20)[None].expand(2, 20), cache, logits_at=at)
    assert picked.shape == (2, 1, 256)
    assert rel_err(picked[0, 0], full[0, 19]) < 1e-5 and rel_err(picked[1, 0], full[1, 7]) < 1e-5


SMOL_TEXT = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens and lets the "
             "target model verify them in one forward pass, keeping exactly the output of plain decoding.")


def test_smollm2_logits_match_hf(smollm2):
    loaded, hf = smollm2
    ids = torch.tensor([loaded.tokenizer.encode(SMOL_TEXT)])
    assert ids.shape[1] > 30
    ours = our_logits(loaded.model, ids)
    assert rel_err(ours, hf_logits(hf, ids)) < REL_TOL


def test_smollm2_incremental_and_ragged(smollm2):
    loaded, _ = smollm2
    model = loaded.model
    ids = torch.tensor([loaded.tokenizer.encode(SMOL_TEXT)])
    T = ids.shape[1]
    full = our_logits(model, ids)
    cache = model.new_cache(1, 256)
    with torch.inference_mode():
        first = model(ids[:, :17], torch.arange(17)[None], cache)
        mid = model(ids[:, 17:18], torch.tensor([[17]]), cache)
        rest = model(ids[:, 18:], torch.arange(18, T)[None], cache)
    assert rel_err(torch.cat([first, mid, rest], 1), full) < 1e-5

    short = torch.tensor([loaded.tokenizer.encode("Hello there, how are you?")])
    n = short.shape[1]
    padded = torch.zeros(2, T, dtype=torch.long)
    padded[0], padded[1, :n] = ids[0], short[0]
    batch = our_logits(model, padded)
    assert rel_err(batch[0:1], full) < 1e-5
    assert rel_err(batch[1:2, :n], our_logits(model, short)) < 1e-5


# -- loader errors ----------------------------------------------------------------------------------------------
def test_load_nonexistent_path(tmp_path):
    with pytest.raises(SpecPilotError, match="not found") as e:
        load(str(tmp_path / "no-such-model"))
    assert "no-such-model" in str(e.value)


def test_load_corrupted_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(SpecPilotError, match="GGUF") as e:
        load(str(bad))
    assert "bad.gguf" in str(e.value)
    assert not list((tmp_path / "cache").glob("models/*/config.json"))  # nothing half-converted left as valid


def test_load_garbage_gguf_without_magic(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(SpecPilotError, match="bad.gguf"):
        load(str(bad))


def test_load_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(SpecPilotError, match="gguf"):
        load(str(f))


def test_load_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecPilotError, match="config.json"):
        load(str(tmp_path))


def test_load_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(SpecPilotError, match="unsupported architecture") as e:
        load(str(tmp_path))
    assert "gpt2" in str(e.value)


@pytest.mark.parametrize("dtype", ["fp8", "float64", "int8", ""])
def test_load_bad_dtype(tmp_path, dtype):
    with pytest.raises(SpecPilotError, match="dtype") as e:
        load(str(tmp_path), dtype)
    assert repr(dtype) in str(e.value)


def test_load_bad_device(tmp_path):
    with pytest.raises(SpecPilotError, match="device"):
        load(str(tmp_path), "fp32", "tpu")


def test_load_dtype_is_applied(tiny_model_dir):
    loaded = load(str(tiny_model_dir("llama")), "bf16")
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.tokenizer is None  # the tiny directories have no tokenizer files


def test_load_unsupported_mlp_bias_is_a_specpilot_error(tiny_model_dir):
    """A Llama with MLP biases is valid HF but not supported here: the user must get a SpecPilotError naming it."""
    path = tiny_model_dir("llama", seed=3, mlp_bias=True)
    with pytest.raises(SpecPilotError, match="(?i)bias"):
        load(str(path))


def test_load_unsupported_activation_is_not_silently_wrong(tiny_model_dir):
    """A Llama config with another MLP activation is valid HF: either match HF's logits or refuse with a clear
    SpecPilotError; never load it and compute something else."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama", seed=4, hidden_act="gelu")
    try:
        loaded = load(str(path))
    except SpecPilotError as e:
        assert "gelu" in str(e) or "activation" in str(e)
        return
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = random_ids(16, seed=8)
    err = rel_err(our_logits(loaded.model, ids), hf_logits(hf, ids))
    assert err < REL_TOL, f"hidden_act='gelu' loaded without error but logits differ from HF's by {err:.3g} (relative)"


def test_load_hub_id_from_local_cache(tiny_model_dir, tmp_path):
    """A hub id resolves offline when its snapshot is in the HF cache (standard models--org--name layout)."""
    import shutil
    import subprocess
    import sys

    src = Path(tiny_model_dir("llama"))
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    code = ("from specpilot.engine.loader import load; import torch\n"
            "m = load('tiny-org/tiny-llama', 'fp32', 'cpu')\n"
            "print(m.model.cfg.n_layers, m.source)\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    layers, source = done.stdout.split()
    assert layers == "2" and Path(source) == snapshot
    # and a hub id that is not cached is refused with the cause named
    code_missing = "from specpilot.engine.loader import load; load('tiny-org/absent', 'fp32', 'cpu')\n"
    done = subprocess.run([sys.executable, "-c", code_missing], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "model not found" in done.stderr


def test_step_functions_may_compile_every_shape_a_bench_runs():
    """compiled() lifts dynamo's per-function recompile limits (default 8, and 64 before: issue #20's sweep hit it
    with seven batch buckets x five kinds of step x six systems, FailOnRecompileLimitHit) to RECOMPILE_LIMIT."""
    import torch._dynamo

    from specpilot.engine.model import RECOMPILE_LIMIT, compiled

    compiled(lambda x: x + 1)
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT >= 7 * 5 * 6 * 2
    assert torch._dynamo.config.accumulated_recompile_limit >= RECOMPILE_LIMIT


def test_compiled_prologue_is_the_eager_one(tiny):
    """A decoder's steps compile the target's per-token inputs (`token_inputs`: cache rows, RoPE rows, embeddings and
    the zero residual stream; eagerly five or six kernels of every captured step): compiled (inductor, on the CPU
    here) they equal the eager ones, and a forward given them (`prologue`) has the logits of one without."""
    from specpilot.engine.model import compiled, token_inputs

    model = tiny.loaded.model
    B, T = 3, 5
    ids = random_ids(T, seed=4, batch=B)
    positions = torch.arange(T)[None].expand(B, T) + torch.tensor([0, 7, 20])[:, None]
    cache = model.new_cache(B, 64)
    prologue = compiled(token_inputs)
    for with_rows in (True, False):
        want = token_inputs(model.embed, model._rope, ids, positions, with_rows)
        got = prologue(model.embed, model._rope, ids, positions, with_rows)
        assert (want[0] is None) == (got[0] is None) == (not with_rows)
        for a, b in zip(want, got):
            assert a is None or torch.equal(a, b)
    assert want[3].abs().sum() > 0 and not want[4].any()
    with torch.inference_mode():
        plain = model(ids, positions, cache)
        given = model(ids, positions, model.new_cache(B, 64), prologue=prologue)
    assert torch.equal(plain, given)
