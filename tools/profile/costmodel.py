"""The cost model of one decoding step: pure functions from a deployment and the device's ceilings to predicted
phase times, expected tokens per step, speedup, floors and gaps. Nothing here touches a device.

A step is draft + verify (one target forward over k+1 tokens per row) + bookkeeping (acceptance, history). Every
forward is a list of kernels, and each kernel costs the largest of its three limits:

    t_kernel = max(floor, bytes / copy_bandwidth, flops / matmul_rate)
    floor    = per-node time of a CUDA graph (gemm_node_s for a GEMM, graph_node_s otherwise) when graphed,
               max(launch_s, that) when launched eagerly

(on a CPU a weight GEMM's bytes move at the rate calibrated for its number of rows, DeviceCeilings.gemm_curve,
not at copy bandwidth; the floors stay at copy bandwidth)

and a forward's time is the sum over its kernels. Summing per-kernel maxima (rather than taking one max over the
whole forward) is what makes small-batch steps come out launch-bound, as measured: a decode GEMV's bytes take
well under its node floor, so the step costs ~kernels x floor, while a large-batch verify turns the big GEMMs
memory- or compute-bound one at a time. docs/COSTMODEL.md has the derivation and the byte and FLOP counts.

Two recipe keys change which step runs (engine/decode.py, docs/RECIPE.md), and `predict` prices both:

- `batch.controller: cost`: before each step the host picks k' in 0..k (0: an AR step, the drafter still searching)
  with the most expected tokens per second. Predicted: every kind of step k' = 0..k at the deployment's batch, rate
  B * E(k') / t(k'), and the best of them (ties to the shorter step, as the engine breaks them). So the prediction is
  never below the rate of its own AR step, which is plain AR plus the drafter's search.
- `batch.ragged: true` (with the controller): a step of kind k' verifies at most k' * B drafts across the batch, each
  row up to k, given to the rows that have drafts. With availability p (the fraction of rows with at least one draft)
  and per-position acceptance a_1..a_k measured over all rows (a_1 counts "draft 1 there and accepted", so p >= a_1),
  a row with drafts accepts draft 1 at c_1 = a_1 / p and draft i >= 2 at c_i = a_i. When m of the B rows have drafts
  (m ~ Binomial(B, p), rows independent), each gets a share s_m = min(k, k' * B / m), water-filled: floor(s_m) drafts,
  or one more for a fraction f_m = s_m - floor(s_m) of them, and emits T(s_m) = (1 - f_m) C(floor(s_m)) +
  f_m C(floor(s_m) + 1) tokens, C(n) = 1 + sum_{i<=n} prod_{j<=i} c_j; the others emit 1. Tokens per row:
  E = sum_m P(m) [(B - m) + m T(s_m)] / B. At p = 1 (or B = 1: one row has nobody to hand drafts to) this is the
  padded step's E(k'); below, more. The target's GEMMs, elementwise kernels and LM head see B * (k' + 1) packed
  tokens, as a padded step of k' does; its attention reads the queries in the padded layout of B * (k + 1) slots
  (engine/model.py puts them back there for the attention slot); the packing adds kernels per step and per layer
  (packing_cost).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

# Kernel counts of a compiled step when none are given, from the structure of our engine (a count, not a time):
# per layer 4 GEMMs, 3 attention kernels (math: 2 batched GEMMs and a fused softmax) and ~6 fused elementwise
# kernels; per forward embedding, rotary gather, masks, final norm, LM head. On the H200 an AR step of the 30-layer
# SmolLM2 launched 419 kernels and n-gram k=4 added 36 (docs/BENCHMARKS.md); the validation measures the counts.
KERNELS_PER_LAYER = 13
KERNELS_PER_FORWARD = 9
KERNELS_BOOKKEEPING = 20
KERNELS_PER_NGRAM_ORDER = 10
KERNELS_NGRAM_FIXED = 6
# A ragged step's packing kernels, counted from the engine's code (unmeasured until a profile counts them). Per step
# (engine/decode.py _pack, _finish_packed): the water-fill and the slot offsets (fused by torch.compile into about
# four kernels), five scatters into the packed buffers (tokens, positions, cache rows, padded slots, live flags) and
# acceptance's scatter of the argmaxes back to the padded layout. Per layer (engine/model.py unpacked, packed): the
# queries into the padded layout for the attention slot (a zero buffer, an index_copy) and its outputs back (a zero
# row, a cat, a gather).
KERNELS_PACKING_PER_STEP = 10
KERNELS_PACKING_PER_LAYER = 5
CONTROLLERS = ("none", "cost")  # engine/recipe.py's batch.controller
DRAFTER_KINDS = ("none", "ngram", "layerskip", "model", "eagle3")


@dataclass(frozen=True)
class DeviceCeilings:
    name: str
    copy_bytes_per_s: float  # large device copy, bytes read + written per second
    matmul_flops_per_s: float  # large square matmul (bf16 on CUDA, fp32 on CPU)
    launch_s: float  # one tiny kernel launched eagerly, host-timed
    graph_node_s: float  # one tiny kernel as a node of a replayed CUDA graph (CPU: = launch_s)
    # One GEMM node of a replayed graph beyond its own transfer time, measured on weights that come from DRAM (the
    # chain's weights exceed L2, as a model's do): a GEMM moving b bytes costs gemm_node_s + b / copy bandwidth in a
    # graph, since a chain of dependent small kernels pays each one's latency and transfer in turn. None: graph_node_s.
    gemm_node_s: float | None = None
    # CPU: (rows, weight bytes per second) of a GEMM whose weights come from DRAM, at each measured number of
    # activation rows (tokens of a forward). A CPU BLAS streams a decode step's weights well below copy bandwidth,
    # and ever slower as rows grow (on the 2-core Xeon: 24 GB/s at 1 row, 13 at 4, 7 at 32, against a 42 GB/s copy).
    # None (CUDA, or a calibration from before it was measured): a GEMM moves its bytes at copy bandwidth.
    gemm_curve: tuple[tuple[int, float], ...] | None = None
    # CUDA: (rows, FLOP/s) a weight GEMM reaches at each measured number of activation rows, on weights of an 8B
    # model's MLP shape that come from DRAM. matmul_flops_per_s is a square 8192 GEMM's; a GEMM of a few hundred rows
    # reaches well below it (tiles of rows half empty, fewer tiles than multiprocessors), and the cost model priced
    # compute-bound steps 14-26% low without it (H200, seventeenth lease: synthetic Llama-3.1-8B, B = 32-64 with 5-13
    # tokens a row). None (a CPU, or an older calibration): every GEMM computes at matmul_flops_per_s.
    matmul_curve: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self):
        for name in ("gemm_curve", "matmul_curve"):  # JSON gives lists; a frozen dataclass compares and hashes tuples
            curve = getattr(self, name)
            if curve is not None:
                object.__setattr__(self, name, tuple((int(r), float(v)) for r, v in curve))

    def kernel_floor(self, graphs: bool, gemm: bool = False) -> float:
        node = (self.gemm_node_s or self.graph_node_s) if gemm else self.graph_node_s
        return node if graphs else max(self.launch_s, node)

    def gemm_bytes_per_s(self, rows: int) -> float:
        """The rate at which a GEMM over `rows` activation rows moves its bytes: gemm_curve interpolated linearly in
        seconds per byte between measured rows (extended along its last segment beyond them, where the time grows
        with the rows, compute-bound); copy bandwidth without a curve."""
        curve = self.gemm_curve
        if not curve:
            return self.copy_bytes_per_s
        if rows <= curve[0][0] or len(curve) == 1:
            return curve[0][1]
        (r0, b0), (r1, b1) = next(((a, b) for a, b in zip(curve, curve[1:]) if rows <= b[0]), curve[-2:])
        per_byte = 1 / b0 + (rows - r0) * (1 / b1 - 1 / b0) / (r1 - r0)
        return 1 / max(per_byte, 1 / self.copy_bytes_per_s)  # never above copy bandwidth


    def matmul_rate(self, rows: int) -> float:
        """The FLOP rate of a weight GEMM over `rows` activation rows: matmul_curve interpolated linearly in seconds
        per FLOP between measured rows, its end values outside them; matmul_flops_per_s without a curve."""
        curve = self.matmul_curve
        if not curve:
            return self.matmul_flops_per_s
        if rows <= curve[0][0]:
            return curve[0][1]
        if rows >= curve[-1][0]:
            return curve[-1][1]
        (r0, f0), (r1, f1) = next((a, b) for a, b in zip(curve, curve[1:]) if rows <= b[0])
        return 1 / (1 / f0 + (rows - r0) * (1 / f1 - 1 / f0) / (r1 - r0))


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool = True
    qk_norm: bool = False
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        """From specpilot.engine.model.ModelConfig."""
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                   cfg.head_dim, cfg.tie_embeddings, cfg.qk_norm, cfg.model_type == "qwen2")

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def matrices(self) -> list[tuple[int, int]]:
        """(out, in) of one layer's weight matrices, as our engine fuses them: qkv, o, gate+up, down."""
        h, i = self.hidden, self.intermediate
        return [(self.qkv_out, h), (h, self.heads * self.head_dim), (2 * i, h), (h, i)]

    @property
    def layer_params(self) -> int:
        extra = 2 * self.head_dim * self.qk_norm + self.qkv_out * self.qkv_bias
        return sum(o * i for o, i in self.matrices()) + 2 * self.hidden + extra  # + attention and MLP norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters, a tied LM head counted once (with the embedding)."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * self.layer_params + self.embedding_params + self.hidden + head

    def params_read(self, n_layers: int | None = None) -> int:
        """Parameters one forward reads: its layers, the final norm and the LM head (embedding rows are few)."""
        n = self.layers if n_layers is None else n_layers
        return n * self.layer_params + self.hidden + self.vocab * self.hidden

    def estimate_kernels(self, n_layers: int | None = None) -> int:
        return KERNELS_PER_LAYER * (self.layers if n_layers is None else n_layers) + KERNELS_PER_FORWARD


