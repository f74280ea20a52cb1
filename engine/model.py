"""One Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2, Qwen3) over a static KV cache.

The forward pass takes per-row positions, so one call serves prefill, single-token decode, chain verification and
ragged batches alike: row b's tokens sit at cache slots `positions[b]`, and a query at position p attends to slots
0..p of its own row (stale slots beyond p, left by rejected drafts, are masked and later overwritten).
Numerics follow HF transformers (RMSNorm in fp32, rotary tables in fp32 cast to the model dtype) so that logits
match HF's own model on the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import Kernels, resolve

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    qk_norm: bool
    tie_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        if hf.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {hf.model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported MLP activation {act!r} (supported: silu)")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        window = getattr(hf, "sliding_window", None)
        if hf.model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        layer_types = getattr(hf, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * hf.num_hidden_layers
        return cls(
            model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
            n_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads, head_dim=head_dim,
            rms_eps=hf.rms_norm_eps, qk_norm=hf.model_type == "qwen3",
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
        )


def rope_inv_freq(hf) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as HF computes them (all rope types via HF's table)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](hf)
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    dim = int(dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


class KVCache:
    """Preallocated keys and values, [layers, batch, kv_heads, max_len, head_dim] each, as the two halves of one
    tensor `kv` [2, layers, ...] so that a layer writes its new keys and values with one scatter, not two."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        self.kv = torch.zeros((2, n_layers, batch, n_kv_heads, max_len, head_dim), dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


# Compiled graphs a step function may hold. Each (batch bucket, kind of step, flags) is a static shape of its own,
# compiled once at warm-up, and dynamo counts them per function across every decoder of the process: the bench's
# seven batch buckets x five kinds of step x six systems passed 64 (FailOnRecompileLimitHit on the H200, issue #20).
RECOMPILE_LIMIT = 4096


def compiled(fn, mode: str = "default"):
    """torch.compile for step-shaped work: static shapes, one graph, enough cache entries for every step shape."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False, fullgraph=True, mode=None if mode == "default" else mode)


def compiled_dynamic(fn, backend="inductor"):
    """torch.compile for prefill-shaped work: batch and width symbolic, so every prompt width and group of requests
    shares a few compiled graphs (at most three on a CPU trace: the first shape's, a symbolic one, a batch of one's)
    instead of one a shape."""
    return torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)


def rope_tables(inv_freq: torch.Tensor, attention_scaling: float, max_len: int, device, dtype):
    """RoPE's (cos, sin) tables [max_len, head_dim] for positions 0..max_len-1, computed in fp32 as HF computes them
    and cast to `dtype`: the target, an EAGLE-3 head and its trainer share them."""
    pos = torch.arange(max_len, device=device).float()
    freqs = pos[:, None] * inv_freq.to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class TreeStep:
    """Where a tree step's nodes go (engine/tree.py): `slots` [B, N] their cache slots (not their positions:
    siblings share a position), `visible` bool [B, N, S] the cache slots each may attend to; `ancestor_bits` [B, N]
    int64 (trees of up to 64 nodes), the same for a fused layer: bit m set when node m is an ancestor of the node
    (itself included), node m at slot slots[:, 0] + m."""
    slots: torch.Tensor
    visible: torch.Tensor
    ancestor_bits: torch.Tensor | None = None


@dataclass
class Packing:
    """Where the N tokens of a packed forward (tokens [1, N]) belong: row `rows[n]` of the cache, and slot
    `slots[n]` of the padded layout [B, T] (row-major; B * T for a dead token, a trash slot) whose positions are
    `padded_positions` [B, T]. Ragged verification (engine/decode.py) packs each row's live tokens this way, so the
    layer's GEMMs see N tokens instead of B * T."""
    rows: torch.Tensor  # [N] long
    slots: torch.Tensor  # [N] long
    padded_positions: torch.Tensor  # [B, T] long


