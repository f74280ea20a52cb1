"""The head being trained, and its export in the on-disk format engine/eagle3.py's `load_head` reads (SGLang's and
vLLM's LlamaForCausalLMEagle3: config.json + model.safetensors, names and shapes as that module's docstring lists).

The head is shaped as one decoder layer of the target (its hidden size, heads, head size, MLP width, RoPE), reads
the aux layers' outputs named in `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge's default, the outputs
of layers 1, L // 2 - 1, L - 4; a target of under five layers: 0, L // 2, L - 1), and is initialized as SpecForge
starts one: matrices N(0, 0.02), norms 1, except that (issue #22 item 3) `lm_head` starts as the target's own LM-head
rows of the draft vocabulary and `norm` as the target's final norm, so step 0 starts near the target's own
prediction. With `lm_head="target"` those rows stay frozen (a buffer, as EAGLE-1/2 share the target's LM head) and
are not exported: engine/eagle3.py's `load_head` takes the target's rows of the draft vocabulary for a head without
`lm_head.weight`, and the file is about half as large for a small target (SmolLM2-135M: [8192, 576], ~9.4 MB of
~20 MB in bf16). The embeddings are the target's and stay frozen; none are exported (SpecForge's export drops them
and the engines use the target's). Parameters are fp32 whatever the target's dtype; the export is in `dtype`.

The attribute names are Eagle3Head's, so engine/eagle3.py's `fuse`, `midlayer` and `draft_logits` run this head:
the trained function is the one the engine drafts with.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ...engine.eagle3 import ARCHITECTURE, Eagle3Config, Eagle3Head, failing, read_config, read_weights
from ...engine.errors import SpecPilotError
from ...engine.model import Transformer, rope_inv_freq, rope_tables
from .vocab import d2t_t2d

INIT_STD = 0.02
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
LM_HEADS = ("trained", "target")  # the head's own LM head, trained and exported; the target's rows, frozen


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    if n_layers >= 5:
        return 1, n_layers // 2 - 1, n_layers - 4
    return 0, n_layers // 2, n_layers - 1


def head_config(hf_config, draft_vocab: int, aux_layers: tuple[int, ...], dtype: torch.dtype,
                intermediate_size: int | None = None) -> dict:
    """config.json of a head for this target (its transformers config): the target layer's shapes, its MLP
    `intermediate_size` wide where given (a wider head within the package's 16 MB: `train-drafter
    --intermediate-size`)."""
    t = hf_config.to_dict()
    H = t["hidden_size"]
    n_heads = t["num_attention_heads"]
    cfg = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu", "hidden_size": H,
           "intermediate_size": intermediate_size or t["intermediate_size"], "num_attention_heads": n_heads,
           "num_key_value_heads": t.get("num_key_value_heads") or n_heads,
           "head_dim": t.get("head_dim") or H // n_heads, "num_hidden_layers": 1,
           "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "max_position_embeddings": t["max_position_embeddings"],
           "tie_word_embeddings": False, "vocab_size": t["vocab_size"], "draft_vocab_size": draft_vocab,
           "torch_dtype": str(dtype).removeprefix("torch."),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}}
    cfg.update({k: t[k] for k in ROPE_KEYS if t.get(k) is not None})
    # Readers on an older transformers (SGLang's, vLLM's) know RoPE only by the legacy keys
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" not in cfg and rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


@dataclass(frozen=True)
class StartingHead:
    """A trained head a run starts from (`--init`): its weights by SGLang's names, as the file holds them; each draft
    id's target id (the run keeps the head's draft vocabulary: its LM-head rows are those ids'); the target layers
    it reads; its MLP's width; the sha256 of its weights file (run.json records it)."""
    weights: dict[str, torch.Tensor]
    draft_ids: torch.Tensor
    aux_layers: tuple[int, ...]
    intermediate_size: int
    sha256: str


def starting_head(spec: str, target: Transformer, hf_config) -> StartingHead:
    """The head `spec` names (a directory or an alias: engine.loader.source_dir), checked by the engine's own loader
    against the target, and refused in one line where a head trained here could not continue it: attention shapes
    other than the target layer's (its MLP's width may be its own, and a run may widen it), biases, or embeddings of
    its own."""
    from ...engine import loader

    directory = loader.source_dir(spec)
    fail = failing(f"--init {spec}")
    raw, weights = read_config(directory, fail), read_weights(directory, fail)
    loaded = Eagle3Head.from_weights(raw, weights, target, f"--init {spec}")
    t = hf_config.to_dict()
    shaped = head_config(hf_config, loaded.cfg.draft_vocab_size, loaded.cfg.aux_layers, target.dtype,
                         loaded.cfg.intermediate_size)  # (its MLP's width is its own)
    for key, have in (("hidden_size", loaded.cfg.hidden_size), ("intermediate_size", loaded.cfg.intermediate_size),
                      ("num_attention_heads", loaded.cfg.n_heads), ("num_key_value_heads", loaded.cfg.n_kv_heads),
                      ("head_dim", loaded.cfg.head_dim)):
        if have != shaped[key]:
            fail(f"has {key} {have}; a head trained here is shaped as the target's layer ({shaped[key]})")
    own = sorted(n for n in weights if n.endswith(".bias") or n == "embed_tokens.weight")
    if own or loaded.cfg.norm_before_residual:
        fail(f"has {', '.join(own) or 'norm_before_residual'}, which a head trained here does not")
    if t.get("rms_norm_eps", 1e-6) != loaded.cfg.rms_eps:
        fail(f"has rms_norm_eps {loaded.cfg.rms_eps}, the target {t.get('rms_norm_eps', 1e-6)}")
    files = sorted(directory.glob("*.safetensors"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return StartingHead({k: w for k, w in weights.items() if k not in ("d2t", "t2d")},
                        loaded.draft_to_target.cpu(), tuple(loaded.cfg.aux_layers), loaded.cfg.intermediate_size,
                        digest.hexdigest())


class TrainableHead(nn.Module):
    def __init__(self, config: dict, draft_ids: torch.Tensor, target: Transformer, seed: int,
                 lm_head: str = "trained"):
        super().__init__()
        if lm_head not in LM_HEADS:
            raise ValueError(f"lm_head must be one of {LM_HEADS}, got {lm_head!r}")
        from transformers import LlamaConfig

        H, I = config["hidden_size"], config["intermediate_size"]
        nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        aux = tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.config = config
        self.cfg = Eagle3Config(hidden_size=H, target_hidden_size=H, intermediate_size=I, n_heads=nh,
                                n_kv_heads=nkv, head_dim=hd, rms_eps=config["rms_norm_eps"],
                                vocab_size=config["vocab_size"], draft_vocab_size=draft_ids.numel(),
                                aux_layers=aux, norm_before_residual=False)
        device = target.device
        g = torch.Generator().manual_seed(seed)

        def matrix(*shape):
            return nn.Parameter((torch.randn(*shape, generator=g) * INIT_STD).to(device))

        def ones(n):
            return nn.Parameter(torch.ones(n, device=device))

        self.fc = matrix(H, 3 * H)
        self.input_norm, self.hidden_norm = ones(H), ones(H)
        self.wqkv = matrix((nh + 2 * nkv) * hd, 2 * H)
        self.wo = matrix(H, nh * hd)
        self.post_norm = ones(H)
        self.w13 = matrix(2 * I, H)
        self.w2 = matrix(H, I)
        self.norm = nn.Parameter(target.norm.detach().float().clone())
        rows = target.lm_head.detach()[draft_ids.to(device)].float().clone()
        self.frozen_lm_head = lm_head == "target"
        if self.frozen_lm_head:
            self.register_buffer("lm_head", rows, persistent=False)  # derived from the target: not checkpointed
        else:
            self.lm_head = nn.Parameter(rows)
        self.fc_bias = self.bqkv = self.bo = None
        self.register_buffer("embed", target.embed.detach().float(), persistent=False)
        self.register_buffer("draft_to_target", draft_ids.to(device), persistent=False)
        inv_freq, self.attention_scaling = rope_inv_freq(LlamaConfig.from_dict(config))
        self.inv_freq = inv_freq.float()
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def start_from(self, start: StartingHead) -> None:
        """Every trained weight from a head (`--init`), in fp32: the run continues it instead of a fresh draw. Its
        LM head where it has one of its own (refused with the target's rows frozen, which would drop it); a head
        without one drafts with the target's rows, which this head starts from already. A wider MLP than the
        starting head's (`--intermediate-size`) keeps its units first and the new ones' fresh gate and up rows with
        zero down columns, so the widened head drafts what the starting head drafted and training grows the new
        units from there."""
        w = start.weights
        if not torch.equal(start.draft_ids.to(self.draft_to_target.device), self.draft_to_target):
            raise SpecPilotError("--init: the run's draft vocabulary must be the starting head's")
        if "lm_head.weight" in w and self.frozen_lm_head:
            raise SpecPilotError("--init: a head with an LM head of its own cannot continue with the target's rows")
        a, m = "midlayer.self_attn.", "midlayer.mlp."
        pairs = {self.fc: w["fc.weight"], self.input_norm: w["midlayer.input_layernorm.weight"],
                 self.hidden_norm: w["midlayer.hidden_norm.weight"],
                 self.wqkv: torch.cat([w[a + f"{n}_proj.weight"] for n in "qkv"]), self.wo: w[a + "o_proj.weight"],
                 self.post_norm: w["midlayer.post_attention_layernorm.weight"],
                 self.norm: w["norm.weight"]}
        width, had = self.cfg.intermediate_size, w[m + "down_proj.weight"].shape[1]
        if width < had:
            raise SpecPilotError(f"--intermediate-size {width}: --init's MLP has {had} units; a head is widened, "
                                 f"never cut")
        w13, w2 = self.w13.detach().clone(), torch.zeros_like(self.w2)
        w13[:had], w13[width: width + had], w2[:, :had] = (w[m + f"{n}_proj.weight"].float()
                                                           for n in ("gate", "up", "down"))
        pairs.update({self.w13: w13, self.w2: w2})
        if "lm_head.weight" in w:
            pairs[self.lm_head] = w["lm_head.weight"]
        for param, value in pairs.items():
            param.copy_(value.float())

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.device

    def ensure_rope(self, max_len: int) -> None:
        """cos/sin tables as Eagle3Head.ensure_rope computes them, in fp32 (the head trains in fp32)."""
        if self.rope is not None and self.rope[0].shape[0] >= max_len:
            return
        self.rope = rope_tables(self.inv_freq, self.attention_scaling, max_len, self.device, torch.float32)

    def exported(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The weights under SGLang's names, q/k/v and gate/up split again; no lm_head.weight when it is the
        target's (frozen)."""
        c = self.cfg
        q, k, v = self.wqkv.detach().split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                                            c.n_kv_heads * c.head_dim])
        gate, up = self.w13.detach().chunk(2)
        a, m = "midlayer.self_attn.", "midlayer.mlp."
        weights = {"fc.weight": self.fc, "midlayer.input_layernorm.weight": self.input_norm,
                   "midlayer.hidden_norm.weight": self.hidden_norm, a + "q_proj.weight": q, a + "k_proj.weight": k,
                   a + "v_proj.weight": v, a + "o_proj.weight": self.wo,
                   "midlayer.post_attention_layernorm.weight": self.post_norm, m + "gate_proj.weight": gate,
                   m + "up_proj.weight": up, m + "down_proj.weight": self.w2, "norm.weight": self.norm}
        if not self.frozen_lm_head:
            weights["lm_head.weight"] = self.lm_head
        out = {k: w.detach().to("cpu", dtype).contiguous() for k, w in weights.items()}
        out["d2t"], out["t2d"] = d2t_t2d(self.draft_to_target.cpu(), c.vocab_size)
        return out

    def save(self, directory: Path, dtype: torch.dtype) -> Path:
        """config.json and model.safetensors in `directory`, each written whole or not at all."""
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(self.config, torch_dtype=str(dtype).removeprefix("torch."))
        tmp = directory / "model.safetensors.tmp"
        save_file(self.exported(dtype), str(tmp), metadata={"format": "pt"})
        tmp.replace(directory / "model.safetensors")
        (directory / "config.json.tmp").write_text(json.dumps(config, indent=2))
        (directory / "config.json.tmp").replace(directory / "config.json")
        return directory