@dataclass(frozen=True)
class Deployment:
    model: ModelShape
    bytes_per_param: float = 2.0  # weight format (2: bf16/fp16 native, 4: fp32, ~0.56: 4-bit with scales)
    dtype_bytes: int = 2  # activations and KV cache
    batch: int = 1
    k: int = 0
    drafter_kind: str = "none"
    drafter_model: ModelShape | None = None  # drafter_kind "model"; "eagle3": the head as a one-layer model over
    # its draft vocabulary (eagle3_shape)
    drafter_layers: int = 0  # drafter_kind "layerskip": the target's first layers
    drafter_bytes_per_param: float | None = None  # None: bytes_per_param
    ngram_orders: int = 3  # drafter_kind "ngram": max_ngram - min_ngram + 1
    # drafter_kind "eagle3" with prompt lookup (drafter.lookup): its search's orders, LOOKUP_MAX_NGRAM - lookup + 1;
    # 0: the head alone
    lookup_orders: int = 0
    # drafter_kind "eagle3" with prompt lookup deeper than the head's chain (drafter.head_k): the head's drafts a step
    # (its forwards), k the step's width (a copied chain's); None: k
    head_k: int | None = None
    context_len: int = 512  # key slots every attention reads: our engine attends over the whole static cache
    kernels_per_target_forward: int | None = None  # None: estimated from the structure
    kernels_per_draft_forward: int | None = None  # ngram: its whole search; layerskip/model: one draft forward
    kernels_bookkeeping: int | None = None
    cuda_graphs: bool = True
    attention: str = "math"  # "math" (bmm, softmax, bmm) or "sdpa" (one fused kernel)
    controller: str = "none"  # batch.controller: "cost" picks each step's draft length k' in 0..k (predict's best)
    ragged: bool = False  # batch.ragged: a step of kind k' verifies up to k' x B drafts, packed to the rows with drafts
    fractions: tuple[float, ...] = ()  # batch.fractions: the controller's kinds below one draft a row (always packed)
    kernels_packing: int | None = None  # a ragged step's packing kernels; None: counted from the code (above)
    tree_nodes: int | None = None  # verification "tree": the tree's nodes N (root included), k its depth
    # An EAGLE-3 head drafting a tree: the tokens a row of each head forward after the first (which runs the newly
    # verified tokens and ranks the root's children): a static tree's nodes with children at depths 1..D-1, a dynamic
    # tree's beam of topk at each of them (tree_draft_widths). None: a chain, one token a forward.
    draft_widths: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.drafter_kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter_kind {self.drafter_kind!r} is not one of {', '.join(DRAFTER_KINDS)}")
        if (self.drafter_kind == "none") != (self.k == 0):
            raise ValueError("k must be 0 exactly when there is no drafter")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"controller {self.controller!r} is not one of {', '.join(CONTROLLERS)}")
        if self.controller != "none" and self.k == 0:
            raise ValueError("a controller chooses a draft length: it needs a drafter")
        if self.ragged and self.controller != "cost":
            raise ValueError("ragged verification needs controller 'cost' (it chooses k')")
        if self.fractions and self.controller != "cost":
            raise ValueError("fractions are kinds of step the cost controller chooses: they need controller 'cost'")
        if self.tree_nodes is not None and (self.controller != "none" or self.tree_nodes <= self.k):
            raise ValueError("a tree of tree_nodes > k nodes (k its depth), without a controller")
        if self.draft_widths is not None and (self.drafter_kind != "eagle3" or self.tree_nodes is None
                                              or len(self.draft_widths) != self.k - 1
                                              or min(self.draft_widths, default=1) < 1):
            raise ValueError("draft_widths: an EAGLE-3 tree's k - 1 head forwards after the first, >= 1 token each")
        if self.head_k is not None and (self.drafter_kind != "eagle3" or not self.lookup_orders or self.head_k < 1):
            # (a step narrower than head_k, a kind the controller prices, drafts no deeper than the step: `draft_cost`)
            raise ValueError("head_k: an EAGLE-3 head's chain (>= 1) beside prompt lookup (lookup_orders)")