def unpacked(x: torch.Tensor, slots: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Packed rows x [N, ...] placed at their padded slots: [B, T, ...] (zeros where no token is; dead tokens go to
    a trash slot past the end, dropped)."""
    out = x.new_zeros((B * T + 1,) + x.shape[1:]).index_copy_(0, slots, x)
    return out[:-1].view((B, T) + x.shape[1:])


def packed(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpacked` for padded rows x [B * T, ...]: [N, ...] (dead tokens read zeros)."""
    return torch.cat([x, x.new_zeros((1,) + x.shape[1:])])[slots]


class Block(nn.Module):
    """Attention and MLP of one layer, with q/k/v and gate/up fused into one matrix each (fewer, larger GEMVs).

    The residual stream is carried as (x, delta): a layer starts by adding the previous layer's MLP output `delta`
    and returns its own MLP output unadded, so that add fuses into this layer's first norm kernel instead of ending
    the previous layer's compiled graph as a kernel of its own (one kernel a layer fewer; the sums are unchanged)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.window = cfg, cfg.sliding_windows[layer]
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.wqkv = nn.Parameter(torch.empty(qkv_out, cfg.hidden_size))
        self.bqkv: nn.Parameter | None = None
        self.wo = nn.Parameter(torch.empty(cfg.hidden_size, cfg.n_heads * cfg.head_dim))
        self.bo: nn.Parameter | None = None
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.w13 = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x, delta, cos, sin, kv_cache, rows, positions, mask, ops: Kernels, unpack=None, slots=None):
        cfg, linear = self.cfg, ops.linear
        B, T, _ = x.shape
        x = x + delta
        h = ops.rmsnorm(x, self.attn_norm, cfg.rms_eps)
        qkv = linear(h, self.wqkv, self.bqkv)
        q, k, v = qkv.split([cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim], -1)
        q = q.view(B, T, cfg.n_heads, cfg.head_dim)
        k = k.view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = ops.rmsnorm(q, self.q_norm, cfg.rms_eps), ops.rmsnorm(k, self.k_norm, cfg.rms_eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # kv_cache [2, B, kv_heads, S, head_dim]: the [B,T] index pairs select [B,T,2,kv_heads,head_dim] slots; a
        # token's slot is its position, but in a tree step (`slots`), where siblings share a position
        kv_cache[:, rows, :, positions if slots is None else slots] = torch.stack((k, v), 2)
        # Grouped-query attention without copying K/V: the `rep` query heads that share a kv head are stacked along
        # the query axis, so each kv head is read once by one SDPA call on any backend.
        rep = cfg.n_heads // cfg.n_kv_heads
        mask = mask[self.window]
        if unpack is not None:
            # Packed tokens (one row of N, each its own batch row and position; Packing): the attention slot takes
            # rows of queries over their row's cache, so the queries go to the padded layout the mask was built for
            # and come back. Each row's K/V is still read once; the slots no packed token fills are junk, not read.
            q = unpacked(q[0], unpack, mask.shape[0], mask.shape[2] // rep)
        Bq, Tq = q.shape[:2]
        q = q.view(Bq, Tq, cfg.n_kv_heads, rep, cfg.head_dim).permute(0, 2, 3, 1, 4).reshape(Bq, cfg.n_kv_heads, rep * Tq, cfg.head_dim)
        o = ops.attention(q, kv_cache[0], kv_cache[1], mask)
        o = o.view(Bq, cfg.n_kv_heads, rep, Tq, cfg.head_dim).permute(0, 3, 1, 2, 4).reshape(Bq, Tq, cfg.n_heads * cfg.head_dim)
        if unpack is not None:
            o = packed(o.reshape(Bq * Tq, -1), unpack)[None]
        x = x + linear(o, self.wo, self.bo)
        h = linear(ops.rmsnorm(x, self.mlp_norm, cfg.rms_eps), self.w13, None)
        gate, up = h.chunk(2, dim=-1)
        return x, linear(F.silu(gate) * up, self.w2, None)


def token_inputs(embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor,
                 positions: torch.Tensor, with_rows: bool = True):
    """What a forward's layers take for tokens [B, T] at `positions`, besides the cache: each token's cache row [B, T]
    (contiguous: a fused layer's kernels read it by token; None without `with_rows`), RoPE's rows at its position
    (cos, sin [B, T, 1, head_dim]), its embedding (the first layer's delta) and a zero residual stream. Eagerly five
    or six kernels in every captured step, compiled two or three (`Transformer.forward`'s `prologue`)."""
    B, T = tokens.shape
    rows = torch.arange(B, device=tokens.device)[:, None].expand(B, T).contiguous() if with_rows else None
    cos, sin = (t[positions].unsqueeze(2) for t in rope)
    delta = F.embedding(tokens, embed)
    return rows, cos, sin, delta, torch.zeros_like(delta)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = self.embed if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling
        self.default_ops = resolve()
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._retired_ropes: list[tuple[torch.Tensor, torch.Tensor]] = []  # see _ensure_rope

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache(self, batch: int, max_len: int, n_layers: int | None = None) -> KVCache:
        self._ensure_rope(max_len)
        return KVCache(n_layers or self.cfg.n_layers, batch, self.cfg.n_kv_heads, max_len, self.cfg.head_dim,
                       self.dtype, self.device)

    def _ensure_rope(self, max_len: int) -> None:
        if self._rope is not None and self._rope[0].shape[0] >= max_len and self._rope[0].device == self.device:
            return
        if self._rope is not None:
            # Kept alive: every decoder sharing this model (the bench runs several) has CUDA graphs that read the
            # table they were captured with; freed, its memory goes to other tensors under those graphs (issue #20).
            self._retired_ropes.append(self._rope)
        self._rope = rope_tables(self.inv_freq, self.attention_scaling, max_len, self.device, self.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                n_layers: int | None = None, logits_at: torch.Tensor | None = None, ops: Kernels | None = None,
                layer_fn=None, live: torch.Tensor | None = None, packing: Packing | None = None,
                aux_layers: tuple[int, ...] | None = None, tree: TreeStep | None = None, prologue=None):
        """Logits [B, T, vocab] for `tokens` [B, T] at cache slots `positions` [B, T]; writes their K/V to `cache`.

        `n_layers` runs only the first layers (then final norm and LM head): the layer-skip self-draft.
        `logits_at` [B, m] picks the token indices whose logits are wanted (prefill needs one row, not B*T*vocab).
        `ops` are the kernel-slot implementations and `layer_fn` the layer function (a compiled Block.forward).
        `live` (int32 [B * T]) marks with 0 the tokens whose logits nobody reads (verification slots past a row's
        valid drafts): a layer function that can skip them (`skips_dead_tokens`) does, and their logits are junk.
        `packing`: tokens [1, N] are packed tokens of several rows (Packing says where each belongs).
        `aux_layers` (layer indices i, 0-based): also return the residual stream after each of those layers, the
        output of layer i, concatenated in the order given: (logits, [B, T, len(aux_layers) * hidden]). An EAGLE-3
        head reads them (engine/eagle3.py); they come from this forward, at no extra pass.
        `tree`: the tokens are draft-tree nodes (engine/tree.py): their K/V go to `tree.slots`, and each attends where
        `tree.visible` says (the modular layer; a fused layer that takes the tree reads `tree.ancestor_bits`).
        `prologue`: `token_inputs` as the caller has it (a decoder's steps: compiled).
        """
        ops = ops or self.default_ops
        layer_fn = layer_fn or Block.forward
        B, T = tokens.shape
        rows, cos, sin, delta, x = (prologue or token_inputs)(self.embed, self._rope, tokens, positions,
                                                              packing is None)
        if packing is None:
            mask_positions = positions
        else:
            rows, mask_positions = packing.rows.view(B, T), packing.padded_positions
        needs_masks = getattr(layer_fn, "needs_masks", None)  # a fused layer masks from positions itself
        masks = {}
        tree_needs_masks = getattr(layer_fn, "tree_needs_masks", None)  # a fused layer masks trees by ancestor bits
        if tree is not None and (tree.ancestor_bits is None or tree_needs_masks is None
                                 or tree_needs_masks(self.layers[0], B, T, tokens.device)):
            rep = self.cfg.n_heads // self.cfg.n_kv_heads
            key_slot = torch.arange(cache.max_len, device=tokens.device)
            for window in set(self.cfg.sliding_windows):
                # A sliding window by slot: before the root, a slot is its position; a tree node's slot lies at or
                # after the root's, inside any window longer than the tree is deep
                m = tree.visible if window is None else \
                    tree.visible & (key_slot[None, None, :] > positions[:, :, None] - window)
                masks[window] = m[:, None, None].expand(B, 1, rep, T, cache.max_len).reshape(
                    B, 1, rep * T, cache.max_len)
        elif needs_masks is None or needs_masks(self.layers[0], B * T, tokens.device):
            Bm, Tm = mask_positions.shape
            key_pos = torch.arange(cache.max_len, device=tokens.device)
            visible = key_pos[None, None, :] <= mask_positions[:, :, None]  # [B,T,S]
            rep = self.cfg.n_heads // self.cfg.n_kv_heads
            for window in set(self.cfg.sliding_windows):
                m = visible if window is None else visible & (key_pos[None, None, :] > mask_positions[:, :, None] - window)
                m = m[:, None, None].expand(Bm, 1, rep, Tm, cache.max_len)
                masks[window] = m.reshape(Bm, 1, rep * Tm, cache.max_len)
        skip = {"live": live} if live is not None and getattr(layer_fn, "skips_dead_tokens", False) else {}
        if packing is not None:
            skip["unpack"] = packing.slots
        if tree is not None:
            skip["slots"] = tree.slots
            if tree.ancestor_bits is not None and getattr(layer_fn, "takes_tree_ancestors", False):
                skip["tree_ancestors"] = tree.ancestor_bits
        # aux_layers: each one's output into its slice of one tensor (a torch.cat after the layers was one more
        # kernel in every step of an EAGLE-3 head's decode, its AR steps included). A layer returns its MLP output
        # unadded (Block), so layer i's output is the sum x + delta that layer i + 1 makes first: a layer function
        # that `stores_input_residual` (the fused layer, whose first kernel stores that sum anyway) writes it into
        # the slice as it goes (`resid_out`); otherwise, and after the last layer run, an add of its own.
        n_run = n_layers or self.cfg.n_layers
        after, slices, stored = None, {}, set()
        if aux_layers is not None:
            H = delta.shape[-1]
            after = delta.new_empty(*delta.shape[:-1], len(aux_layers) * H)
            for j, i in enumerate(aux_layers):
                slices.setdefault(i, []).append(after[..., j * H: (j + 1) * H])
            if getattr(layer_fn, "stores_input_residual", False):
                stored = {i for i, outs in slices.items() if i + 1 < n_run and len(outs) == 1}
        for i, layer in enumerate(self.layers[:n_run]):
            into = {"resid_out": slices[i - 1][0]} if i - 1 in stored else {}
            x, delta = layer_fn(layer, x, delta, cos, sin, cache.kv[:, i], rows, positions, masks, ops, **skip,
                                **into)
            if i not in stored:
                for out in slices.get(i, ()):
                    torch.add(x, delta, out=out)
        h = None
        final_norm = getattr(layer_fn, "final_norm", None)  # a fused layer's add + norm in one kernel (None: not here)
        if final_norm is not None and logits_at is None:
            h = final_norm(self.layers[0], x, delta, self.norm, self.cfg.rms_eps,
                           **{k: v for k, v in skip.items() if k == "live"})
        if h is None:
            x = x + delta
            if logits_at is not None:
                x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
            h = ops.rmsnorm(x, self.norm, self.cfg.rms_eps)
        logits = ops.linear(h, self.lm_head, None)
        if aux_layers is None:
            return logits
        return logits, after


def from_hf_state_dict(hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype) -> Transformer:
    """Build our model from an HF Llama-family config and state dict (HF parameter names)."""
    cfg = ModelConfig.from_hf(hf_config)
    inv_freq, scaling = rope_inv_freq(hf_config)
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq, scaling)
    model.inv_freq = inv_freq.float()

    def take(name: str) -> torch.Tensor:
        return state[name].to(dtype)

    def param(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.contiguous(), requires_grad=False)

    model.embed = param(take("model.embed_tokens.weight"))
    model.norm = param(take("model.norm.weight"))
    tied = cfg.tie_embeddings or "lm_head.weight" not in state
    model.lm_head = model.embed if tied else param(take("lm_head.weight"))
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        blk.attn_norm = param(take(p + "input_layernorm.weight"))
        blk.mlp_norm = param(take(p + "post_attention_layernorm.weight"))
        blk.wqkv = param(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]))
        blk.bqkv = param(torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])) if a + "q_proj.bias" in state else None
        blk.wo = param(take(a + "o_proj.weight"))
        blk.bo = param(take(a + "o_proj.bias")) if a + "o_proj.bias" in state else None
        if cfg.qk_norm:
            blk.q_norm, blk.k_norm = param(take(a + "q_norm.weight")), param(take(a + "k_norm.weight"))
        if m + "gate_proj.bias" in state:
            raise ValueError("MLP biases are not supported")
        blk.w13 = param(torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
        blk.w2 = param(take(m + "down_proj.weight"))
    return model.eval()
