"""EAGLE-3 draft heads in the on-disk format SGLang and vLLM load, and the chain drafter that runs one.

A head is a directory: `config.json` (a Llama config, `architectures: ["LlamaForCausalLMEagle3"]`) and
`*.safetensors`. What follows is what the serving engines and the trainer do, read from their sources
(sgl-project/sglang at 03d5a77, vllm-project/vllm at 00bd149, sgl-project/SpecForge at a6b6b02); the engine does
the same unless it says otherwise.

Weights (H = hidden_size, Ht = target_hidden_size or H, I = intermediate_size, V = vocab_size, Vd =
draft_vocab_size), names without a "model." prefix (vLLM's Eagle3LlamaForCausalLM.load_weights prefixes "model." to
every name but lm_head; SGLang's LlamaForCausalLMEagle3.load_weights maps both):
- `fc.weight` [H, 3 Ht]: fuses the target's three hidden states, concatenated low, middle, high (SGLang
  llama_eagle3.py LlamaModel: `fc = Linear(hidden_size_in * 3, hidden_size, bias=config.bias)`, hidden_size_in =
  target_hidden_size when the config has it; vLLM: bias False; SpecForge llama3_eagle.py the same). `fc.bias` is
  read when present (SGLang's `bias` key).
- `midlayer.input_layernorm.weight`, `midlayer.hidden_norm.weight` [H]; `midlayer.self_attn.{q,k,v}_proj.weight`
  [heads * head_dim, 2 H] (SGLang overrides qkv_proj with input 2 * hidden_size; vLLM `qkv_input_size = 2 *
  hidden_size` for layer 0; biases only with vLLM's `attention_bias`, read when present), `o_proj.weight`
  [H, heads * head_dim]; `midlayer.post_attention_layernorm.weight` [H]; `midlayer.mlp.{gate,up}_proj.weight`
  [I, H], `down_proj.weight` [H, I]. One decoder layer (`num_hidden_layers: 1`; SGLang and vLLM build more as
  plain layers, which no published head has; refused here).
- `norm.weight` [H]; `lm_head.weight` [Vd, H] (SGLang: ParallelLMHead(draft_vocab_size); with no
  draft_vocab_size the target's lm_head is loaded instead, `load_lm_head_from_target`; vLLM: the target's only when
  the checkpoint has none, process_eagle_weight). Here a head without `lm_head.weight` whose hidden size is the
  target's takes the target's LM-head rows of its draft vocabulary, `target.lm_head[draft_to_target]` (all of it
  when the draft vocabulary is the target's): `train-drafter --lm-head target` writes such heads (EAGLE-1/2 style,
  the target's LM head frozen, a smaller file).
- `d2t` [Vd] int64: target id = draft id + d2t[draft id] (SGLang: `hot_token_id = d2t + arange`; vLLM
  compute_logits: `targets = arange(draft_vocab_size) + draft_id_to_target_id`). `t2d` [V] bool marks the target
  ids in the draft vocabulary; both engines skip it on load; here it is checked against d2t when present.
- `embed_tokens.weight` [V, H] is usually absent: SpecForge's export drops every "embed" tensor
  (specforge/export/to_sglang.py) and the engines use the target's embeddings (SGLang's eagle worker `set_embed`
  always, unless the hidden sizes differ; vLLM when the checkpoint has none). Here: the head's own when present
  (as vLLM), else the target's.

The layer (SGLang LlamaDecoderLayer.forward in llama_eagle3.py; SpecForge LlamaDecoderLayer.forward the same):
residual = hidden; x = cat(input_layernorm(embedding), hidden_norm(hidden)); h = residual + o_proj(attention(x));
out = h + mlp(post_attention_layernorm(h)); logits = lm_head(norm(out)). vLLM's `norm_before_residual: true`
(speculators checkpoints) takes residual = hidden_norm(hidden); read here. `out`, before the final norm, is what
the next draft step reads as its hidden state (SGLang LlamaModel returns `hidden_states_to_aux`, the pre-norm sum;
vLLM `hidden_prenorm`); the fc applies only to the target's states (SGLang: only when the width is not H).

Which target states (Transformer.forward's `aux_layers`, here the output of layer i, 0-based): SGLang's target
models append `hidden_states + residual` to the aux states *before* running layer i for i in `layers_to_capture`
(sglang models/llama.py LlamaModel.forward), which is [2, L // 2, L - 3] by default and [i + 1 for i in ids] for
the ids of the head's `eagle_config.eagle_aux_hidden_state_layer_ids` (set_eagle3_layers_to_capture; "for the ith
layer, it takes the output of the (i-1)th layer"); SpecForge hooks the output of layers[i] for those ids, default
[1, L // 2 - 1, L - 4] (modeling/target/eagle3_target_model.py), and writes them nested in eagle_config
(configs/gpt-oss-20B-eagle3.json). So: nested ids name layer outputs; the default is the outputs of layers 1,
L // 2 - 1, L - 4. vLLM appends the same sum before layer idx for idx in the ids taken *as they are* from the top
level `eagle_aux_hidden_state_layer_ids` (or, failing that, the nested key; gpu_model_runner
_get_eagle3_aux_layers_from_config), default (2, L // 2, L - 3): its ids are capture points, the output of layer
id - 1. The two engines thus read the same nested number one layer apart; here the nested key follows SGLang and
SpecForge (who write it) and the top-level key follows vLLM (id - 1); both present and naming different layers is
refused, and so is vLLM's id 0 (the embeddings).

Pairing and positions (vLLM v1 spec_decode/eagle.py propose: "Shift the input ids by one token", positions left
as the target's; SpecForge trains on input_ids shifted left by one): at position t the head reads the target's
state of token t with the embedding of token t + 1 and predicts token t + 2; each further draft step reads the
head's own pre-norm output at t and the token it just drafted, at position t + 1. Rotary embeddings from the
head's own config (rope_theta, rope_scaling).

The drafter keeps the head's K/V cache in the batch's positions. After a verification step that accepted n drafts
of a row whose history now has `len` tokens, the pairs (state of token len - 2 - n + j, token len - 1 - n + j),
j = 0..n, are new (the last verified token and the accepted drafts, each with its successor: the accepted drafts and
the target's own token); the next `propose` runs them in one forward (k + 1 slots, those past n zeroed and written
where the draft steps overwrite them before anyone reads them), drafts the first token from slot n, then k - 1 more
one at a time. After prefill the new pair is (state of the last prompt token, the first generated token). Cache
slots below len - 2 - n always hold pairs of the target's own states, as at training, and the draft steps' own
entries sit above them (the training's test-time-training steps attend the same way).

Static draft trees (engine/tree.py; `propose_tree`; the paths rank children as EAGLE's and Medusa's tree choices
do): the same first forward ranks the root's children by the head's draft logits (the child of rank r gets the r-th
best draft), then one head forward a depth runs the nodes that have children, each pair being (its parent's head
output, its token) as in a chain's draft step, and ranks their children. Siblings share a position, so the head's
cache gets a slot per node and a tree mask, as the target's tree step. After the step, `update` gets the accepted
path's target states by depth, as from a chain step that accepted those drafts: the head's cache then holds the
target's own pairs below the next root, whichever branch was taken.

Dynamic trees (EAGLE-2; `propose_dynamic_tree`, engine/tree.py `grow_dynamic_tree`): the same first forward gives
the root's top-k drafts, then one head forward a level runs that level's beam (its top-k nodes by cumulative draft
log-probability, each fed its parent's head output and its token) and scores their top-k drafts; each row keeps its
N - 1 best-scoring candidates, its own tree. The beam nodes get head cache slots of their own past the root's
((depth - 1) x top-k of them, more than the verified N may need: the decoder reserves the difference) and a tree mask.

Not here: vLLM's `logit_scale` is not applied (greedy drafts are unchanged by it; sampled ones come from an
unscaled q, which speculative sampling accepts as any other q). SpecForge's own `fc_norm` / `norm_output: false`
variants are refused (SGLang's loader reads neither). A head whose `tie_word_embeddings` is true still uses its own
lm_head (SpecForge configs set it for tied targets while training a separate [Vd, H] lm_head; vLLM ignores the
key). Costs: the prompt's states [B, T, 3 Ht] live through prefill; an AR step (the controller's k' = 0,
ar_after_miss) still runs the head's k draft steps, as the decoder asks every drafter for k then, though only the
first forward (the new pairs) is needed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..kernels import resolve as resolve_kernels
from ..kernels.builtin import attention_sdpa
from .drafters import Drafter, NgramDrafter, Proposal, rows_of
from .errors import SpecPilotError
from .model import KVCache, Transformer, compiled, rope_inv_freq, rope_tables, rotate
# (prompt lookup's longest context tail: a longer tail that occurred before is the surer copy, and the search costs
# about the same for any length, one kernel over the history: kernels/triton_ngram.py)
from .recipe import LOOKUP_MAX_NGRAM
from .sampling import categorical, probabilities
from .tree import DynamicTree, TreeShape, grow_dynamic_tree, tree_mask, tree_positions

ARCHITECTURE = "LlamaForCausalLMEagle3"
# AR steps without the head's search (the batch controller's BLIND_AR, where no draft would pay) whose pairs the
# pending buffer holds until the decoder has them absorbed into the head's cache (`Eagle3Drafter.absorb`): such a
# step costs the head nothing, and the head misses no pair. The controller probes after as many short steps by
# default (BatchSpec.probe_every), so most runs of blind steps end before the buffer is full. Where speculation stays
# hopeless the probes back off (PROBE_BACKOFF) and a full buffer is absorbed every BLIND_BACKLOG steps: at summarize
# B = 4 on the H100 (forty-second lease) the head's blind steps averaged 0.659 ms in the loop against AR's 0.630, its
# absorbs included. SPECPILOT_BLIND_BACKLOG sets it for a run (a longer buffer absorbs less often: A/B timing).
BLIND_BACKLOG = max(1, int(os.environ.get("SPECPILOT_BLIND_BACKLOG", "16")))


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers (0-based) whose outputs fc fuses, in order
    norm_before_residual: bool


def aux_layers_of(config: dict, n_target_layers: int, fail) -> tuple[int, ...]:
    """The target layers whose outputs the head reads (see the module docstring for the two conventions)."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    found = []
    if nested is not None:
        found.append(("eagle_config.eagle_aux_hidden_state_layer_ids", nested, 0))
    if top is not None:
        found.append(("eagle_aux_hidden_state_layer_ids", top, 1))  # vLLM: capture points, layer id - 1's output
    for key, ids, _ in found:
        if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
            fail(f"config key {key} must list three layer ids, got {ids!r}")
    layers = {key: tuple(i - shift for i in ids) for key, ids, shift in found}
    if len(set(layers.values())) > 1:
        fail("config keys eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: layer outputs) and "
             "eagle_aux_hidden_state_layer_ids (vLLM: layer inputs) name different target layers: "
             + ", ".join(f"{k} -> outputs of layers {list(v)}" for k, v in layers.items()))
    if layers:
        key, chosen = next(iter(layers.items()))
    else:
        key, chosen = "the default", (1, n_target_layers // 2 - 1, n_target_layers - 4)
    if any(not 0 <= i < n_target_layers for i in chosen):
        fail(f"reads the outputs of target layers {list(chosen)} ({key}), but the target has layers "
             f"0..{n_target_layers - 1}")
    return chosen


def read_config(directory: Path, fail) -> dict:
    """The head's config.json as a dict."""
    path = directory / "config.json"
    if not path.is_file():
        fail("has no config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"config.json is not valid JSON: {e}")


def check_config(raw: dict, target: Transformer, fail) -> tuple[Eagle3Config, object]:
    """The head's config checked against the target, and the HF LlamaConfig its rotary embedding comes from."""
    arch = raw.get("architectures") or []
    if ARCHITECTURE not in arch:
        fail(f"config.json names architectures {arch}, not [{ARCHITECTURE!r}] (an EAGLE-3 head)")
    if raw.get("num_hidden_layers", 1) != 1:
        fail(f"has {raw['num_hidden_layers']} decoder layers; heads of one (midlayer.*) are supported")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        fail(f"MLP activation {raw['hidden_act']!r} is not supported (silu)")
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False:
        fail("does not read the target's hidden states (eagle_config.use_aux_hidden_state false): not EAGLE-3")
    if raw.get("fc_norm") or raw.get("norm_output", True) is False:
        fail("uses SpecForge's fc_norm / norm_output variants, which SGLang's and vLLM's loaders do not read")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(raw.get(key), int):
            fail(f"config.json lacks the integer {key}")
    cfg_t = target.cfg
    hidden = raw["hidden_size"]
    target_hidden = raw.get("target_hidden_size") or hidden
    if target_hidden != cfg_t.hidden_size:
        fail(f"reads target hidden states of size {target_hidden} (fc takes 3 x {target_hidden}), the target's are "
             f"{cfg_t.hidden_size}")
    if raw["vocab_size"] != cfg_t.vocab_size:
        fail(f"has vocab_size {raw['vocab_size']}, the target has {cfg_t.vocab_size} token ids")
    draft_vocab = raw.get("draft_vocab_size") or raw["vocab_size"]
    if not 0 < draft_vocab <= raw["vocab_size"]:
        fail(f"draft_vocab_size {draft_vocab} must be between 1 and vocab_size {raw['vocab_size']}")
    n_heads = raw["num_attention_heads"]
    n_kv = raw.get("num_key_value_heads") or n_heads
    if n_heads % n_kv:
        fail(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    from transformers import LlamaConfig

    hf = LlamaConfig.from_dict(raw)
    cfg = Eagle3Config(
        hidden_size=hidden, target_hidden_size=target_hidden, intermediate_size=raw["intermediate_size"],
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=raw.get("head_dim") or hidden // n_heads,
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)), vocab_size=raw["vocab_size"], draft_vocab_size=draft_vocab,
        aux_layers=aux_layers_of(raw, cfg_t.n_layers, fail),
        norm_before_residual=bool(raw.get("norm_before_residual", False)))
    return cfg, hf


def read_weights(directory: Path, fail) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        fail("has no *.safetensors file (EAGLE-3 heads are read from safetensors)")
    weights = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    weights[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own types for a truncated or foreign file
            fail(f"could not read {f.name}: {type(e).__name__}: {e}")
    return weights


def weight_shapes(cfg: Eagle3Config) -> tuple[dict, dict]:
    """The shapes of a head's weights by name (module docstring): those it must have, those it may have."""
    H, Ht, I, V, Vd = (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.vocab_size,
                       cfg.draft_vocab_size)
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    required = {"fc.weight": (H, 3 * Ht), "midlayer.input_layernorm.weight": (H,),
                "midlayer.hidden_norm.weight": (H,), a + "q_proj.weight": (q_out, 2 * H),
                a + "k_proj.weight": (kv_out, 2 * H), a + "v_proj.weight": (kv_out, 2 * H),
                a + "o_proj.weight": (H, q_out), "midlayer.post_attention_layernorm.weight": (H,),
                m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H), m + "down_proj.weight": (H, I),
                "norm.weight": (H,)}
    optional = {"fc.bias": (H,), a + "q_proj.bias": (q_out,), a + "k_proj.bias": (kv_out,),
                a + "v_proj.bias": (kv_out,), a + "o_proj.bias": (H,), "lm_head.weight": (Vd, H),
                "embed_tokens.weight": (V, H), "d2t": (Vd,), "t2d": (V,)}
    return required, optional


def failing(source: str):
    def fail(why: str):
        raise SpecPilotError(f"EAGLE-3 head {source}: {why}")
    return fail


class Eagle3Head:
    """A loaded head in the target's dtype and device: q/k/v and gate/up fused into one matrix each (as Block does),
    the target's embeddings (and its LM-head rows of the draft vocabulary) where the head has none, and each draft
    id's target id."""

    def __init__(self, directory: str | Path, target: Transformer):
        directory = Path(directory)
        fail = failing(str(directory))
        if not directory.is_dir():
            fail("is not a directory")
        self._build(read_config(directory, fail), read_weights(directory, fail), target, str(directory))

    @classmethod
    def from_weights(cls, config: dict, weights: dict[str, torch.Tensor], target: Transformer,
                     source: str) -> "Eagle3Head":
        """A head from its config.json's dict and its tensors by name (as in the safetensors), checked the same."""
        head = cls.__new__(cls)
        head._build(config, weights, target, source)
        return head

    def _build(self, raw: dict, weights: dict[str, torch.Tensor], target: Transformer, source: str) -> None:
        fail = failing(source)
        cfg, hf = check_config(raw, target, fail)
        H, V = cfg.hidden_size, cfg.vocab_size
        a, m = "midlayer.self_attn.", "midlayer.mlp."
        required, optional = weight_shapes(cfg)
        for name in weights:
            if name not in required and name not in optional:
                fail(f"has a weight {name!r} that an EAGLE-3 head of one decoder layer does not have")
        for name, shape in {**required, **optional}.items():
            if name not in weights:
                if name in required:
                    fail(f"lacks the weight {name!r}")
                continue
            if tuple(weights[name].shape) != shape:
                fail(f"weight {name!r} has shape {list(weights[name].shape)}, expected {list(shape)} from "
                     f"config.json and the target")
        biases = [a + f"{n}_proj.bias" for n in "qkv"]
        if any(b in weights for b in biases) and not all(b in weights for b in biases):
            fail("has biases for some of q/k/v_proj but not all")

        self.cfg, self.source = cfg, source
        self.draft_to_target = self._vocabulary(weights, cfg, fail).to(target.device)
        dtype, device = target.dtype, target.device

        def take(name: str) -> torch.Tensor | None:
            t = weights.get(name)
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        self.fc, self.fc_bias = take("fc.weight"), take("fc.bias")
        self.input_norm, self.hidden_norm = take("midlayer.input_layernorm.weight"), take("midlayer.hidden_norm.weight")
        self.wqkv = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])
        self.bqkv = torch.cat([take(b) for b in biases]) if biases[0] in weights else None
        self.wo, self.bo = take(a + "o_proj.weight"), take(a + "o_proj.bias")
        self.post_norm = take("midlayer.post_attention_layernorm.weight")
        self.w13 = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        self.w2 = take(m + "down_proj.weight")
        self.norm = take("norm.weight")
        if "embed_tokens.weight" in weights:
            self.embed = take("embed_tokens.weight")
        elif H != target.cfg.hidden_size:
            fail(f"has no embed_tokens.weight, and the target's embeddings are {target.cfg.hidden_size} wide, "
                 f"the head's hidden size {H}")
        else:
            self.embed = target.embed
        if "lm_head.weight" in weights:
            self.lm_head = take("lm_head.weight")
        elif H != target.cfg.hidden_size:
            fail(f"lacks the weight 'lm_head.weight' (the target's LM head serves only a head with the target's "
                 f"hidden size, {target.cfg.hidden_size}, not {H})")
        elif torch.equal(self.draft_to_target, torch.arange(V, device=target.device)):
            self.lm_head = target.lm_head
        else:
            self.lm_head = target.lm_head.detach()[self.draft_to_target].contiguous()  # its draft vocabulary's rows
        inv_freq, self.attention_scaling = rope_inv_freq(hf)
        self.inv_freq = inv_freq.float()
        self.dtype, self.device = dtype, device
        # The decoder layer as the fused layer's kernels read a Block (kernels/triton_fused_layer.py `draft_layer`):
        # the post-attention norm is the MLP's; q/k/v read the [embedding; hidden] pair, normed here (`fused_step`)
        self.block = SimpleNamespace(
            cfg=SimpleNamespace(head_dim=cfg.head_dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                intermediate_size=cfg.intermediate_size, rms_eps=cfg.rms_eps, qk_norm=False),
            attn_norm=self.input_norm, wqkv=self.wqkv, bqkv=self.bqkv, wo=self.wo, bo=self.bo,
            mlp_norm=self.post_norm, w13=self.w13, w2=self.w2, window=None,
            _fused_weight_bytes=sum(w.numel() * w.element_size() for w in (self.wqkv, self.wo, self.w13, self.w2)))
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _vocabulary(weights, cfg: Eagle3Config, fail) -> torch.Tensor:
        """Each draft id's target id [Vd], from d2t (target id = draft id + d2t[draft id]), checked against t2d."""
        V, Vd = cfg.vocab_size, cfg.draft_vocab_size
        d2t = weights.get("d2t")
        if d2t is None:
            if Vd != V:
                fail(f"has a draft vocabulary of {Vd} ids but no d2t map to the target's {V}")
            ids = torch.arange(V)
        else:
            if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
                fail(f"d2t must hold integer offsets, got {d2t.dtype}")
            ids = torch.arange(Vd) + d2t.long()
            bad = (ids < 0) | (ids >= V)
            if bad.any():
                i = int(bad.nonzero()[0])
                fail(f"d2t maps draft id {i} to target id {int(ids[i])}, outside the target's 0..{V - 1}")
            if ids.unique().numel() != Vd:
                fail("d2t maps two draft ids to the same target id")
        t2d = weights.get("t2d")
        if t2d is not None:
            if t2d.dtype != torch.bool:
                fail(f"t2d must be a bool mask over the target vocabulary, got {t2d.dtype}")
            if int(t2d.sum()) != Vd or not bool(t2d[ids].all()):
                fail("t2d does not mark exactly the target ids that d2t maps the draft vocabulary to")
        return ids

    def ensure_rope(self, max_len: int) -> None:
        """cos/sin tables [max_len, head_dim] in the model dtype, as Transformer._ensure_rope computes them."""
        if self.rope is not None and self.rope[0].shape[0] >= max_len:
            return
        self.rope = rope_tables(self.inv_freq, self.attention_scaling, max_len, self.device, self.dtype)

    def new_cache(self, rows: int, max_len: int) -> KVCache:
        self.ensure_rope(max_len)
        return KVCache(1, rows, self.cfg.n_kv_heads, max_len, self.cfg.head_dim, self.dtype, self.device)