@dataclass(frozen=True)
class Cost:
    """Predicted time of some kernels with their limits; costs add up."""

    time_s: float = 0.0  # sum over kernels of max(floor, bytes/BW, flops/rate); graphed GEMMs floor + bytes/BW
    memory_s: float = 0.0  # unavoidable bytes (weights, KV, logits) / BW
    compute_s: float = 0.0  # FLOPs / matmul rate
    launch_s: float = 0.0  # kernels x per-kernel floor
    bytes: float = 0.0  # all bytes the kernels move
    flops: float = 0.0
    kernels: int = 0

    @property
    def floor_s(self) -> float:
        """The physical floor: the larger of the memory and compute floors."""
        return max(self.memory_s, self.compute_s)

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(*(a + b for a, b in zip(_values(self), _values(o))))

    def __mul__(self, n: int) -> "Cost":
        return Cost(*(a * n for a in _values(self)))


def _values(c: Cost) -> tuple:
    return (c.time_s, c.memory_s, c.compute_s, c.launch_s, c.bytes, c.flops, c.kernels)


def _kernels(dev: DeviceCeilings, graphs: bool, items: list[tuple]) -> Cost:
    """Cost of kernels given as (bytes, flops, is_gemm) or, for a GEMM over weights, (bytes, flops, True, rows);
    memory_s/compute_s count every byte and FLOP at copy bandwidth and the matmul rate (the physical floors)."""
    bw, rate = dev.copy_bytes_per_s, dev.matmul_flops_per_s
    out = Cost()
    for b, f, gemm, *rows in items:
        floor = dev.kernel_floor(graphs, gemm)
        # A weight GEMM streams at the rate calibrated for its rows where one was measured (CPU: DeviceCeilings.
        # gemm_curve), else at copy bandwidth.
        stream = b / dev.gemm_bytes_per_s(rows[0]) if rows else b / bw
        # In a graph a GEMM's latency and its weight transfer add up (see DeviceCeilings.gemm_node_s); elsewhere the
        # floor (a launch, or a tiny node) overlaps the transfer.
        move = floor + stream if graphs and gemm else max(floor, stream)
        # ... and computes at the rate measured for its rows (DeviceCeilings.matmul_curve); the compute floor stays
        # at the peak rate
        compute = f / dev.matmul_rate(rows[0]) if rows else f / rate
        out += Cost(max(move, compute), b / bw, f / rate, floor, b, f, 1)
    return out


