"""Test helper: a randomly initialized EAGLE-3 head for a tiny target, written in exactly the on-disk layout that
SGLang's and vLLM's llama_eagle3.py load (config.json + model.safetensors, SGLang's names and shapes; the module
docstring of engine/eagle3.py says where each comes from), with a draft vocabulary smaller than the target's and
real d2t / t2d maps. No embed_tokens.weight unless asked: SpecForge's exports have none (the target's is used)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def head_weights(cfg: dict, seed: int, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights for the head `cfg` (config.json's dict): norms near 1, matrices N(0, std), a seeded subset of
    the target's ids as the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    H, I, V, Vd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
    Ht = cfg.get("target_hidden_size") or H
    hd = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + 0.05 * torch.randn(n, generator=g)

    a, m = "midlayer.self_attn.", "midlayer.mlp."
    w = {"fc.weight": mat(H, 3 * Ht), "midlayer.input_layernorm.weight": norm(H),
         "midlayer.hidden_norm.weight": norm(H), a + "q_proj.weight": mat(q_out, 2 * H),
         a + "k_proj.weight": mat(kv_out, 2 * H), a + "v_proj.weight": mat(kv_out, 2 * H),
         a + "o_proj.weight": mat(H, q_out), "midlayer.post_attention_layernorm.weight": norm(H),
         m + "gate_proj.weight": mat(I, H), m + "up_proj.weight": mat(I, H), m + "down_proj.weight": mat(H, I),
         "norm.weight": norm(H), "lm_head.weight": mat(Vd, H)}
    target_ids = torch.randperm(V, generator=g)[:Vd].sort().values
    w["d2t"] = target_ids - torch.arange(Vd)  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    w["t2d"] = t2d
    return w


def head_config(target_hf_config, hidden: int | None = None, draft_vocab: int = 160,
                aux_ids: list[int] | None = None, aux_key: str = "eagle_config") -> dict:
    """config.json of a head for this target (a transformers config): a SpecForge-style LlamaForCausalLMEagle3
    config. `aux_ids` go under eagle_config (SGLang / SpecForge: layer outputs) or, with aux_key "top", at the top
    level (vLLM: layer inputs); None writes none (the default layers)."""
    t = target_hf_config
    H = hidden or t.hidden_size
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": H // 4, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "rope_scaling": None, "max_position_embeddings": 512, "tie_word_embeddings": False,
           "vocab_size": t.vocab_size, "draft_vocab_size": draft_vocab, "torch_dtype": "float32"}
    if H != t.hidden_size:
        cfg["target_hidden_size"] = t.hidden_size
    if aux_ids is not None:
        if aux_key == "top":
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
        else:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    return cfg


def default_aux_ids(n_layers: int) -> list[int]:
    """Low, middle, high layer outputs of a tiny target (the engines' default needs 5+ layers)."""
    return [0, n_layers // 2, n_layers - 1]


def save_head(path: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    """config.json and model.safetensors, as SpecForge's export writes them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def write_head(path: Path, target_hf_config, *, seed: int = 0, hidden: int | None = None, draft_vocab: int = 160,
               aux_ids: list[int] | None = None, aux_key: str = "eagle_config", own_embeddings: bool = False,
               config_changes: dict | None = None, weight_changes: dict | None = None) -> Path:
    """Write a random head for this target to `path` and return it. aux_ids None: `default_aux_ids` (aux_key
    "none": no ids at all). `config_changes` are merged into config.json before the weights are drawn, so the
    weights fit the changed config (a None value deletes the key); `weight_changes` then replace weights (a None
    value drops one): heads made for another target, or broken ones."""
    if aux_ids is None and aux_key != "none":
        aux_ids = default_aux_ids(target_hf_config.num_hidden_layers)
    cfg = head_config(target_hf_config, hidden, draft_vocab, aux_ids, aux_key)
    for key, value in (config_changes or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    weights = head_weights(cfg, seed)
    if own_embeddings:
        weights["embed_tokens.weight"] = torch.randn(cfg["vocab_size"], cfg["hidden_size"],
                                                     generator=torch.Generator().manual_seed(seed + 1)) * 0.2
    for name, value in (weight_changes or {}).items():
        if value is None:
            weights.pop(name, None)
        else:
            weights[name] = value
    return save_head(path, cfg, weights)