def fuse(head: Eagle3Head, states: torch.Tensor, ops) -> torch.Tensor:
    """fc over the target's concatenated states [..., 3 Ht] -> [..., H]."""
    return ops.linear(states, head.fc, head.fc_bias)


def midlayer(head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             kv: torch.Tensor | None, ops, slots: torch.Tensor | None = None,
             visible: torch.Tensor | None = None, attend=None) -> torch.Tensor:
    """The decoder layer over pairs (tokens [B, T], hidden [B, T, H]) at `positions` [B, T]: writes their K/V to
    `kv` [2, B, kv_heads, S, head_dim] and attends to slots 0..position of the row; returns the pre-norm output.
    Draft-tree nodes (`Eagle3Drafter.propose_tree`) give their own cache `slots` [B, T] and the slots each may see,
    `visible` bool [B, T, S]. Training's unroll (tools/train/trainer.py) gives its own attention instead of a cache:
    `attend(q [B, T, heads, head_dim] after RoPE, k, v [B, T, kv_heads, head_dim])` -> [B, T, heads * head_dim]."""
    cfg = head.cfg
    B, T = tokens.shape
    eps, nh, nkv, hd = cfg.rms_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    normed = ops.rmsnorm(hidden, head.hidden_norm, eps)
    residual = normed if cfg.norm_before_residual else hidden
    x = torch.cat([ops.rmsnorm(F.embedding(tokens, head.embed), head.input_norm, eps), normed], -1)
    q, k, v = ops.linear(x, head.wqkv, head.bqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
    cos, sin = (t[positions].unsqueeze(2) for t in head.rope)
    q, k = rotate(q.view(B, T, nh, hd), cos, sin), rotate(k.view(B, T, nkv, hd), cos, sin)
    if attend is not None:
        o = attend(q, k, v.view(B, T, nkv, hd))
    else:
        rows = torch.arange(B, device=tokens.device)[:, None].expand(B, T)
        kv[:, rows, :, positions if slots is None else slots] = torch.stack((k, v.view(B, T, nkv, hd)), 2)
        rep = nh // nkv
        if visible is None:
            visible = torch.arange(kv.shape[3], device=tokens.device)[None, None, :] <= positions[:, :, None]
        mask = visible[:, None, None].expand(B, 1, rep, T, kv.shape[3])
        q = q.view(B, T, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(B, nkv, rep * T, hd)
        o = ops.attention(q, kv[0], kv[1], mask.reshape(B, 1, rep * T, kv.shape[3]))
        o = o.view(B, nkv, rep, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, nh * hd)
    h = residual + ops.linear(o, head.wo, head.bo)
    gate, up = ops.linear(ops.rmsnorm(h, head.post_norm, eps), head.w13, None).chunk(2, dim=-1)
    return h + ops.linear(F.silu(gate) * up, head.w2, None)


def draft_logits(head: Eagle3Head, out: torch.Tensor, ops) -> torch.Tensor:
    """Logits over the draft vocabulary [..., Vd] from pre-norm outputs [..., H]."""
    return ops.linear(ops.rmsnorm(out, head.norm, head.cfg.rms_eps), head.lm_head, None)


def pair_inputs(head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ops):
    """What the fused layer's kernels take for a chain step's pairs (tokens [B, T], hidden [B, T, H] at `positions`):
    q/k/v's input [embedding; hidden] with each half normed, the residual stream, and RoPE's table rows."""
    cfg = head.cfg
    normed = ops.rmsnorm(hidden, head.hidden_norm, cfg.rms_eps)
    residual = normed if cfg.norm_before_residual else hidden
    x = torch.cat([ops.rmsnorm(F.embedding(tokens, head.embed), head.input_norm, cfg.rms_eps), normed], -1)
    cos, sin = (t[positions] for t in head.rope)
    return x, residual.contiguous(), cos, sin


def first_pairs(head: Eagle3Head, pending: torch.Tensor, n_new: torch.Tensor, history: torch.Tensor,
                lengths: torch.Tensor, kv: torch.Tensor, ops):
    """The new pairs of each row (module docstring) over `pending.shape[1]` slots: (tokens, fc's states, positions)."""
    S = history.shape[1]
    j = torch.arange(pending.shape[1], device=history.device)[None]
    positions = (lengths[:, None] - 2 - n_new[:, None] + j).clamp(0, S - 1)
    tokens = history.gather(1, (positions + 1).clamp(max=S - 1))
    return tokens, fuse(head, pending, ops), positions


def token_rows(tokens: torch.Tensor) -> torch.Tensor:
    """Each token's row, [B, T] int64 (b at [b, t]): what the fused layer's kernels index the cache by."""
    B, T = tokens.shape
    return torch.arange(B, device=tokens.device)[:, None].expand(B, T).contiguous()


def first_fused_inputs(head: Eagle3Head, pending, n_new, history, lengths, kv, ops):
    """first_draft's pairs as the fused layer's kernels take them (`pair_inputs`), their positions and rows."""
    tokens, hidden, positions = first_pairs(head, pending, n_new, history, lengths, kv, ops)
    return (*pair_inputs(head, tokens, hidden, positions, ops), positions, token_rows(tokens))


def next_fused_inputs(head: Eagle3Head, token, last, position, kv, ops):
    """next_draft's pair as the fused layer's kernels take it (`pair_inputs`), its position and row."""
    position = position.clamp(max=kv.shape[3] - 1)
    return (*pair_inputs(head, token[:, None], last, position, ops), position, token_rows(position))


def fused_step(head: Eagle3Head, inputs: tuple, kv: torch.Tensor, draft_layer):
    """`midlayer` and `draft_logits` of a chain step's pairs on the fused layer's kernels (`draft_layer`,
    kernels/triton_fused_layer.py: six kernels where the modular forward runs some fifteen), from `pair_inputs`, the
    pairs' positions and (optionally) their rows: (pre-norm outputs, logits [B, T, Vd]), or None where the kernels
    cannot run the step. Never inside torch.compile (Dynamo does not trace these launches); `inputs` may come from
    compiled code."""
    x, residual, cos, sin, positions, *rows = inputs
    return draft_layer(head.block, x, residual, cos, sin, kv, positions, head.norm, head.lm_head, head.cfg.rms_eps,
                       *rows)


def copied_chain(tokens: torch.Tensor, copies: torch.Tensor, found: torch.Tensor, head_k: int):
    """The head's chain `tokens` [B, h] with each row's replaced by prompt lookup's `copies` [B, k] where the lookup
    found at least h (`found` [B]): (tokens [B, k], the head's rows filler past h; drafts a row; which rows copied;
    what each row would draft in a step of k, `Proposal.found`: at least head_k). Compiled with the drafter's steps
    (eagerly five kernels of every step)."""
    h, k = tokens.shape[1], copies.shape[1]
    copy = found >= h
    chain = torch.where(copy[:, None], copies, F.pad(tokens, (0, k - h)))
    return chain, torch.where(copy, found, h), copy, found.clamp(min=head_k)


def greedy_draft(head: Eagle3Head, out: torch.Tensor, logits: torch.Tensor, new: torch.Tensor | None,
                 lengths: torch.Tensor, i: int, kv: torch.Tensor, ops, earlier: list | None):
    """Draft i of a greedy chain on the fused layer's kernels, from the forward that drafts it (out [B, T, H], logits
    [B, T, Vd]; the chain's first forward, `new` given: at each row's last new pair, slot `new`; later ones: T = 1):
    with `earlier` None, its target id [B] and the next draft step's fused inputs (`next_fused_inputs`: the pair of
    this draft and the head's output, at position lengths - 1 + i); with `earlier`, the chain's drafts before it,
    the chain's tokens [B, i + 1] and their count a row. Compiled, one call a draft: the gathers, the argmax, the d2t
    map and the next pair's inputs are two or three kernels, where eagerly they were some eight (a draft step of
    ~16 kernels in the captured steps: at B = 1 on the H100 each of the head's forwards added ~0.08 ms to a step of
    0.45, its verification ~0.024 a token; fiftieth lease, L)."""
    if new is not None:
        at = new[:, None, None]
        out = out.gather(1, at.expand(-1, 1, out.shape[-1]))
        logits = logits.gather(1, at.expand(-1, 1, logits.shape[-1]))
    token = head.draft_to_target[logits[:, 0].argmax(-1)]
    if earlier is not None:
        tokens = torch.stack([*earlier, token], 1)
        return tokens, torch.full_like(lengths, tokens.shape[1])
    return token, next_fused_inputs(head, token, out, (lengths + (i - 1))[:, None], kv, ops)


def pend_pair(pending: torch.Tensor, new: torch.Tensor, hidden: torch.Tensor) -> None:
    """An AR step that skipped the head's search: its pair (the target's states of its one token, hidden [B, 1 or
    more, 3 x target hidden]) into each row's pending buffer after those already there, the last slot kept for the
    newest when full (the decoder absorbs a full buffer first). Compiled with the head's steps: eagerly it was four
    kernels in every such step. An indexed store, not scatter_, which compiled ran on a copy of the whole buffer
    (`decode._record` says more)."""
    at = (new + 1).clamp(max=pending.shape[1] - 1)
    pending[torch.arange(pending.shape[0], device=pending.device), at] = hidden[:, 0].to(pending.dtype)
    new.copy_(at)


def keep_pairs(pending: torch.Tensor, new: torch.Tensor, hidden: torch.Tensor, accepted: torch.Tensor) -> None:
    """A step that searched: each row's pairs of its accepted slots (hidden [B, T, 3 x target hidden]) become its new
    pending ones, from slot 0; the slots past them zero (pending's first k + 1 slots are given). Compiled with the
    head's steps (eagerly six kernels in every verifying step). torch.where, not a product: the slots past the
    accepted ones may hold anything, NaN included (a layer that skips dead tokens never wrote them)."""
    T = hidden.shape[1]
    kept = (torch.arange(T, device=hidden.device)[None] <= accepted[:, None])[..., None]
    pending[:, :T] = torch.where(kept, hidden, 0).to(pending.dtype)
    pending[:, T:] = 0
    new.copy_(accepted)


def absorb_pairs(head: Eagle3Head, pending: torch.Tensor, n_new: torch.Tensor, history: torch.Tensor,
                 lengths: torch.Tensor, kv: torch.Tensor, ops) -> None:
    """The new pairs of each row (`first_pairs`, over all of `pending`'s slots) into the head's cache, nothing
    drafted: `first_draft`'s forward without its logits."""
    midlayer(head, *first_pairs(head, pending, n_new, history, lengths, kv, ops), kv, ops)


def first_draft(head: Eagle3Head, pending: torch.Tensor, n_new: torch.Tensor, history: torch.Tensor,
                lengths: torch.Tensor, kv: torch.Tensor, ops):
    """The new pairs of each row (module docstring) in one forward over `pending.shape[1]` slots; returns the
    pre-norm output at each row's last new pair [B, 1, H] and its draft logits [B, Vd]."""
    tokens, hidden, positions = first_pairs(head, pending, n_new, history, lengths, kv, ops)
    out = midlayer(head, tokens, hidden, positions, kv, ops)
    last = out.gather(1, n_new[:, None, None].expand(out.shape[0], 1, out.shape[-1]))
    return last, draft_logits(head, last[:, 0], ops)


def next_draft(head: Eagle3Head, token: torch.Tensor, last: torch.Tensor, position: torch.Tensor,
               kv: torch.Tensor, ops):
    """One more draft step: (the head's previous output, the token it drafted) at `position` [B, 1]."""
    out = midlayer(head, token[:, None], last, position.clamp(max=kv.shape[3] - 1), kv, ops)
    return out, draft_logits(head, out[:, 0], ops)


def draft_nodes(head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, visible: torch.Tensor, kv: torch.Tensor, ops):
    """One draft step for several tree nodes a row at once: (each node's token [B, T], its parent's head output
    [B, T, H]) at `positions`, written to cache `slots`, each seeing the `visible` slots; outputs and logits
    [B, T, Vd]."""
    out = midlayer(head, tokens, hidden, positions, kv, ops, slots, visible)
    return out, draft_logits(head, out, ops)


@dataclass(frozen=True)
class TreeLevel:
    """The nodes of one depth of a static tree, as the head drafts them: node `nodes[i]` gets the `rank[i]`-th best
    draft of the parent `parent[i]` (an index into the level above's `expand`ed nodes; the root for depth 1), and
    the head runs on the nodes `expand` (indices into `nodes`: those with children; None at the deepest level)."""
    nodes: torch.Tensor
    parent: torch.Tensor
    rank: torch.Tensor
    width: int  # the most drafts a parent ranks: the level's largest rank + 1
    expand: torch.Tensor | None


def tree_levels(shape: TreeShape, draft_vocab: int, device) -> list[TreeLevel]:
    """The levels of `shape`, depth 1 to its depth (refused when a node's rank needs more draft ids than the head
    has)."""
    has_children = {p for p in shape.parents if p >= 0}
    above, levels = [0], []  # the nodes expanded at the level above: the root first
    for d in range(1, shape.depth + 1):
        nodes = [n for n in range(shape.nodes) if shape.depths[n] == d]
        rank = [shape.paths[n][-1] for n in nodes]
        if max(rank) >= draft_vocab:
            raise SpecPilotError(f"tree path {list(shape.paths[nodes[rank.index(max(rank))]])} asks for a node's "
                             f"child of rank {max(rank)}; the head drafts from {draft_vocab} ids")
        expand = [i for i, n in enumerate(nodes) if n in has_children]
        levels.append(TreeLevel(torch.tensor(nodes, device=device),
                                torch.tensor([above.index(shape.parents[n]) for n in nodes], device=device),
                                torch.tensor(rank, device=device), max(rank) + 1,
                                torch.tensor(expand, device=device) if expand else None))
        above = [nodes[i] for i in expand]
    return levels


class Eagle3Drafter(Drafter):
    """Chain drafting with an EAGLE-3 head: k tokens a row, each the head's argmax mapped to its target id (sampled:
    drawn from the head's warped distribution, returned as q over the target vocabulary).

    With prompt lookup (`lookup` n > 0): a row whose context's last n or more tokens (up to LOOKUP_MAX_NGRAM, the
    longest first) occurred earlier, with a whole chain's tokens after that occurrence, drafts those tokens instead
    of the head's (a one-hot q where sampled). Where a model copies from its context (code, retrieved passages,
    summaries), a long match is the surer draft: on SmolLM2-135M's greedy answers to the workloads' prompts, a match
    of 6 tokens was the target's next token 84-94% of the time against the head's 63-79% there (teacher-forced,
    `benchmarks/run.py head_vocab`, forty-ninth session). The head still reads every row's new pairs each step (its cache must hold them), so its chain runs
    for all rows; the search adds one kernel a step. Chains only (a tree's nodes are the head's).

    A copied chain may be longer than the head's (`head_k` < k): the head drafts at most head_k a step, a row with
    a lookup match up to k, for the price of verifying them alone (a head's draft costs a forward, a copied one
    nothing). On those answers, teacher-forced, lookup's chain of up to 5 where it matched and the head's 3 elsewhere
    had τ 3.87 on code and 3.32 on rag against 3.10 and 2.69 with both 3 (`head_vocab --lookup-k 5`, fiftieth
    session). Each proposal's `found` tells the batch controller what a row would draft in a step of k:
    max(lookup's, head_k)."""

    name = "eagle3"
    refills = True  # a row's head cache and pending pair are set up anew for a request started in it (start_rows)
    backlog = BLIND_BACKLOG

    def __init__(self, head: Eagle3Head, k: int, lookup: int = 0, head_k: int | None = None):
        if k < 1:
            raise ValueError(f"an EAGLE-3 drafter needs k >= 1, got {k}")
        if not 0 <= lookup <= LOOKUP_MAX_NGRAM:
            raise ValueError(f"an EAGLE-3 drafter's prompt lookup needs 0 <= lookup <= {LOOKUP_MAX_NGRAM}, "
                             f"got {lookup}")
        head_k = k if head_k is None else head_k
        if not 1 <= head_k <= k or head_k < k and not lookup:
            raise ValueError(f"an EAGLE-3 drafter's chain needs 1 <= head_k <= k ({k}), below k only with prompt "
                             f"lookup (which alone drafts past the head's chain), got {head_k}")
        self.head, self.k, self.head_k = head, k, head_k
        self.lookup = NgramDrafter(LOOKUP_MAX_NGRAM, lookup) if lookup else None
        self.reports_found = self.lookup is not None
        self.needs_hidden_states = head.cfg.aux_layers
        self.ops = resolve_kernels()
        self.draft_layer = self.draft_supports = None
        self._first, self._next, self._nodes, self._absorb = first_draft, next_draft, draft_nodes, absorb_pairs
        self._pend, self._keep = pend_pair, keep_pairs
        self._first_inputs, self._next_inputs = first_fused_inputs, next_fused_inputs
        self._greedy_draft, self._copied = greedy_draft, copied_chain
        self._tree_levels: tuple | None = None  # (shape, device) and its tree_levels
        self._base: KVCache | None = None
        self.cache: KVCache | None = None  # the current batch's rows of `_base`
        # Each row's new pairs since the last propose: the target's states of up to k + 1 slots (zero past the
        # accepted ones) and how many were accepted; their tokens are read from the history at propose time. A step
        # that skipped the search appends its one pair (`update(searched=False)`), up to `backlog` of them.
        self._pending_base: torch.Tensor | None = None
        self._new_base: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None
        self._new: torch.Tensor | None = None
        self._base_last: torch.Tensor | None = None
        # Waiting requests' pairs and last states, made inside their prefill (`prefill_refills`) until they start
        self._refill: KVCache | None = None
        self._refill_last: torch.Tensor | None = None

    def prepare(self, ops, layer_fn, compile):
        self.ops = ops
        if self.lookup is not None:
            self.lookup.prepare(ops, layer_fn, compile)
        # the fused layer's (`layer: fused`): chain steps on its kernels where they run them (`draft_supports`: asked
        # before the step's inputs are made, so that a step the kernels cannot run costs nothing extra)
        self.draft_layer = getattr(layer_fn, "draft_layer", None)
        self.draft_supports = getattr(layer_fn, "draft_supports", None)
        if compile:
            self._first, self._next = compiled(first_draft), compiled(next_draft)
            self._nodes, self._absorb = compiled(draft_nodes), compiled(absorb_pairs)
            self._pend, self._keep = compiled(pend_pair), compiled(keep_pairs)
            self._first_inputs, self._next_inputs = compiled(first_fused_inputs), compiled(next_fused_inputs)
            self._greedy_draft, self._copied = compiled(greedy_draft), compiled(copied_chain)

    def reserve(self, rows, max_len):
        head = self.head
        if self._base is None or self._base.k.shape[1] < rows or self._base.max_len < max_len:
            self._base = head.new_cache(rows, max_len)
        if self._pending_base is None or self._pending_base.shape[0] < rows:
            self._pending_base = torch.zeros(rows, self.k + 1 + self.backlog, 3 * head.cfg.target_hidden_size,
                                             dtype=head.dtype, device=head.device)
            self._new_base = torch.zeros(rows, dtype=torch.long, device=head.device)
            # each prompt's last states, from the prefill's pass (`prefill_prompts`), until `prefill` pends them
            self._base_last = torch.zeros(rows, 3 * head.cfg.target_hidden_size, dtype=head.dtype,
                                          device=head.device)

    def prefill_prompts(self, tokens, positions, lengths, hidden=None):
        self._prompt_pass(tokens, positions, lengths, hidden, self._base, self._base_last)

    def prefill(self, tokens, positions, max_len, hidden=None, lengths=None):
        B = tokens.shape[0]
        self.reserve(B, max_len)
        if hidden is not None:  # (a caller whose prefill did not run prefill_prompts)
            if lengths is None:
                raise ValueError("the EAGLE-3 drafter's prefill needs the prompts' lengths with their hidden states")
            self.prefill_prompts(tokens, positions, lengths, hidden)
        self.cache = rows_of(self._base, B)
        self._pending, self._new = self._pending_base[:B], self._new_base[:B]
        self._pending.zero_()
        self._pending[:, 0].copy_(self._base_last[:B])
        self._new.zero_()

    def reserve_refills(self, rows, max_len):
        head = self.head
        if self._refill is None or self._refill.k.shape[1] < rows or self._refill.max_len < max_len:
            self._refill = head.new_cache(rows, max_len)
            self._refill_last = torch.zeros(rows, 3 * head.cfg.target_hidden_size, dtype=head.dtype,
                                            device=head.device)

    def prefill_refills(self, tokens, positions, lengths, hidden=None):
        self._prompt_pass(tokens, positions, lengths, hidden, self._refill, self._refill_last)

    def start_rows(self, rows, slots, width):
        # a row's slots past its prompt hold the previous request's entries, which the first propose and its draft
        # steps overwrite before any is read
        self.cache.kv[:, :, rows, :, :width] = self._refill.kv[:, :, slots, :, :width]
        pending = torch.zeros(rows.shape[0], *self._pending.shape[1:], dtype=self._pending.dtype,
                              device=self._pending.device)
        pending[:, 0].copy_(self._refill_last[slots])
        self._pending.index_copy_(0, rows, pending)
        self._new.index_fill_(0, rows, 0)

    def move_rows(self, live, rows):
        n = live.shape[0]
        kv = self._base.kv
        kv[:, :, :n] = kv[:, :, live]  # (the gather copies before the write)
        self._pending_base[:n] = self._pending_base[live]
        self._new_base[:n] = self._new_base[live]
        self.cache = rows_of(self._base, rows)
        self._pending, self._new = self._pending_base[:rows], self._new_base[:rows]

    def _prompt_pass(self, tokens, positions, lengths, hidden, cache: KVCache, last: torch.Tensor) -> None:
        """The prompts' pairs into rows 0..B-1 of `cache`, their last states into `last` (the batch's own rows, or
        the refill rows of requests waiting to start)."""
        if hidden is None:
            raise ValueError("the EAGLE-3 drafter's prefill needs the prompts' hidden states")
        self._prompt_pairs(tokens, positions, hidden, lengths, rows_of(cache, tokens.shape[0]).kv[:, 0])
        last[: tokens.shape[0]].copy_(self._last_states(hidden, lengths)[:, 0])

    def _prompt_pairs(self, tokens, positions, hidden, lengths, kv) -> None:
        """The head's cache entries of right-padded prompts [B, T]: pairs (state of token t, token t + 1) for t up to
        each prompt's second-to-last token; those past it (padding) are zeroed and land in slots that the first
        propose and its draft steps overwrite."""
        T = tokens.shape[1]
        if T > 1:
            inside = (torch.arange(T - 1, device=tokens.device)[None] < (lengths - 1)[:, None])[..., None]
            states = torch.where(inside, hidden[:, :-1], 0)
            midlayer(self.head, tokens[:, 1:], fuse(self.head, states, self.ops), positions[:, :-1], kv,
                     self.ops._replace(attention=attention_sdpa))

    @staticmethod
    def _last_states(hidden, lengths) -> torch.Tensor:
        """Each prompt's last token's states [B, 1, n * hidden]: the first pair, with the first generated token,
        which the next propose runs."""
        return hidden.gather(1, (lengths - 1)[:, None, None].expand(hidden.shape[0], 1, hidden.shape[-1]))

    def _fused(self, n_tokens: int, device) -> bool:
        """Whether a chain step of `n_tokens` pairs runs on the fused layer's kernels."""
        return self.draft_layer is not None and (self.draft_supports is None
                                                 or self.draft_supports(self.head.block, n_tokens, device))

    def _draft_first(self, history, lengths):
        """`first_draft`: on the fused layer's kernels where the recipe's layer is fused and they run the step."""
        head, kv, ops = self.head, self.cache.kv[:, 0], self.ops
        pending = self._pending[:, : self.k + 1]  # (a backlog, if any, was absorbed before: `absorb`)
        args = (head, pending, self._new, history, lengths, kv, ops)
        if self._fused(history.shape[0] * pending.shape[1], history.device):
            fused = fused_step(head, self._first_inputs(*args), kv, self.draft_layer)
            if fused is not None:
                out, logits = fused
                at = self._new[:, None, None]
                return (out.gather(1, at.expand(-1, 1, out.shape[-1])),
                        logits.gather(1, at.expand(-1, 1, logits.shape[-1]))[:, 0])
        return self._first(*args)

    def _draft_next(self, token, last, position):
        """`next_draft`, on the fused layer's kernels where they run the step."""
        head, kv, ops = self.head, self.cache.kv[:, 0], self.ops
        if self._fused(token.shape[0], token.device):
            fused = fused_step(head, self._next_inputs(head, token, last, position, kv, ops), kv, self.draft_layer)
            if fused is not None:
                return fused[0], fused[1][:, 0]
        return self._next(head, token, last, position, kv, ops)

    def _greedy_fused_chain(self, history, lengths, k: int):
        """A greedy chain of k drafts on the fused layer's kernels, each draft's glue one compiled call
        (`greedy_draft`): (tokens [B, k], their count a row), or None where the kernels cannot run its steps (then
        `propose` goes step by step, each on the modular layer where the kernels cannot run it)."""
        head, kv, ops = self.head, self.cache.kv[:, 0], self.ops
        pending = self._pending[:, : self.k + 1]  # (a backlog, if any, was absorbed before: `absorb`)
        B = history.shape[0]
        if not self._fused(B * pending.shape[1], history.device) or k > 1 and not self._fused(B, history.device):
            return None
        inputs = self._first_inputs(head, pending, self._new, history, lengths, kv, ops)
        new, tokens = self._new, []
        for i in range(k):
            step = fused_step(head, inputs, kv, self.draft_layer)
            if step is None:  # (`_fused` asked the kernels the same question before anything ran)
                raise RuntimeError(f"the fused layer refused a chain step of {tuple(inputs[0].shape[:2])} tokens, "
                                   "which it said it runs")
            if i + 1 == k:
                return self._greedy_draft(head, *step, new, lengths, i, kv, ops, tokens)
            token, inputs = self._greedy_draft(head, *step, new, lengths, i, kv, ops, None)
            tokens.append(token)
            new = None

    def propose(self, history, lengths, k, sampling, generator):
        head = self.head
        k = min(k, self.head_k)
        chain = self._greedy_fused_chain(history, lengths, k) if sampling.greedy else None
        if chain is not None:
            tokens, valid = chain
            if self.lookup is not None:
                return self._looked_up(history, lengths, tokens, None)
            return Proposal(tokens, valid)
        last, logits = self._draft_first(history, lengths)
        tokens, probs = [], []
        for i in range(k):
            if sampling.greedy:
                tok = head.draft_to_target[logits.argmax(-1)]
            else:
                q = probabilities(logits, sampling)  # over the draft vocabulary
                tok = head.draft_to_target[categorical(q, generator)]
                full = q.new_zeros(q.shape[0], head.cfg.vocab_size)
                probs.append(full.scatter_(1, head.draft_to_target[None].expand_as(q), q))
            tokens.append(tok)
            if i + 1 < k:
                last, logits = self._draft_next(tok, last, (lengths - 2 + i + 1)[:, None])
        tokens, probs = torch.stack(tokens, 1), (torch.stack(probs, 1) if probs else None)
        if self.lookup is not None:
            return self._looked_up(history, lengths, tokens, probs)
        return Proposal(tokens, torch.full_like(lengths, k), probs)

    def _looked_up(self, history, lengths, tokens, probs) -> Proposal:
        """The head's chain `tokens` [B, h] (and q `probs`), each row's replaced by prompt lookup's where the lookup
        found at least h drafts (class docstring): then up to k of them (the search costs the same for any length;
        the decoder verifies as many as its step is wide). Tokens [B, k], the head's rows filler past h."""
        h = tokens.shape[1]
        found = self.lookup.propose(history, lengths, self.k, None, None)
        tokens, valid, copy, reported = self._copied(tokens, found.tokens, found.valid, self.head_k)
        if probs is not None:
            one_hot = F.one_hot(tokens, probs.shape[-1]).to(probs.dtype)
            probs = torch.where(copy[:, None, None], one_hot, torch.cat([probs, one_hot[:, h:]], 1))
        return Proposal(tokens, valid, probs, found=reported)

    def propose_tree(self, history, lengths, shape: TreeShape):
        """Greedy draft-tree nodes 1..N-1 of a static tree (engine/tree.py) for every row: tokens [B, N - 1], all
        valid. Level by level: the new pairs' forward gives the root's ranking (as `propose`'s first draft), then
        one head forward a depth over the nodes that have children, each fed its token and its parent's head output
        (as a chain's next draft step) and ranking its children. In the head's cache, as in the target's tree step,
        node n of a row whose root has its head entry at position R (the root's position - 1) sits at position
        R + depth(n), slot R + n, and sees the slots before R and its ancestors' (itself included). The next
        `propose` / `propose_tree` rewrites the accepted path's slots with the target's own states (`update`)."""
        if self._tree_levels is None or self._tree_levels[0] != (shape, history.device):
            # made once per shape, outside any capture: a host list copied to the device inside a captured step is
            # refused (H200, seventeenth lease: every static-tree replay recipe failed its warm-up)
            self._tree_levels = ((shape, history.device),
                                 tree_levels(shape, self.head.cfg.draft_vocab_size, history.device),
                                 shape.ancestors(history.device),
                                 torch.tensor(shape.depths, device=history.device))
        _, levels, ancestors, depths = self._tree_levels
        head, kv, ops = self.head, self.cache.kv[:, 0], self.ops
        S = kv.shape[3]  # the head's cache may be longer than the target's (a dynamic tree's margin)
        root_entry = lengths - 2
        positions, slots = (t.clamp(max=S - 1) for t in tree_positions(root_entry, depths))
        visible = tree_mask(root_entry, ancestors, S)
        out, logits = self._draft_first(history, lengths)
        logits = logits[:, None]  # [B, nodes expanded at the level above, Vd]: the root
        drafts = []
        for level in levels:
            ranked = logits.topk(level.width, -1).indices  # [B, parents, width]
            tokens = head.draft_to_target[ranked[:, level.parent, level.rank]]  # [B, the level's nodes]
            drafts.append(tokens)
            if level.expand is not None:
                nodes = level.nodes[level.expand]
                out, logits = self._nodes(head, tokens[:, level.expand], out[:, level.parent[level.expand]],
                                          positions[:, nodes], slots[:, nodes], visible[:, nodes], kv, ops)
        tokens = torch.cat(drafts, 1)  # nodes are numbered by depth, so the levels in order are nodes 1..N-1
        return tokens, torch.ones_like(tokens, dtype=torch.bool)

    def propose_dynamic_tree(self, history, lengths, spec: DynamicTree):
        """EAGLE-2's dynamic tree for every row (`grow_dynamic_tree`): tokens [B, N - 1] (all valid) and the rows'
        trees (`RowTrees`). The new pairs' forward gives the root's drafts, then one head forward a level runs the
        level's beam (topk nodes a row), each fed its token and its parent's head output as a chain's draft step.
        In the head's cache the beam node j of depth d sits at position R + d and slot R + 1 + (d - 1) x topk + j
        (R = the root's entry, its position - 1: the slots past the verified tree's N that this needs are the
        decoder's margin) and sees the slots up to R and its beam ancestors'."""
        head, kv, ops = self.head, self.cache.kv[:, 0], self.ops
        if spec.topk > head.cfg.draft_vocab_size:
            raise SpecPilotError(f"a dynamic tree of topk {spec.topk}: the head drafts from "
                                 f"{head.cfg.draft_vocab_size} ids")
        S, K = kv.shape[3], spec.topk
        root_entry = lengths - 2
        slot = torch.arange(S, device=history.device)
        out, logits = self._draft_first(history, lengths)
        seen = (slot[None] <= root_entry[:, None])[:, None]  # [B, nodes of the last forward, S]: the root's
        beam_slots = root_entry[:, None] + 1 + torch.arange(K, device=history.device)[None]

        def expand(depth, drafts, parent):
            nonlocal out, seen
            slots = (beam_slots + (depth - 1) * K).clamp(max=S - 1)
            seen = seen.gather(1, parent[..., None].expand(-1, -1, S)) | (slot[None, None] == slots[..., None])
            hidden = out.gather(1, parent[..., None].expand(-1, -1, out.shape[-1]))
            positions = (root_entry[:, None] + depth).clamp(max=S - 1).expand(-1, K)
            out, logits = self._nodes(head, head.draft_to_target[drafts], hidden, positions, slots, seen, kv, ops)
            return logits

        drafts, trees = grow_dynamic_tree(logits, expand, spec)
        tokens = head.draft_to_target[drafts]
        return tokens, torch.ones_like(tokens, dtype=torch.bool), trees

    def update(self, accepted, hidden=None, searched=True):
        if hidden is None:
            raise ValueError("the EAGLE-3 drafter's update needs the step's hidden states")
        if not searched:  # an AR step: its one pair after those still pending (the decoder absorbs a full buffer)
            return self._pend(self._pending, self._new, hidden)
        self._keep(self._pending[:, : self.k + 1], self._new, hidden, accepted)

    def absorb(self, history, lengths):
        """The pending pairs of the steps that skipped the search (`update(searched=False)`) into the head's cache,
        in one forward over the whole buffer; then the buffer is as after an AR step that searched: the last pair
        pending alone (the next propose runs it again, for its output)."""
        self._absorb(self.head, self._pending, self._new, history, lengths, self.cache.kv[:, 0], self.ops)
        last = self._pending.gather(1, self._new[:, None, None].expand(-1, 1, self._pending.shape[-1]))
        self._pending[:, 1:].zero_()
        self._pending[:, :1].copy_(last)
        self._new.zero_()

    def snapshot(self):
        if self._pending is None:
            return None
        return self._pending.clone(), self._new.clone()

    def restore(self, state):
        # The K/V cache needs no restoring: steps only write slots at or past the new pairs' first position, which
        # the next propose writes again before reading (module docstring).
        if state is not None:
            self._pending.copy_(state[0])
            self._new.copy_(state[1])


RANDOM_HEAD = "random-eagle3"  # drafter.model of a replay recipe: a head of the target's shape, random weights


def load_head(spec: str | Path, target: Transformer) -> Eagle3Head:
    """The head in directory `spec` (or an alias / cached hub id of one: loader.source_dir) for this target;
    RANDOM_HEAD: `random_head(target)`."""
    from . import loader

    if str(spec) == RANDOM_HEAD:
        return random_head(target)
    return Eagle3Head(loader.source_dir(str(spec)), target)


RANDOM_HEAD_VOCAB = 32000  # the random head's draft vocabulary (SpecForge's default for Llama 3)


@torch.no_grad()
def random_head(target: Transformer, draft_vocab: int = RANDOM_HEAD_VOCAB, seed: int = 0) -> Eagle3Head:
    """An EAGLE-3 head of the shape SpecForge trains for this target (its hidden and MLP sizes, heads and head_dim, a
    draft vocabulary of `draft_vocab` ids, the default aux layers), random weights drawn on the target's device:
    what a head's forward costs there, with no checkpoint (the replay drafter's cost, issue #24)."""
    c = target.cfg
    H, I, V, L = c.hidden_size, c.intermediate_size, c.vocab_size, c.n_layers
    Vd = min(draft_vocab, V)
    config = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu", "hidden_size": H,
              "intermediate_size": I, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
              "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_eps, "rope_theta": 10000.0,
              "max_position_embeddings": 4096, "vocab_size": V, "draft_vocab_size": Vd,
              # the default layers (aux_layers_of), kept within a target of few layers
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [min(1, L - 1), max(0, L // 2 - 1), max(0, L - 4)]}}
    g = torch.Generator(device=target.device).manual_seed(seed)
    shapes = weight_shapes(Eagle3Config(H, H, I, c.n_heads, c.n_kv_heads, c.head_dim, c.rms_eps, V, Vd, (), False))
    weights = {}
    for name, shape in {**shapes[0], "lm_head.weight": (Vd, H)}.items():  # norms 1, matrices N(0, 1 / fan-in)
        weights[name] = (torch.ones(shape, device=target.device, dtype=target.dtype) if len(shape) == 1 else
                         torch.randn(shape, generator=g, device=target.device, dtype=target.dtype) / shape[1] ** 0.5)
    weights["d2t"] = torch.zeros(Vd, dtype=torch.long)  # the draft vocabulary: the target's first Vd ids
    return Eagle3Head.from_weights(config, weights, target, f"{RANDOM_HEAD} (seed {seed})")