def forward_cost(dev: DeviceCeilings, dep: Deployment, tokens: int, shape: ModelShape | None = None,
                 n_layers: int | None = None, bytes_per_param: float | None = None,
                 kernels: int | None = None, attention_tokens: int | None = None) -> Cost:
    """One forward of `tokens` tokens per row over the deployment's batch: the target's (with its kernel count)
    unless a drafter's shape is given. `attention_tokens`: query slots per row the attention reads when that differs
    (a ragged step's attention runs in the padded layout of k+1 slots a row); None: `tokens`."""
    m = shape or dep.model
    if kernels is None and shape is None:
        kernels = dep.kernels_per_target_forward
    L = m.layers if n_layers is None else n_layers
    bpp = dep.bytes_per_param if bytes_per_param is None else bytes_per_param
    B, S, d, M = dep.batch, dep.context_len, dep.dtype_bytes, dep.batch * tokens
    gemms = [(o * i * bpp + M * (i + o) * d, 2.0 * M * i * o, True, M) for o, i in m.matrices()]
    kv = B * S * m.kv_heads * m.head_dim * d  # K (or V) of one layer
    Ma = B * (tokens if attention_tokens is None else attention_tokens)
    q = Ma * m.heads * m.head_dim * d  # queries (or attention output)
    sc = Ma * m.heads * S  # attention scores
    if dep.attention == "math":
        attn = [(kv + q + sc * d, 2.0 * sc * m.head_dim, True), (sc * (2 * d + 1), 5.0 * sc, False),
                (kv + sc * d + q, 2.0 * sc * m.head_dim, True)]
    else:
        attn = [(2 * kv + 2 * q, 4.0 * sc * m.head_dim, True)]
    layer = _kernels(dev, dep.cuda_graphs, gemms + attn)
    logits = M * m.vocab * d
    head = _kernels(dev, dep.cuda_graphs, [(m.vocab * m.hidden * bpp + M * m.hidden * d + logits,
                                           2.0 * M * m.hidden * m.vocab, True, M)])
    cost = layer * L + head
    # The remaining kernels (norms, rotary, cache writes, activations, embedding, masks) are fused elementwise work
    # on activations of a few (token x hidden) vectors: node floors, unless their traffic is larger.
    n_other = max(0, (kernels or m.estimate_kernels(L)) - cost.kernels)
    act = L * M * d * (6 * m.hidden + 2 * m.qkv_out + 3 * m.intermediate)
    floor = dev.kernel_floor(dep.cuda_graphs)
    bw = dev.copy_bytes_per_s
    cost += Cost(max(n_other * floor, act / bw), 0.0, 0.0, n_other * floor, act, 0.0, n_other)
    # Floors count only what a forward cannot avoid: weights, the KV it attends over, the logits it writes.
    unavoidable = m.params_read(L) * bpp + 2 * kv * L + logits
    return replace(cost, memory_s=unavoidable / bw)


def draft_cost(dev: DeviceCeilings, dep: Deployment, drafts: int | None = None) -> Cost:
    """The drafter proposing `drafts` drafts a row (None: k)."""
    B, k, d = dep.batch, dep.k if drafts is None else drafts, dep.dtype_bytes
    if dep.drafter_kind == "eagle3" and dep.head_k is not None:  # the head drafts no deeper (a copied chain is free)
        k = min(k, dep.head_k)
    if dep.drafter_kind == "none":
        return Cost()
    if dep.drafter_kind == "ngram":
        return ngram_search_cost(dev, dep, dep.ngram_orders, dep.kernels_per_draft_forward)
    if dep.drafter_kind == "layerskip":
        shape, layers, bpp = dep.model, dep.drafter_layers, dep.bytes_per_param
    else:
        if dep.drafter_model is None:
            raise ValueError(f"drafter_kind {dep.drafter_kind!r} needs drafter_model")
        shape, layers, bpp = dep.drafter_model, None, dep.drafter_bytes_per_param or dep.bytes_per_param
    kw = dict(shape=shape, n_layers=layers, bytes_per_param=bpp, kernels=dep.kernels_per_draft_forward)
    # Catch-up forward over the last two tokens, then k-1 forwards of one token a row (a tree: of each level's
    # width); an argmax (a tree: a top-k) over the logits of every token forwarded.
    widths = [1] * (k - 1) if dep.draft_widths is None or drafts is not None and drafts != dep.k \
        else list(dep.draft_widths)
    fwd = forward_cost(dev, dep, 2, **kw)
    for w in widths:
        fwd += forward_cost(dev, dep, w, **kw)
    extra = [(B * w * shape.vocab * d, 0.0, False) for w in [1] + widths]
    if dep.drafter_kind == "eagle3":
        # An EAGLE-3 head, beyond its one layer: fc fuses three target states (3H -> H) for the catch-up tokens, and
        # its q/k/v read [embedding; hidden] (2H: the layer's shape counts H once), every token forwarded.
        h = shape.hidden
        extra.append((3 * h * h * bpp, 2 * 2 * B * 3 * h * h, True, 2 * B))
        extra += [(h * shape.qkv_out * bpp, 2 * B * w * h * shape.qkv_out, True, B * w) for w in [1] + widths]
        if dep.lookup_orders:  # prompt lookup beside the head: its search over the history too (one Triton kernel
            fwd += ngram_search_cost(dev, dep, dep.lookup_orders, kernels=1)  # on CUDA: kernels/triton_ngram.py)
    return fwd + _kernels(dev, dep.cuda_graphs, extra)


def ngram_search_cost(dev: DeviceCeilings, dep: Deployment, orders: int, kernels: int | None = None) -> Cost:
    """Prompt lookup's search over each row's history for `orders` tail lengths: compare the history's windows with
    its tail, a few passes over int64 tokens. Unmeasured (`kernels` None), the torch search's kernel count; on CUDA
    the drafters run one Triton kernel instead (kernels/triton_ngram.py), which a profile's measured count carries."""
    n = kernels or KERNELS_PER_NGRAM_ORDER * orders + KERNELS_NGRAM_FIXED
    bytes_ = 3 * dep.batch * dep.context_len * 8 * orders
    floor = dev.kernel_floor(dep.cuda_graphs)
    bw = dev.copy_bytes_per_s
    return Cost(max(n * floor, bytes_ / bw), bytes_ / bw, 0.0, n * floor, bytes_, 0.0, n)


def tree_draft_widths(tree) -> tuple[int, ...]:
    """The tokens a row of each head forward after the first that an EAGLE-3 head runs to draft `tree`
    (engine/tree.py): a DynamicTree's beam, topk at each depth 1..D-1; a static TreeShape's nodes that have children,
    at each depth 1..D-1 (Eagle3Drafter.propose_tree, propose_dynamic_tree)."""
    if hasattr(tree, "topk"):
        return (tree.topk,) * (tree.depth - 1)
    parents = set(tree.parents)
    return tuple(sum(1 for n, dn in enumerate(tree.depths) if dn == d and n in parents) for d in range(1, tree.depth))


def eagle3_shape(cfg) -> ModelShape:
    """An EAGLE-3 head (engine.eagle3.Eagle3Config) as the cost model's one-layer model over the draft vocabulary."""
    return ModelShape(cfg.draft_vocab_size, cfg.hidden_size, cfg.intermediate_size, 1, cfg.n_heads, cfg.n_kv_heads,
                      cfg.head_dim, tied_embeddings=False)


def bookkeeping_cost(dev: DeviceCeilings, dep: Deployment, drafts: int | None = None) -> Cost:
    """Acceptance (argmax over the verify logits of `drafts` + 1 tokens a row, None: k + 1, prefix match) and
    history/length updates."""
    n = dep.kernels_bookkeeping or KERNELS_BOOKKEEPING
    bytes_ = dep.batch * ((dep.k if drafts is None else drafts) + 1) * dep.model.vocab * dep.dtype_bytes
    floor, bw = dev.kernel_floor(dep.cuda_graphs), dev.copy_bytes_per_s
    return Cost(max(n * floor, bytes_ / bw), bytes_ / bw, 0.0, n * floor, bytes_, 0.0, n)


def packing_cost(dev: DeviceCeilings, dep: Deployment) -> Cost:
    """A ragged step's packing: its kernels (KERNELS_PACKING_PER_STEP + KERNELS_PACKING_PER_LAYER per layer, or
    dep.kernels_packing) x node floor, or their traffic if larger: per layer the queries and the attention output
    over the B x (k+1) padded slots, each written and read once more; per step the int64 buffers (tokens,
    positions, rows, slots, flags) of those slots."""
    m, slots, d = dep.model, dep.batch * (dep.k + 1), dep.dtype_bytes
    n = dep.kernels_packing
    if n is None:
        n = KERNELS_PACKING_PER_STEP + KERNELS_PACKING_PER_LAYER * m.layers
    bytes_ = m.layers * 4 * slots * m.heads * m.head_dim * d + 2 * 5 * slots * 8
    floor, bw = dev.kernel_floor(dep.cuda_graphs), dev.copy_bytes_per_s
    return Cost(max(n * floor, bytes_ / bw), bytes_ / bw, 0.0, n * floor, bytes_, 0.0, n)


def expected_tokens(k: int, acceptance: float | Sequence[float]) -> float:
    """Tokens per step: 1 + sum_i prod_{j<=i} a_j from per-position acceptance a_1..a_k (a missing position counts
    as 0), or (1 - a^(k+1)) / (1 - a) from one acceptance rate a (k+1 at a = 1)."""
    if isinstance(acceptance, (int, float)):
        a = float(acceptance)
        return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    total, run = 1.0, 1.0
    for a in list(acceptance)[:k]:
        run *= a
        total += run
    return total


def ragged_expected_tokens(k: int, drafts: int, acceptance: float | Sequence[float], availability: float,
                           batch: int) -> float:
    """Tokens per row of a ragged step verifying at most `drafts` x `batch` drafts across the batch, each row up to k.

    `acceptance` is measured over all rows (a_1 = P(draft 1 there and accepted)); `availability` p is the fraction of
    rows with at least one draft, taken as at least a_1 (a row accepts a draft only if it had one). A row with drafts
    accepts draft 1 at c_1 = a_1 / p and draft i >= 2 at c_i = a_i (reaching i already means it had drafts). With m of
    the B rows having drafts (Binomial(B, p)), each gets s_m = min(k, drafts x B / m) drafts, water-filled (floor(s_m),
    one more for a fraction f_m = s_m - floor(s_m) of them) and emits T(s_m) = (1 - f_m) C(floor(s_m)) +
    f_m C(floor(s_m) + 1), C(n) = expected_tokens(n, c); the other rows emit 1.
    E = sum_m P(m) [(B - m) + m T(s_m)] / B; at p = 1 or B = 1 it is expected_tokens(drafts, acceptance)."""
    if isinstance(acceptance, (int, float)):
        alphas = [float(acceptance)] * k
    else:
        alphas = (list(acceptance) + [0.0] * k)[:k]
    if drafts <= 0 or k <= 0:
        return 1.0
    p = min(1.0, max(float(availability), alphas[0]))
    if p <= 0.0:
        return 1.0  # no row ever has a draft
    given_drafts = [alphas[0] / p] + alphas[1:]

    def row_tokens(share: float) -> float:
        cap = math.floor(share)
        low = expected_tokens(cap, given_drafts)
        return low + (share - cap) * (expected_tokens(cap + 1, given_drafts) - low) if share > cap else low

    total = 0.0
    for m in range(1, batch + 1):
        if p == 1.0:
            chance = 1.0 if m == batch else 0.0
        else:
            chance = math.exp(math.lgamma(batch + 1) - math.lgamma(m + 1) - math.lgamma(batch - m + 1)
                              + m * math.log(p) + (batch - m) * math.log1p(-p))
        if chance:
            total += chance * m * (row_tokens(min(float(k), drafts * batch / m)) - 1.0)
    return 1.0 + total / batch


@dataclass(frozen=True)
class Prediction:
    draft: Cost
    verify: Cost
    bookkeeping: Cost
    ar_step_s: float
    tokens_per_step: float
    batch: int
    k: int
    gaps: dict = field(default_factory=dict)  # component -> predicted - floor (s); "acceptance" in tokens/step
    draft_length: int | None = None  # k' the step verifies (a row's drafts; ragged: k' x B across the batch); None: k
    rates: dict = field(default_factory=dict)  # controller: k' -> predicted tokens/s of each kind of step, 0 = AR

    @property
    def drafts(self) -> int:
        """k' of the predicted step: the controller's pick, else k."""
        return self.k if self.draft_length is None else self.draft_length

    @property
    def step_s(self) -> float:
        return self.draft.time_s + self.verify.time_s + self.bookkeeping.time_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tokens_per_step / self.step_s

    @property
    def ar_tokens_per_s(self) -> float:
        return self.batch / self.ar_step_s

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.ar_tokens_per_s

    @property
    def memory_floor_s(self) -> float:
        return self.draft.memory_s + self.verify.memory_s + self.bookkeeping.memory_s

    @property
    def compute_floor_s(self) -> float:
        return self.draft.compute_s + self.verify.compute_s + self.bookkeeping.compute_s

    @property
    def launch_floor_s(self) -> float:
        return self.draft.launch_s + self.verify.launch_s + self.bookkeeping.launch_s

    @property
    def perfect_tokens_per_s(self) -> float:
        """Every draft accepted (k'+1 tokens a step, k' = k without a controller) at the same step time."""
        return self.batch * (self.drafts + 1) / self.step_s

    @property
    def perfect_speedup(self) -> float:
        return self.perfect_tokens_per_s / self.ar_tokens_per_s

    def to_dict(self) -> dict:
        out = {name: asdict(getattr(self, name)) | {"floor_s": getattr(self, name).floor_s}
               for name in ("draft", "verify", "bookkeeping")}
        for name in ("step_s", "tokens_per_step", "tokens_per_s", "ar_step_s", "ar_tokens_per_s", "speedup",
                     "memory_floor_s", "compute_floor_s", "launch_floor_s", "perfect_tokens_per_s", "perfect_speedup"):
            out[name] = getattr(self, name)
        return out | {"gaps": dict(self.gaps), "draft_length": self.drafts, "rates": dict(self.rates)}


def ar_deployment(dep: Deployment) -> Deployment:
    return replace(dep, k=0, drafter_kind="none", drafter_model=None, kernels_per_draft_forward=None,
                   controller="none", ragged=False, fractions=(), tree_nodes=None, draft_widths=None, head_k=None)


def step_prediction(dep: Deployment, dev: DeviceCeilings, acceptance: float | Sequence[float], drafts: float,
                    availability: float | None = None) -> Prediction:
    """One kind of step, verifying up to `drafts` (k') drafts a row, or with dep.ragged k' x B across the batch (a
    fraction k' < 1, batch.fractions, is always packed so: B x (k' + 1) tokens, one draft a row from a head).

    Step: the drafter proposes k' drafts (k when ragged, a row may get up to k; k in an AR step, k' = 0, where the
    engine's drafter still searches), the target verifies B x (k'+1) tokens (ragged, k' >= 1: its attention over the
    padded B x (k+1) query slots, plus the packing), the bookkeeping reads B x (k'+1) logits. Tokens:
    expected_tokens(k', acceptance), or ragged_expected_tokens with the availability (None: 1, every row has drafts,
    and ragged verifies what padded does)."""
    fraction = 0 < drafts < 1
    ragged = (dep.ragged or fraction) and drafts > 0
    # A tree step verifies its N nodes a row (a chain of N - 1 drafts' width); its tokens follow the acceptance
    # measured on the tree, as a chain's do (per-position rates of the accepted path's length).
    width = dep.tree_nodes if dep.tree_nodes is not None and drafts > 0 else drafts + 1
    verify = forward_cost(dev, dep, width, kernels=dep.kernels_per_target_forward,
                          attention_tokens=dep.k + 1 if ragged else None)
    if ragged:
        verify += packing_cost(dev, dep)
    draft = draft_cost(dev, dep, 1 if fraction and dep.drafter_kind != "ngram" else
                       drafts if drafts and not ragged else dep.k)
    book = bookkeeping_cost(dev, dep, width - 1)
    ar = ar_deployment(dep)
    ar_step = (forward_cost(dev, ar, 1, kernels=dep.kernels_per_target_forward) + bookkeeping_cost(dev, ar)).time_s
    if ragged:
        tokens = ragged_expected_tokens(dep.k, drafts, acceptance, 1.0 if availability is None else availability,
                                        dep.batch)
    else:
        tokens = expected_tokens(drafts, acceptance)
    gaps = {name: c.time_s - c.floor_s for name, c in (("draft", draft), ("verify", verify), ("bookkeeping", book))}
    gaps["acceptance"] = drafts + 1 - tokens
    return Prediction(draft, verify, book, ar_step, tokens, dep.batch, dep.k, gaps, drafts)


def predict(dep: Deployment, dev: DeviceCeilings, acceptance: float | Sequence[float] = 0.0,
            availability: float | None = None) -> Prediction:
    """Predicted phase times, tokens per step (from one acceptance rate or a per-position profile) and gaps.

    Without a controller: the step verifying k drafts. With controller "cost": the best kind of step k' in 0..k by
    tokens/s, B x E(k') / t(k') (ties to the shorter step), with every kind's rate in `rates`. `availability` (the
    fraction of rows with at least one draft a step) matters only to ragged steps; see ragged_expected_tokens."""
    if dep.controller == "none":
        return step_prediction(dep, dev, acceptance, dep.k, availability)
    fractions = [f for f in dep.fractions if 1 <= round(f * dep.batch) < dep.batch]  # (engine: fraction_kinds)
    kinds = [step_prediction(dep, dev, acceptance, d, availability) for d in sorted([*range(dep.k + 1), *fractions])]
    best = kinds[0]
    for p in kinds[1:]:
        if p.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
            best = p
    return replace(best, rates={p.drafts: p.tokens_per_s for p in kinds})
