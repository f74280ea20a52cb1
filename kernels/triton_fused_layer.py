"""A whole decoder layer in five Triton kernels, for steps of a few tokens (AR decoding and short verification).

Why. A decoding step of a small model is not limited by bytes but by kernel count: SmolLM2-135M's bf16 weights take
63 µs to read on the H200, yet its step with cuBLAS GEMVs and torch.compile-fused pointwise ops is ~393 kernels and
~1.03 ms, 2.6 µs a kernel (docs/BENCHMARKS.md, third lease). Each kernel pays a launch gap and a DRAM round trip
before its first multiply, so the lever is fewer, wider kernels. The modular layer runs about 13 kernels; this one
runs five, each a GEMV (or attention) with the small ops around it folded into its prologue or epilogue:

1. `_norm_pair_gemv` (ROPE_KV): h = RMSNorm(x + delta); q, k, v = h @ Wqkv^T (+ bias); RoPE on q and k; k and v
   written into the KV cache at each token's position; q to a small buffer. The first row block also writes
   r = x + delta, the residual stream, for step 4 (and, given `resid_out`, a copy where an EAGLE-3 head's target
   forward keeps the previous layer's output). (Qwen3's per-head q/k norm: q and k leave as computed, and
   `_qk_norm_rope`, a sixth kernel, norms and rotates them.)
2. `_decode_attention`: each (token, query head, cache split) program attends one query over one range of cache
   slots (online softmax, fp32) and writes an unnormalized partial result with its running max and sum; the last
   split of a (token, head) to finish, told by an atomic counter, merges all splits into the attention output (the
   flash-decoding reduction, without a kernel of its own).
3. `_gemv`: o = attn @ Wo^T (+ bias).
4. `_norm_pair_gemv` (SILU): h = RMSNorm(r + o); gate, up = h @ W13^T; act = silu(gate) * up. It also writes r + o.
5. `_gemv`: delta = act @ W2^T, added to the residual by the next layer's step 1.

How the fusions work.
* RMSNorm in a GEMV prologue: every program needs all of h's row for its dot products anyway, and a row is a few KB,
  so each program recomputes the row's norm itself (from L2) instead of waiting for a norm kernel.
* Paired rows: RoPE mixes output d with output d + D/2 of the same head, and SwiGLU mixes gate row j with up row j.
  So a "pair" program computes two sets of output rows, A and B, with their own accumulators, and combines them
  in registers: for q/k/v, A = rows d, B = rows d + D/2 of a head (v pairs too, and is not rotated); for the MLP,
  A = gate rows, B = up rows. The weights are read in their own layout; nothing is permuted.
* Few tokens (AR, short verification): the dot products run on the FMA units, one program per token and block of a
  few output rows, all of K in one tile where it fits, the weight tile loaded before the activations so that its
  DRAM round trip overlaps the norm. A row block's programs for the step's tokens are launched side by side: the
  first to ask brings the tile from DRAM, the others read it from L2, and each program's latency is a one-token
  program's. More tokens (larger batches): tensor cores, W_tile @ H^T with the tokens padded to 16.
* Kernel boundaries (Hopper): programmatic dependent launch. Each kernel starts while its predecessor finishes, loads
  its constant inputs (on the FMA path its weights too) and only then waits for the predecessor's outputs (`PDL` and
  `DOT_PDL` below).
* 12-bit weights (`weights.format: lossless12`, FMA path only): the GEMVs read each matrix's Packed12Linear words
  (1.5 bytes a weight) and decode them in registers, slot by slot, against activations made at the slot's columns;
  each row's escapes, loaded with its words, are added after the dense sum (`_gemv12`, kernels/fused_layer_w12.py).
* After the last layer, `final_norm` does the model's residual add and final RMSNorm in one kernel.
* An EAGLE-3 head's chain steps (`draft_layer`, engine/eagle3.py) run the same kernels: q/k/v read the head's
  [embedding; hidden] pair as given (NORM off: the caller norms each half), the residual stream is the hidden state,
  and the LM head is the pair kernel's PLAIN mode (one row set) with the final norm in its prologue, which also
  writes the pre-norm output the next draft step reads.

Numerics follow the modular layer (`engine.model.Block` with the torch slots) where it stores a tensor: the residual
add, the norm's fp32 statistics, the norm output, the linear outputs and the scores (where `q @ k^T` rounds) are
rounded to the model dtype; the softmax is fp32. Three places differ by more than accumulation order: RoPE and
SwiGLU are computed in fp32 and rounded once (as torch.compile's fused kernels compute them; eager torch rounds each
product), and attention weights V with unnormalized fp32 probabilities and divides at the end (FlashAttention's
order; the reference rounds normalized probabilities to the model dtype first). So bf16 results differ from the
modular layer's in the last bits (the token-forcing gate tells such ties from divergences); in fp32 they agree to
~1e-6 (`check`). Under Triton's interpreter (CPU, fp32) this file runs the same kernels, which is how CI
tests it.

Where each part lives. This file: the GEMV kernels (`_norm_pair_gemv`, `_gemv`) and the final norm's
(`_add_rmsnorm`); the launch configuration, every setting included (tiles, FMA_MAX_TOKENS, PDL, the attention
settings and which one a step takes); the wrappers (`fused_layer`, `draft_layer`, `draft_logits`, `final_norm`,
`supports`, `layer_function`); `check` and `benchmark`. kernels/fused_layer_attention.py: kernel 2
(`_decode_attention`), `_qk_norm_rope` and the modular layer's masks (`attention_masks`). kernels/fused_layer_w12.py:
the 12-bit decode in registers (`_gemv12` and its helpers). kernels/fused_layer_common.py: the small helpers that all
of them call (`_rounded`, `_normed`, `_store_resid`). Those modules read no setting of their own: a setting is
defined here, where the code that reads it runs, so rebinding it on this module (tests, `benchmark`) takes effect.
The kernels and `attention_masks` are imported here, so `triton_fused_layer.X` still names them.
"""
from __future__ import annotations

import itertools
import json
import os

import torch
import triton
import triton.language as tl

from . import FUSED_LAYER_FMA_MAX_TOKENS
from . import FUSED_LAYER_MAX_TOKENS as MAX_TOKENS
from .fused_layer_attention import _decode_attention, _qk_norm_rope, attention_masks
from .fused_layer_common import _normed, _rounded, _store_resid
from .fused_layer_w12 import _escape_inputs12, _escape_list12, _gemv12, _gemv12_normed, _sums12, _words12
from .lossless12_format import Packed12Linear
from .timing import require_gpu_compiled

# Values of a program's weight tile (per row set) on the one-token path: 32 a thread with 4 warps. Set on SmolLM2
# (K = 576: 7 rows a program); at Llama-3.1-8B's K = 4096 it holds one row, which was the best of 16 tiles for q/k/v,
# o and gate/up there (docs/benchmarks/2026-12-03-twenty-second-lease.md, A: `fused_tiles`, role by role):
# SPECPILOT_FMA_TILE_VALUES and `benchmark(tile_values=...)` (fused_tokens --tile-values) time larger tiles.
TILE_VALUES = int(os.environ.get("SPECPILOT_FMA_TILE_VALUES", "4096"))
# A K longer than TILE_VALUES (Llama-3.1-8B's down projection, K = 14,336) is read in tiles of CHUNK_K, one row a
# program: on the H200 (docs/benchmarks/2026-12-03-twenty-second-lease.md, A) the down GEMV then ran at 99% of the
# copy bandwidth (28.1 µs a layer), against 75% with the former tile of four rows in tiles of 1,024 (37.3 µs), and
# the layer took 115.8 µs against 125.1.
CHUNK_K = 2048
# The layer's four GEMVs, by role: q/k/v (with the norm, RoPE and cache write), o, gate/up (with the norm and SwiGLU),
# down. FMA_TILES[role] = {"rows": rows (pairs for q/k/v and gate/up) a program, "block_k": the K tile, "warps"}
# replaces the TILE_VALUES rule for that role's FMA-path steps (`benchmark_tiles` sweeps them; SPECPILOT_FMA_TILES,
# a JSON object, sets them for a run). Empty: the rule everywhere.
ROLES = ("qkv", "o", "mlp", "down")
FMA_TILES: dict[str, dict] = json.loads(os.environ.get("SPECPILOT_FMA_TILES", "{}"))
# The same for steps that read 12-bit weights, whose programs decode every weight in registers and make each slot's
# activations (norm included) once a program: one row a program, as bf16 takes at 8B, spends as much on the
# activations as on the weights. On the H200 at Llama-3.1-8B's shapes (docs/benchmarks/2026-12-03-twenty-seventh-
# lease.md, D: `fused_tiles --w12`, the best of each role's sweep) q/k/v, o and down went from 42.6 / 21.2 / 47.6 µs
# (one row in all of K) to 20.5 / 10.4 / 26.0 (bf16: 18.1 / 10.3 / 27.7), gate/up's tile alone took the layer from
# 262 to 193 µs (8 pairs in tiles of 512: 252), and the 12-bit AR step went from 8.37 to 4.81 ms (bf16 fused: 3.90).
# A tile is halved until there are MIN_PROGRAMS programs (SmolLM2's q/k/v has 480 pairs). SPECPILOT_FMA_TILES_12 (a
# JSON object) sets them for a run.
FMA_TILES_12: dict[str, dict] = json.loads(os.environ.get("SPECPILOT_FMA_TILES_12", json.dumps({
    "qkv": {"rows": 4, "block_k": 1024, "warps": 4}, "o": {"rows": 8, "block_k": 1024, "warps": 4},
    "mlp": {"rows": 4, "block_k": 1024, "warps": 4}, "down": {"rows": 8, "block_k": 1024, "warps": 4}})))
# Attention: cache slots per split, slots per loop iteration and warps per program, for one-token steps and for more
# tokens (benchmark(attention=...) sweeps them); at most MAX_SPLITS splits (longer splits then). On the H200 with
# SmolLM2 (docs/BENCHMARKS.md, fourth lease) 32-slot splits were fastest for one token at position 300 (17.7 µs a
# layer against 19.0 with 64) and 64-slot splits for five tokens (30.6 µs against 31.2). SPECPILOT_FMA_ATTENTION (a
# JSON object) changes the one-token setting for a run (`fused_tiles --attention` sweeps it).
ATTENTION = {"keys_per_split": 32, "block_s": 32, "num_warps": 4,
             **json.loads(os.environ.get("SPECPILOT_FMA_ATTENTION", "{}"))}
# Steps past the FMA path (more than FMA_MAX_TOKENS tokens) attend with ATTENTION_MULTI, the tensor-core path's layer's
# largest kernel at 8 tokens on the H100 (7.5 of 30.5 µs, docs/benchmarks/2026-12-06-thirty-second-lease.md, B):
# SPECPILOT_DOT_ATTENTION (a JSON object) changes it for a run (`fused_tiles --tokens 8 --attention` sweeps it).
ATTENTION_MULTI = {"keys_per_split": 64, "block_s": 64, "num_warps": 4,
                   **json.loads(os.environ.get("SPECPILOT_DOT_ATTENTION", "{}"))}
MAX_SPLITS = 32
# Programs a one-token GEMV wants at least: about two per multiprocessor of a 132-SM GPU, so all issue loads at once.
MIN_PROGRAMS = 256
# 12-bit weights: the escapes of each row that a GEMV program loads with its words, before the PDL wait (a row with
# more adds them this many at a time after the dense sum). Escape by escape after the sum, each was two dependent
# round trips (its column, then the activation there) in every program; Llama-3.1-8B-shaped rows hold 0-9, and
# loading them ahead took its 12-bit AR step from 8.68 to 8.37 ms (H200, twenty-seventh lease, D).
ESCAPES_AHEAD = 16
# The tensor-core path: tokens padded to 16 (tl.dot's least) a block, 16 output rows a program, K in tiles of DOT_K
# (the pair kernels hold two weight tiles and the normed activations, so half of that).
DOT_TOKENS, DOT_ROWS, DOT_K = 16, 16, 512
# The tensor-core path's tile by role, as FMA_TILES is the FMA path's: {"rows": output rows a program (16 or more:
# tl.dot's least), "block_k": the K tile, "warps", "stages": how deep Triton pipelines the K loop's loads}; a key left
# out keeps the rule above (4 warps, Triton's default stages); "split": K in that many shares, a program each, the
# last to finish adding their partials (more programs for a matrix of few row blocks: SmolLM2's q/k/v has 30 of 16
# pairs, its down 36 of 16 rows), off where not given; "tokens": a step of more than DOT_TOKENS tokens in one block
# of up to that many (a power of two) instead of blocks of DOT_TOKENS side by side (`dot_token_block`), off where not
# given (not yet timed on a GPU). A step of 7-16 tokens cost a layer 2.2x a one-token
# step on the H200 (32-35 against 14 µs: thirteenth and sixteenth leases), as much as cuBLAS. These are the best of
# `fused_tiles --tokens 8` on the H100 with SmolLM2 (docs/benchmarks/2026-12-06-thirty-second-lease.md): 30.5
# against 32.2 µs a layer at 8 tokens, 4-7% less at 8-32 tokens; o and down 0.9 and 0.8 µs faster, q/k/v and gate/up
# within the sweep's noise (the layer's latency is the chain of its kernels' loads, not their tiles). B = 8 AR steps
# (8 tokens) took 0.83 against 0.89 ms. SPECPILOT_DOT_TILES (a JSON object) sets them for a run.
DOT_TILES: dict[str, dict] = json.loads(os.environ.get("SPECPILOT_DOT_TILES", json.dumps({
    "qkv": {"rows": 16, "block_k": 256, "warps": 4}, "o": {"rows": 16, "block_k": 128, "warps": 4, "stages": 5},
    "mlp": {"rows": 16, "block_k": 128, "warps": 2, "stages": 3},
    "down": {"rows": 16, "block_k": 512, "warps": 2, "stages": 4}})))
# A tree step's nodes a row that the attention kernel masks (each node's ancestors are the bits of one int64)
TREE_MAX_NODES = 64
# Steps of up to this many tokens take the FMA path (a program per token and row block, with PDL); more take the
# tensor cores. benchmark(fma_max_tokens=...) times the alternatives; SPECPILOT_FMA_MAX_TOKENS sets it for whole runs.
# 6: on the H200 (SmolLM2-135M, µs a layer, FMA / tensor cores) 5 tokens 25.7 / 30.8, 6 tokens 29.8 / 31.1, 8 tokens
# 35.8 / 31.4 (docs/BENCHMARKS.md, thirteenth lease, `fused_tokens`): a B = 8 AR step was on the slower side at 8.
FMA_MAX_TOKENS = FUSED_LAYER_FMA_MAX_TOKENS
# On the FMA path, each token's program takes the tile a one-token step takes (the rows a program holds fix the
# order of its sums on the GPU): a verified token's layer outputs are then bit for bit those AR decoding computes for
# it. Off (SPECPILOT_FMA_TILES_AS_ONE_TOKEN=0), a step of more tokens takes more rows a program, so fewer programs.
# On the H200 (docs/BENCHMARKS.md, sixth lease, B) on: n-gram verification decoded the fused AR's bf16 tokens on 4/4
# prompts (off: 1/4), for a 5-token step 2% slower (0.841 against 0.825 ms) when all its slots are live.
FMA_TILES_AS_ONE_TOKEN = os.environ.get("SPECPILOT_FMA_TILES_AS_ONE_TOKEN", "1") != "0"
# (A program taking several tokens through its tile, read once, lost on the H200 twice: its tokens' activations
# held at once, 16.2 against 18.4 µs a layer at two tokens (sixth lease, G); one token after another, 21.8 against
# 31.1 at four (docs/benchmarks/2026-12-02-fifteenth-lease.md, C). The extra programs' L2 reads cost less than the
# longer programs.)

# Programmatic dependent launch (Hopper and later): each kernel lets the next one start as soon as all its programs
# run, and the next one loads what no earlier kernel writes (its weights where its K is one tile, norm weights, RoPE
# tables, positions) before it waits for its predecessor (gdc_wait), so the launch and those loads overlap the
# previous kernel's tail. On the H200 (docs/BENCHMARKS.md, fourth lease) it took SmolLM2's AR step from 0.568 to
# 0.453 ms. SPECPILOT_PDL=0 turns it off (for A/B timing).
PDL = os.environ.get("SPECPILOT_PDL", "1") != "0"
# PDL on the tensor-core path too (steps of more than FMA_MAX_TOKENS tokens), whose K loop loads the weights after
# the wait: the fourth lease's five-token step went from 0.962 to 1.020 ms with it, so it was kept to the FMA path.
# On the H100 (docs/benchmarks/2026-12-06-thirty-eighth-lease.md) with the tiles of the thirty-second lease it took a
# layer of 8 / 12 / 16 tokens from 30.7 / 31.6 / 33.2 to 29.5 / 30.0 / 28.3 µs, our AR at B = 8 from 7,862 to 8,425
# tok/s on chat, and five of the controllers' six cells at B = 4 up 4.7-15% (the head at chat B = 4 from 0.91x to
# 1.04x our AR; the n-gram's on summarize -1.3%);
# all of K in one tile (its weights then before the wait) was slower either way (32.6-34.7 µs with PDL, 43 without).
# The same rule holds for a draft head's tail (draft_logits) and the final norm (_step_pdl); the thirty-ninth lease
# put them under it. SPECPILOT_DOT_PDL=0 turns it off (for A/B timing).
DOT_PDL = os.environ.get("SPECPILOT_DOT_PDL", "1") != "0"

# The attention's merge of a token's splits takes this many at a time (`_decode_attention`'s MERGE; at most the
# cache's splits rounded up to a power of two): its work then follows the token's position, not the cache's length,
# which a recipe's draft length moves (engine/decode.py, cache_length). On the H200 SmolLM2's AR step at B = 2 cost
# 3.6% more in 576-1,024 slots than in 512, where the merge was as wide as the cache's splits (32 lanes against 16;
# forty-eighth lease, `benchmarks/run.py cache_length`: the split programs past the position, ended early instead,
# changed nothing at B = 2 and cost 17% at B = 8). Not yet timed; SPECPILOT_ATTENTION_MERGE_SPLITS=0 merges all at
# once (for the A/B).
ATTENTION_MERGE_SPLITS = int(os.environ.get("SPECPILOT_ATTENTION_MERGE_SPLITS", "16"))
# With PDL, when the attention lets the o projection launch: at each split program's start, or once its split's
# tiles are attended (`_decode_attention`'s LATE_TRIGGER). At B = 8 SmolLM2's AR step ran 8-10% faster in a 1,024-slot
# cache than in 512 (H200 and H100, forty-eighth and forty-ninth leases), where 648 split programs past the position,
# against 72, are dispatched after the live ones and so hold the o projection's launch back until about their end.
# Triggered late instead (H100, fiftieth lease, `benchmarks/run.py cache_length --late-trigger`, random weights of
# SmolLM2's shapes, position 440, 512 slots): the AR step at B = 8 0.896 -> 0.809 ms, at B = 32 1.203 -> 1.129; a grid
# padded to 16 splits gave 0.831 / 1.108 (the lead at 1,024 slots, at 512). So: late from LATE_TRIGGER_MIN_TOKENS
# tokens a step (a grid of several waves), at each program's start below it (a one-token step at B = 1 runs one wave
# of 72 programs, where the early launch hides the o projection's; not timed late). SPECPILOT_ATTENTION_LATE_TRIGGER
# =1 / 0: always / never (for A/B timing).
LATE_TRIGGER_MIN_TOKENS = 8
ATTENTION_LATE_TRIGGER = {"1": True, "0": False}.get(os.environ.get("SPECPILOT_ATTENTION_LATE_TRIGGER", ""))


def late_trigger(n_tokens: int) -> bool:
    """Whether the attention of a step of `n_tokens` tokens (all rows) lets the o projection launch late."""
    return n_tokens >= LATE_TRIGGER_MIN_TOKENS if ATTENTION_LATE_TRIGGER is None else ATTENTION_LATE_TRIGGER

# Where a GEMV program on the FMA path reads whether its token is live: first (a dead token's program then loads no
# weight tile; a live one loads its tile one round trip later, before the PDL wait), or after its constant loads.
# First took the adaptive n-gram from 0.94x to 0.99x our fastest AR on summarization, 1.20x to 1.22x on code (H200,
# docs/BENCHMARKS.md, sixth lease, E); SPECPILOT_DEAD_CHECK_FIRST=0 restores the other order for A/B timing.
DEAD_CHECK_FIRST = tl.constexpr(os.environ.get("SPECPILOT_DEAD_CHECK_FIRST", "1") != "0")

# Modes (constexpr globals, which @triton.jit functions may read)
ROPE_KV, SILU, PLAIN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _program_start(M, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """A GEMV program's start: with PDL, let the next kernel launch now; then (its tokens, which of them are real,
    its row block). Tokens are grid axis 0 (one a program on the FMA path, BLOCK_M = 1), row blocks axis 1."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_block = tl.program_id(1)
    return tokens, tokens < M, row_block


@triton.jit
def _split_tile(BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    return tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]


@triton.jit
def _split_store(y_t, partial_ptr, block, which, SPLIT: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Split K (`_gemv`, `_norm_pair_gemv`): this program's partial sums [BLOCK_N, BLOCK_M] (fp32), accumulator
    `which` of its SLOTS, into the block's partials; the split is grid axis 2."""
    at = ((block * SPLIT + tl.program_id(2)) * SLOTS + which) * (BLOCK_N * BLOCK_M)
    tl.store(partial_ptr + at + _split_tile(BLOCK_N, BLOCK_M), y_t)


@triton.jit
def _split_arrive(count_ptr, block, SPLIT: tl.constexpr):
    """After a program's partials are stored: 1 for the last of its block's programs to arrive, which puts the counter
    back to 0 for the next launch, else 0. The barrier orders every thread's stores before the counter's (acq_rel,
    device-wide) increment, whose acquire side makes the other programs' stores visible to the last."""
    tl.debug_barrier()
    last = (tl.atomic_add(count_ptr + block, 1) == SPLIT - 1).to(tl.int32)
    tl.atomic_add(count_ptr + block, -SPLIT * last)
    return last


@triton.jit
def _split_sum(partial_ptr, block, which, last, SPLIT: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """The block's partials of accumulator `which`, added in split order (the same sums at every replay); loaded by
    the last program only (`last`: broadcast into a mask, since the interpreter holds it as a one-element array)."""
    merging = tl.zeros((BLOCK_N, BLOCK_M), tl.int32) + last > 0
    tile = _split_tile(BLOCK_N, BLOCK_M)
    y = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for part in tl.static_range(SPLIT):
        y += tl.load(partial_ptr + ((block * SPLIT + part) * SLOTS + which) * (BLOCK_N * BLOCK_M) + tile,
                     mask=merging, other=0.0)
    return y


@triton.jit
def _norm_pair_gemv(x_ptr, delta_ptr, resid_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr,
                    cos_ptr, sin_ptr, positions_ptr, rows_ptr, kv_ptr, live_ptr,
                    M, K, n_pairs, eps, n_heads, n_kv_heads, stride_kv, stride_b, stride_h, stride_s,
                    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr,
                    SKIP_DEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                    NORM: tl.constexpr = True, q_ptr=None, row_ptr_ptr=None, exc_col_ptr=None, exc_val_ptr=None,
                    scales_ptr=None, W12: tl.constexpr = False, EXC: tl.constexpr = 16, partial_ptr=None,
                    count_ptr=None, k_split=0, SPLIT: tl.constexpr = 1, aux_ptr=None, aux_stride=0,
                    AUX: tl.constexpr = False):
    """The pair GEMV (module docstring, kernels 1 and 4). NORM false: x is the GEMV's input as it is (no residual
    add, no norm, nothing stored in resid; an EAGLE-3 head's [embedding; hidden], normed by its caller). MODE PLAIN:
    one row set, out = h @ W^T over n_pairs rows (a draft head's LM head after its final norm; resid gets x + delta,
    the head's pre-norm output). W12: the weights are q_ptr's 12-bit words (`_gemv12`; w_ptr is not read), SINGLE
    then meaning that all of K's groups fit one tile of BLOCK_K / 8, and EXC each row's escapes loaded with them.
    SPLIT (tensor cores): pass 2 over a share of K a program, as `_gemv`'s; each program makes the norm's statistics
    over all of K, and the last of a block's programs adds the partials and runs the epilogue. AUX (NORM on): r is
    also stored at aux_ptr, row stride aux_stride (`_store_resid`)."""
    TWO: tl.constexpr = MODE != PLAIN  # two row sets a program (q/k/v pairs, gate and up)
    PRE: tl.constexpr = SINGLE and not W12  # the program's K (its share with SPLIT) in one tile of bf16 weights
    ONE_TILE: tl.constexpr = PRE and SPLIT == 1  # all of K in one tile of bf16 weights and activations
    BLOCK_K8: tl.constexpr = BLOCK_K // 8
    tokens, token_ok, pid = _program_start(M, BLOCK_M, PDL)
    if SKIP_DEAD and DEAD_CHECK_FIRST:  # FMA path, one token a program: a dead token's program ends at once
        if tl.load(live_ptr + tl.program_id(0)) == 0:
            return
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_ok = pairs < n_pairs
    HALF: tl.constexpr = HEAD_DIM // 2
    if MODE == ROPE_KV:  # pair j = (head j // HALF, dim j % HALF): rows d and d + HALF of that head
        head = pairs // HALF
        rows_a = head * HEAD_DIM + pairs % HALF
        rows_b = rows_a + HALF
    else:  # SILU: gate row j and up row n_pairs + j; PLAIN: row j alone
        rows_a = pairs
        rows_b = pairs + n_pairs
    cols = tl.arange(0, BLOCK_K)
    out_ok = token_ok[:, None] & pair_ok[None, :]

    k_lo, k_hi = 0, K
    if SPLIT > 1:  # this program's share of K (k_split is a multiple of BLOCK_K: no tile crosses a share's end)
        k_lo = tl.program_id(2) * k_split
        k_hi = tl.minimum(k_lo + k_split, K)

    # Everything the program reads besides x is loaded first, so that all the round trips to memory overlap: with
    # its K in one tile (SINGLE) the weight tiles (and with all of K the norm weight); the bias; RoPE's tables, the
    # positions and the q/k norm weights for the epilogue.
    if PRE:
        w_ok = pair_ok[:, None] & (k_lo + cols < K)[None, :]
        wa = tl.load(w_ptr + rows_a[:, None] * K + k_lo + cols[None, :], mask=w_ok, other=0.0)
        if TWO:
            wb = tl.load(w_ptr + rows_b[:, None] * K + k_lo + cols[None, :], mask=w_ok, other=0.0)
    if ONE_TILE and NORM:
        nw = tl.load(norm_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    a0, a1, a2, b0, b1, b2 = 0, 0, 0, 0, 0, 0
    K8 = (K + 7) // 8  # (12-bit words: groups of 8 weights a row)
    if W12:  # the first tile's words (all of them with SINGLE) and each row's first EXC escapes
        jj = tl.arange(0, BLOCK_K8)
        a0, a1, a2 = _words12(q_ptr, rows_a, pair_ok, jj, jj < K8, K8)
        esc_a = _escape_list12(rows_a, pair_ok, 0, row_ptr_ptr, exc_col_ptr, exc_val_ptr, norm_ptr, NORM, EXC)
        b0, b1, b2, esc_b = a0, a1, a2, esc_a
        if TWO:
            b0, b1, b2 = _words12(q_ptr, rows_b, pair_ok, jj, jj < K8, K8)
            esc_b = _escape_list12(rows_b, pair_ok, 0, row_ptr_ptr, exc_col_ptr, exc_val_ptr, norm_ptr, NORM, EXC)
    if HAS_BIAS:
        bias_a = tl.load(bias_ptr + rows_a, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        if TWO:
            bias_b = tl.load(bias_ptr + rows_b, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    if MODE == ROPE_KV:
        dims = pairs % HALF
        if not QK_NORM:  # (with it, _qk_norm_rope rotates q and k)
            trig = tokens[:, None] * HEAD_DIM + dims[None, :]
            cos_a = tl.load(cos_ptr + trig, mask=out_ok, other=0.0).to(tl.float32)
            sin_a = tl.load(sin_ptr + trig, mask=out_ok, other=0.0).to(tl.float32)
            cos_b = tl.load(cos_ptr + trig + HALF, mask=out_ok, other=0.0).to(tl.float32)
            sin_b = tl.load(sin_ptr + trig + HALF, mask=out_ok, other=0.0).to(tl.float32)
        pos = tl.load(positions_ptr + tokens, mask=token_ok, other=0)
        row = tl.load(rows_ptr + tokens, mask=token_ok, other=0)  # the token's cache row (packed steps: any)
    if SKIP_DEAD and not DEAD_CHECK_FIRST:  # after its constant loads
        if tl.load(live_ptr + tl.program_id(0)) == 0:
            return
    if PDL:  # from here on: what the previous kernel wrote (x, delta) and what it may still read (our outputs)
        tl.extra.cuda.gdc_wait()
    if W12:  # the activations' inputs at the escapes' columns, in flight while the dense part runs
        r_a = _escape_inputs12(esc_a, x_ptr, delta_ptr, tokens, token_ok, K, NORM)
        r_b = r_a
        if TWO:
            r_b = _escape_inputs12(esc_b, x_ptr, delta_ptr, tokens, token_ok, K, NORM)

    # Pass 1: r = x + delta, rounded as the modular layer's add, stored by the first row block; each token's mean
    # square. With all of K in one tile, h is then made from r as it is (pass 2 reads no activations again: at
    # Llama-3.1-8B's K = 4096, a program of two rows read 16 KB of weights and twice 16 KB of x and delta).
    inv_rms = tl.zeros((BLOCK_M,), tl.float32)  # (read only where NORM is on)
    if ONE_TILE and not NORM:
        ok = token_ok[:, None] & (cols < K)[None, :]
        h_single = tl.load(x_ptr + tokens[:, None] * K + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    elif ONE_TILE:
        ok = token_ok[:, None] & (cols < K)[None, :]
        offs = tokens[:, None] * K + cols[None, :]
        r = _rounded(tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                     + tl.load(delta_ptr + offs, mask=ok, other=0.0).to(tl.float32), x_ptr)
        if pid == 0:
            _store_resid(resid_ptr, aux_ptr, aux_stride, r, tokens, cols, ok, K, AUX)
        inv_rms = 1.0 / tl.sqrt(tl.sum(r * r, axis=1) / K + eps)
        h_single = _rounded(nw[None, :] * _rounded(r * inv_rms[:, None], x_ptr), x_ptr)
    elif NORM and not (W12 and SINGLE):  # (with both, `_gemv12_normed` reads each slot's slice once)
        sq = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = token_ok[:, None] & (k0 + cols < K)[None, :]
            offs = tokens[:, None] * K + k0 + cols[None, :]
            r = _rounded(tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                         + tl.load(delta_ptr + offs, mask=ok, other=0.0).to(tl.float32), x_ptr)
            if pid == 0:  # a uniform branch, not a scalar folded into the mask (newer interpreters reject that mask)
                _store_resid(resid_ptr, aux_ptr, aux_stride, r, tokens, k0 + cols, ok, K, AUX)
            sq += tl.sum(r * r, axis=1)
        inv_rms = 1.0 / tl.sqrt(sq / K + eps)

    # Pass 2: both row sets' dot products with h, tile by tile of K.
    if W12:
        acc_a, acc_b = tl.zeros((BLOCK_P, BLOCK_K8), tl.float32), tl.zeros((BLOCK_P, BLOCK_K8), tl.float32)
        if SINGLE and NORM:
            acc_a, acc_b, inv_rms = _gemv12_normed(acc_a, acc_b, a0, a1, a2, b0, b1, b2, K8, x_ptr, delta_ptr,
                                                   resid_ptr, norm_ptr, eps, tokens, token_ok, K, pid, scales_ptr,
                                                   aux_ptr, aux_stride, TWO, BLOCK_M, BLOCK_K8, AUX)
        else:
            acc_a, acc_b = _gemv12(acc_a, acc_b, a0, a1, a2, b0, b1, b2, q_ptr, rows_a, rows_b, pair_ok, K8, x_ptr,
                                   delta_ptr, norm_ptr, inv_rms, tokens, token_ok, K, scales_ptr, NORM, TWO, SINGLE,
                                   BLOCK_K8)
        ya, yb = _sums12(acc_a, acc_b, scales_ptr, esc_a, esc_b, r_a, r_b, rows_a, rows_b, pair_ok, row_ptr_ptr,
                         exc_col_ptr, exc_val_ptr, x_ptr, delta_ptr, norm_ptr, inv_rms, tokens, token_ok, K, NORM,
                         TWO, EXC)
    else:
        if DOT:
            ya_t = tl.zeros((BLOCK_P, BLOCK_M), tl.float32)
            yb_t = tl.zeros((BLOCK_P, BLOCK_M), tl.float32)
        else:
            ya = tl.zeros((BLOCK_M, BLOCK_P), tl.float32)
            yb = tl.zeros((BLOCK_M, BLOCK_P), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            col_ok = k0 + cols < K
            if not PRE:
                w_ok = pair_ok[:, None] & col_ok[None, :]
                wa = tl.load(w_ptr + rows_a[:, None] * K + k0 + cols[None, :], mask=w_ok, other=0.0)
                if TWO:
                    wb = tl.load(w_ptr + rows_b[:, None] * K + k0 + cols[None, :], mask=w_ok, other=0.0)
            if ONE_TILE:
                h = h_single
            elif NORM:
                nw = tl.load(norm_ptr + k0 + cols, mask=col_ok, other=0.0).to(tl.float32)
                h = _normed(x_ptr, delta_ptr, nw, inv_rms, tokens, k0 + cols, col_ok, token_ok, K)
            else:
                h = tl.load(x_ptr + tokens[:, None] * K + k0 + cols[None, :], mask=token_ok[:, None] & col_ok[None, :],
                            other=0.0).to(tl.float32)
            if DOT:  # [rows, K] @ [K, tokens] on tensor cores; h is exact in the weights' dtype (it was rounded to it)
                h = h.to(wa.dtype)
                ya_t += tl.dot(wa, tl.trans(h), input_precision=DOT_PRECISION)
                if TWO:
                    yb_t += tl.dot(wb, tl.trans(h), input_precision=DOT_PRECISION)
            else:  # one token: [rows, K] * [1, K] on the FMA units
                ya += tl.sum(wa.to(tl.float32) * h, axis=1)[None, :]
                if TWO:
                    yb += tl.sum(wb.to(tl.float32) * h, axis=1)[None, :]
        if SPLIT > 1:  # the block's partials; the last program to arrive adds them and runs the epilogue
            block = tl.program_id(0) * tl.num_programs(1) + pid
            SLOTS: tl.constexpr = 2 if TWO else 1
            _split_store(ya_t, partial_ptr, block, 0, SPLIT, SLOTS, BLOCK_P, BLOCK_M)
            if TWO:
                _split_store(yb_t, partial_ptr, block, 1, SPLIT, SLOTS, BLOCK_P, BLOCK_M)
            last = _split_arrive(count_ptr, block, SPLIT)
            ya_t = _split_sum(partial_ptr, block, 0, last, SPLIT, SLOTS, BLOCK_P, BLOCK_M)
            if TWO:
                yb_t = _split_sum(partial_ptr, block, 1, last, SPLIT, SLOTS, BLOCK_P, BLOCK_M)
            out_ok = out_ok & (tl.zeros((BLOCK_M, BLOCK_P), tl.int32) + last > 0)
        if DOT:
            ya = tl.trans(ya_t)
            yb = tl.trans(yb_t)
    if HAS_BIAS:
        ya += bias_a
        if TWO:
            yb += bias_b
    ya = _rounded(ya, x_ptr)  # the linear's output dtype
    yb = _rounded(yb, x_ptr)

    if MODE == PLAIN:
        tl.store(out_ptr + tokens[:, None] * n_pairs + pairs[None, :], ya.to(out_ptr.dtype.element_ty), mask=out_ok)
    elif MODE == SILU:
        act = ya / (1.0 + tl.exp(-ya)) * yb
        tl.store(out_ptr + tokens[:, None] * n_pairs + pairs[None, :], act.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        if QK_NORM:  # q and k heads as computed into out [M, n_heads + n_kv_heads, D], for _qk_norm_rope; v below
            qk = (head < n_heads + n_kv_heads)[None, :]
            raw_at = out_ptr + tokens[:, None] * ((n_heads + n_kv_heads) * HEAD_DIM) + (head * HEAD_DIM + dims)[None, :]
            tl.store(raw_at, ya.to(out_ptr.dtype.element_ty), mask=out_ok & qk)
            tl.store(raw_at + HALF, yb.to(out_ptr.dtype.element_ty), mask=out_ok & qk)
            out_a, out_b, is_q = ya, yb, qk  # (q and k are stored above: only v goes on to the cache)
        else:
            # RoPE, rotate-half form: (a, b) -> (a cos - b sin, b cos + a sin); the tables repeat over the two halves.
            rot = (head < n_heads + n_kv_heads)[None, :]  # q and k heads; v is stored as computed
            out_a = tl.where(rot, ya * cos_a - yb * sin_a, ya)
            out_b = tl.where(rot, yb * cos_b + ya * sin_b, yb)
            # q heads go to out [M, n_heads, D]; k and v heads into the cache at (row, kv head, position).
            is_q = (head < n_heads)[None, :]
            q_at = out_ptr + tokens[:, None] * (n_heads * HEAD_DIM) + (head * HEAD_DIM + dims)[None, :]
            tl.store(q_at, out_a.to(out_ptr.dtype.element_ty), mask=out_ok & is_q)
            tl.store(q_at + HALF, out_b.to(out_ptr.dtype.element_ty), mask=out_ok & is_q)
        kv_head = tl.where(head < n_heads, 0, head - n_heads)
        is_v = kv_head >= n_kv_heads
        kv_head = tl.where(is_v, kv_head - n_kv_heads, kv_head)
        cache_at = (kv_ptr + (row * stride_b + pos * stride_s)[:, None]
                    + (is_v.to(tl.int32) * stride_kv + kv_head * stride_h + dims)[None, :])
        tl.store(cache_at, out_a.to(kv_ptr.dtype.element_ty), mask=out_ok & ~is_q)
        tl.store(cache_at + HALF, out_b.to(kv_ptr.dtype.element_ty), mask=out_ok & ~is_q)


@triton.jit
def _gemv(x_ptr, w_ptr, bias_ptr, out_ptr, live_ptr, M, N, K,
          HAS_BIAS: tl.constexpr, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SINGLE: tl.constexpr,
          PDL: tl.constexpr, SKIP_DEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, q_ptr=None, row_ptr_ptr=None, exc_col_ptr=None, exc_val_ptr=None, scales_ptr=None,
          W12: tl.constexpr = False, EXC: tl.constexpr = 16, partial_ptr=None, count_ptr=None, k_split=0,
          SPLIT: tl.constexpr = 1):
    """out = x @ w^T (+ bias) for M tokens: one token a program on the FMA units, or all on tensor cores. W12: the
    weights are q_ptr's 12-bit words, as in `_norm_pair_gemv`. SPLIT (tensor cores): K in SPLIT shares of k_split
    columns, one program each (grid axis 2); each stores its partial sums [BLOCK_N, BLOCK_M] (fp32) at partial_ptr,
    and the last of a block's programs to arrive, told by its counter, adds them in split order (the same sums at
    every replay) and stores the output."""
    tokens, token_ok, pid = _program_start(M, BLOCK_M, PDL)
    if SKIP_DEAD and DEAD_CHECK_FIRST:  # FMA path, one token a program: a dead token's program ends at once
        if tl.load(live_ptr + tl.program_id(0)) == 0:
            return
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    BLOCK_K8: tl.constexpr = BLOCK_K // 8
    K8 = (K + 7) // 8
    k_lo, k_hi = 0, K
    if SPLIT > 1:  # this program's share of K (k_split is a multiple of BLOCK_K: no tile crosses a share's end)
        k_lo = tl.program_id(2) * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
    w0, w1, w2 = 0, 0, 0
    if W12:  # the first tile's words (all of them with SINGLE) and each row's first EXC escapes, before the wait
        jj = tl.arange(0, BLOCK_K8)
        w0, w1, w2 = _words12(q_ptr, rows, row_ok, jj, jj < K8, K8)
        esc = _escape_list12(rows, row_ok, 0, row_ptr_ptr, exc_col_ptr, exc_val_ptr, x_ptr, False, EXC)
    elif SINGLE:  # all of the program's K (or of its share) in one tile: the weights before the wait
        w = tl.load(w_ptr + rows[:, None] * K + k_lo + cols[None, :],
                    mask=row_ok[:, None] & (k_lo + cols < K)[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    if SKIP_DEAD and not DEAD_CHECK_FIRST:  # after its constant loads
        if tl.load(live_ptr + tl.program_id(0)) == 0:
            return
    if PDL:
        tl.extra.cuda.gdc_wait()
    if W12:  # (x as it is: no norm, so x_ptr stands in for delta and the norm weight, which are not read)
        r = _escape_inputs12(esc, x_ptr, x_ptr, tokens, token_ok, K, False)  # in flight during the dense part
        inv_rms = tl.zeros((BLOCK_M,), tl.float32)
        acc, _ = _gemv12(tl.zeros((BLOCK_N, BLOCK_K8), tl.float32), tl.zeros((BLOCK_N, BLOCK_K8), tl.float32),
                         w0, w1, w2, w0, w1, w2, q_ptr, rows, rows, row_ok, K8, x_ptr, x_ptr, x_ptr, inv_rms, tokens,
                         token_ok, K, scales_ptr, False, False, SINGLE, BLOCK_K8)
        y, _ = _sums12(acc, acc, scales_ptr, esc, esc, r, r, rows, rows, row_ok, row_ptr_ptr, exc_col_ptr,
                       exc_val_ptr, x_ptr, x_ptr, x_ptr, inv_rms, tokens, token_ok, K, False, False, EXC)
    out_ok = token_ok[:, None] & row_ok[None, :]
    if not W12:
        if DOT:
            y_t = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            col_ok = k0 + cols < K
            if not SINGLE:
                w = tl.load(w_ptr + rows[:, None] * K + k0 + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                            other=0.0)
            x = tl.load(x_ptr + tokens[:, None] * K + k0 + cols[None, :], mask=token_ok[:, None] & col_ok[None, :],
                        other=0.0)
            if DOT:
                y_t += tl.dot(w, tl.trans(x.to(w.dtype)), input_precision=DOT_PRECISION)
            else:  # one token
                y += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        if SPLIT > 1:  # the block's partials; the last program to arrive adds them and stores, the others nothing
            block = tl.program_id(0) * tl.num_programs(1) + pid
            _split_store(y_t, partial_ptr, block, 0, SPLIT, 1, BLOCK_N, BLOCK_M)
            last = _split_arrive(count_ptr, block, SPLIT)
            y_t = _split_sum(partial_ptr, block, 0, last, SPLIT, 1, BLOCK_N, BLOCK_M)
            out_ok = out_ok & (tl.zeros((BLOCK_M, BLOCK_N), tl.int32) + last > 0)
        if DOT:
            y = tl.trans(y_t)
    if HAS_BIAS:
        y += bias
    tl.store(out_ptr + tokens[:, None] * N + rows[None, :], y.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _add_rmsnorm(x_ptr, delta_ptr, norm_ptr, out_ptr, live_ptr, K, eps, PDL: tl.constexpr, SKIP_DEAD: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The model's final norm after the last layer: out = RMSNorm(x + delta), one program a token, in one kernel
    where the modular tail runs the add and torch's RMSNorm as about eight."""
    m = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    nw = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if SKIP_DEAD:
        if tl.load(live_ptr + m) == 0:
            return
    if PDL:
        tl.extra.cuda.gdc_wait()
    r = _rounded(tl.load(x_ptr + m * K + cols, mask=col_ok, other=0.0).to(tl.float32)
                 + tl.load(delta_ptr + m * K + cols, mask=col_ok, other=0.0).to(tl.float32), x_ptr)
    inv_rms = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / K + eps)
    h = _rounded(nw * _rounded(r * inv_rms, x_ptr), x_ptr)
    tl.store(out_ptr + m * K + cols, h.to(out_ptr.dtype.element_ty), mask=col_ok)


# -- launch configuration ----------------------------------------------------------------------------------------
def gemv_blocks(n_rows: int, k: int, n_tokens: int, min_programs: int = MIN_PROGRAMS, pairs: bool = False,
                role: str | None = None, w12: bool = False) -> dict:
    """Launch parameters of a GEMV over `n_rows` rows (or pairs) with K = k for `n_tokens` tokens; `role` is which of
    the layer's GEMVs it is (ROLES), for FMA_TILES (FMA_TILES_12 where `w12`: the weights are 12-bit, the tile
    halved until there are `min_programs` programs).

    Up to FMA_MAX_TOKENS tokens: one token a program, with the tile FMA_TILES gives the role if it gives one
    (rows or pairs a program, the K tile, warps), else all of K in one tile while the weight tile stays within
    TILE_VALUES (else one row in tiles of CHUNK_K), as many rows as fit, halved until there are `min_programs`
    programs for one token (FMA_TILES_AS_ONE_TOKEN), else over all tokens (latency wants width on a GPU; the
    interpreter, which runs programs one by one, wants few), 4 warps. More tokens: the tensor-core tile, DOT_TOKENS
    tokens a program (more tokens: more token blocks side by side), the role's DOT_TILES where it gives them."""
    if n_tokens > FMA_MAX_TOKENS:
        tile = DOT_TILES.get(role, {})
        block_m = dot_token_block(n_tokens, tile)
        block_k = min(tile.get("block_k", DOT_K // (2 if pairs else 1)), max(16, triton.next_power_of_2(k)))
        cfg = dict(DOT=True, BLOCK_M=block_m, BLOCK_N=tile.get("rows", DOT_ROWS),
                   BLOCK_K=max(16, block_k * DOT_TOKENS // block_m), num_warps=tile.get("warps", 4))
        if "stages" in tile:
            cfg["num_stages"] = tile["stages"]
        if tile.get("split", 1) > 1:  # (K over that many programs; `_split_k` sizes it)
            cfg["SPLIT"] = tile["split"]
        return cfg
    tile = (FMA_TILES_12 if w12 else FMA_TILES).get(role)
    if tile is not None:
        rows = tile["rows"]
        while w12 and rows > 1 and triton.cdiv(n_rows, rows) < min_programs:
            rows //= 2
        return dict(DOT=False, BLOCK_M=1, BLOCK_N=rows, BLOCK_K=min(tile["block_k"], triton.next_power_of_2(k)),
                    num_warps=tile["warps"])
    block_k = triton.next_power_of_2(k)
    if block_k > TILE_VALUES:  # K in CHUNK_K tiles, one row a program
        return dict(DOT=False, BLOCK_M=1, BLOCK_N=1, BLOCK_K=CHUNK_K, num_warps=4)
    block_n = max(1, min(16, TILE_VALUES // block_k))
    programs_per_row_block = 1 if FMA_TILES_AS_ONE_TOKEN else n_tokens
    while block_n > 1 and triton.cdiv(n_rows, block_n) * programs_per_row_block < min_programs:
        block_n //= 2
    return dict(DOT=False, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def dot_token_block(n_tokens: int, tile: dict) -> int:
    """The tensor-core path's tokens a program for a step of `n_tokens`: DOT_TOKENS (tl.dot's least), or up to the
    tile's "tokens" (a power of two) where the step has more, so that each weight tile is read by one program instead
    of one per DOT_TOKENS tokens; its K tile then shrinks in proportion (`gemv_blocks`), so the activations' tile
    keeps its size in shared memory and registers."""
    return min(tile.get("tokens", DOT_TOKENS), max(DOT_TOKENS, triton.next_power_of_2(n_tokens)))


def grid(cfg: dict, n_rows: int, n_tokens: int) -> tuple[int, int]:
    """(token blocks, row blocks): the FMA path runs one program per token and row block, the tokens of a row block
    side by side in launch order, so that they read its weight tile at about the same time (from L2 after the first);
    the tensor-core path takes DOT_TOKENS tokens a block."""
    return triton.cdiv(n_tokens, cfg["BLOCK_M"]), triton.cdiv(n_rows, cfg["BLOCK_N"])


def attention_setting(n_tokens: int) -> dict:
    """FMA-path steps attend as one-token steps do: the same splits, so the same sums, and with the FMA path's
    one-token programs a verified token's layer outputs are bit for bit those AR decoding computes for it."""
    return ATTENTION if n_tokens <= FMA_MAX_TOKENS else ATTENTION_MULTI


def attention_splits(n_slots: int, n_tokens: int, device: torch.device) -> tuple[int, int]:
    """(splits, slots a split) over the static cache: the setting's keys_per_split each, as many as cover it; past
    MAX_SPLITS, fewer and longer (a multiple of the setting's). No more programs than that: a split past a token's
    position only returns, but a grid rounded up to a power of two of them cost a whole step 15% at B = 64
    (engine/decode.py, MIN_CACHE_SLOTS). The interpreter gets 256 a split: fewer programs, still several to merge."""
    per = attention_setting(n_tokens)["keys_per_split"] if device.type == "cuda" else 256
    per *= triton.cdiv(triton.cdiv(n_slots, MAX_SPLITS), per)
    return triton.cdiv(n_slots, per), per


def merge_width(n_splits: int) -> int:
    """The splits `_decode_attention`'s merge takes at a time: ATTENTION_MERGE_SPLITS (0: all), at most `n_splits`
    (the partials' stride, a power of two)."""
    if ATTENTION_MERGE_SPLITS <= 0:
        return n_splits
    return min(n_splits, triton.next_power_of_2(ATTENTION_MERGE_SPLITS))


_PDL_DEVICES: dict = {}


def _pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: on CUDA devices of compute capability 9.0 (Hopper) or later, unless turned off."""
    if device.type != "cuda" or not PDL:
        return False
    if device not in _PDL_DEVICES:
        _PDL_DEVICES[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _PDL_DEVICES[device]


def _step_pdl(n_tokens: int, device: torch.device) -> bool:
    """Whether a step's kernels of `n_tokens` tokens launch with PDL: the FMA path always, the tensor cores' with
    DOT_PDL. One rule for the layer, a draft head's tail and the final norm, so that each kernel's predecessor and
    successor agree on it."""
    return (n_tokens <= FMA_MAX_TOKENS or DOT_PDL) and _pdl(device)


_COUNTERS: dict = {}


def _split_counters(n: int, device: torch.device, use: str = "attention") -> torch.Tensor:
    """Zeroed int32 counters, one per (token, head) of `_decode_attention` or per block of a split-K `_gemv` (`use`),
    which their kernels leave zeroed: allocated once per device and use (before CUDA-graph capture, since the decoder
    runs each step shape once first) and shared by all layers and models. A larger set replaces a smaller one, which
    is kept alive: graphs captured with it still point at it."""
    have = _COUNTERS.get((device, use))
    if have is None or have[-1].numel() < n:
        fresh = torch.zeros(max(n, MAX_TOKENS * 256), dtype=torch.int32, device=device)
        _COUNTERS[(device, use)] = have = (have or []) + [fresh]
    return have[-1]


def _split_k(cfg: dict, k: int, n_rows: int, n_tokens: int, device: torch.device,
             slots: int = 1) -> tuple[tuple, dict]:
    """A GEMV launch's grid and split-K arguments: with the tile's SPLIT (DOT_TILES' "split", tensor cores) K goes in
    that many shares of whole K tiles, fewer where K has fewer tiles, their partials (`slots` accumulators a program:
    two in the pair kernels) in a buffer of this launch; without, the grid alone. The tile's other keys are
    `_tile(cfg)`."""
    blocks = grid(cfg, n_rows, n_tokens)
    split = cfg.get("SPLIT", 1)
    k_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_split)
    if split <= 1:
        return blocks, {}
    n = blocks[0] * blocks[1]
    partial = torch.empty(n * split * slots * cfg["BLOCK_N"] * cfg["BLOCK_M"], dtype=torch.float32, device=device)
    return blocks + (split,), dict(SPLIT=split, k_split=k_split, partial_ptr=partial,
                                   count_ptr=_split_counters(n, device, "gemv"))


def _tile(cfg: dict) -> dict:
    """A `_gemv` launch's tile arguments: the tile less its split (which `_split_k` turns into the launch's)."""
    return {key: value for key, value in cfg.items() if key != "SPLIT"}


def _qk_norm_weights(block) -> torch.Tensor:
    """q_norm and k_norm stacked, made once per layer (a torch.cat each call would be a kernel each step)."""
    stacked = getattr(block, "_fused_qk_norm", None)
    if stacked is None or stacked.device != block.q_norm.device:
        stacked = torch.cat([block.q_norm.detach(), block.k_norm.detach()])
        block._fused_qk_norm = stacked
    return stacked


def _weight_bytes(block) -> int:
    """Bytes of the layer's four weight matrices, counted once per layer."""
    n = getattr(block, "_fused_weight_bytes", None)
    if n is None:
        n = sum(w.numel() * w.element_size() for w in (block.wqkv, block.wo, block.w13, block.w2)
                if isinstance(w, torch.Tensor))
        block._fused_weight_bytes = n
    return n


_L2_BYTES: dict = {}


def _l2_bytes(device: torch.device) -> int:
    if device not in _L2_BYTES:
        _L2_BYTES[device] = torch.cuda.get_device_properties(device).L2_cache_size
    return _L2_BYTES[device]


def _w12(packed: Packed12Linear | None) -> dict:
    """A GEMV launch's 12-bit arguments for a packed weight (none for a native one). The window's scales go as a
    tensor made once per matrix: Python floats would be constants of each launch (and of a compiled caller)."""
    if packed is None:
        return {}
    scales = getattr(packed, "_fused_scales", None)
    if scales is None or scales.device != packed.q.device:
        scales = packed._fused_scales = torch.tensor(packed.x_scales, dtype=torch.float32, device=packed.q.device)
    return dict(q_ptr=packed.q, row_ptr_ptr=packed.row_ptr, exc_col_ptr=packed.exc_col, exc_val_ptr=packed.exc_val,
                scales_ptr=scales, W12=True, EXC=ESCAPES_AHEAD)


def _cfg12(cfg: dict, packed: Packed12Linear | None) -> dict:
    """A 12-bit launch's tile holds whole groups of 8 weights: a K tile of at least 16 columns (2 groups)."""
    return cfg if packed is None else dict(cfg, BLOCK_K=max(cfg["BLOCK_K"], 16))


def _single(cfg: dict, k: int, packed: Packed12Linear | None, split: dict | None = None) -> bool:
    """Whether all of K is one tile: of weights and activations (native), of 12-bit words (their K / 8 groups).
    `split` (the launch's `_split_k` arguments): whether each program's share of K is one tile, whose weights it
    then loads before the PDL wait."""
    if packed is None:
        return cfg["BLOCK_K"] >= (split or {}).get("k_split", k)
    return cfg["BLOCK_K"] // 8 >= packed.k8


def supports(block, n_tokens: int, device: torch.device, w12: bool = False) -> str | None:
    """Why this layer cannot run a step of `n_tokens` tokens, or None when it can.

    Steps of several tokens run here only while a layer's weights fit in the GPU's L2: the FMA path's token programs
    share a weight tile through L2, and past it each token reads its own from DRAM. On the H200 with Llama-3.1-8B's
    shapes (436 MB a layer against 50 MB of L2; docs/benchmarks/2026-12-02-eighteenth-lease.md, E) a step of 2 / 4 / 8
    tokens ran at 0.62x / 0.34x / 0.18x the modular layer's speed (FMA path) and the tensor-core path 0.57x-0.59x,
    while one token was level (134.5 against 135.1 µs); SmolLM2's 7 MB layers gain at every size up to 16."""
    if n_tokens > MAX_TOKENS:
        return f"{n_tokens} tokens in a step (at most {MAX_TOKENS})"
    if w12 and n_tokens > FMA_MAX_TOKENS:
        return f"{n_tokens} tokens in a step with 12-bit weights (the FMA path reads them: at most {FMA_MAX_TOKENS})"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "no GPU (and Triton's interpreter is off)"
    if n_tokens > 1 and device.type == "cuda" and _weight_bytes(block) > _l2_bytes(device):
        return (f"{n_tokens} tokens in a step of a layer with {_weight_bytes(block) / 2**20:.0f} MiB of weights, more "
                f"than the GPU's {_l2_bytes(device) / 2**20:.0f} MiB of L2")
    if block.cfg.head_dim & (block.cfg.head_dim - 1):
        return f"head_dim {block.cfg.head_dim} is not a power of two"
    return None


# -- the layer ---------------------------------------------------------------------------------------------------
def fused_layer(block, x, delta, cos, sin, kv_cache, rows, positions, masks, ops, live=None, tree=None,
                qkv_input=None, weights12=None, resid_out=None):
    """Block.forward's contract (engine/model.py) in five kernels (six with a per-head q/k norm): (x, delta) in,
    (x', delta') out, the tokens' K/V written to `kv_cache` [2, B, kv_heads, S, D]. `masks` and `ops` are not needed:
    each token's `positions` and `rows` (its cache row, contiguous [B, T]) say it all, so packed tokens of several rows
    (B = 1) run as they are.

    `tree` (a draft-tree step, engine/tree.py): (each token's tree's first cache slot [B, T], its ancestor mask [B, T]
    int64, bit j for the node at that slot + j, itself included). `positions` are then the nodes' cache slots
    (siblings share a RoPE position, which `cos` and `sin` carry, but not a slot), and each node attends to the slots
    before its tree and to its ancestors' (`supports_tree`).

    `live` (int32 [B * T], optional): 0 marks a token whose outputs nobody reads, a verification slot past its row's
    valid drafts. On the FMA path (up to FMA_MAX_TOKENS tokens, a program a token) every kernel skips such tokens:
    their outputs and cache slots are left as they were. Since every kernel skips the same tokens, and a live token
    reads only live tokens' K/V (valid drafts are a prefix), nothing reads what was skipped. On the tensor-core path
    no kernel skips them (a GEMV tile holds 16 tokens), so every value they leave, in the cache too, is computed.

    `qkv_input` [B, T, K] (an EAGLE-3 head's layer, `draft_layer`): q/k/v read it as it is (normed by the caller, K
    may differ from the hidden size), and the residual stream is `x` alone (`delta` is not read).

    `weights12` (`weights.format: lossless12`): the layer's (wqkv, wo, w13, w2) as Packed12Linear, read instead of
    the block's bf16 matrices (FMA-path steps only: `supports(..., w12=True)`).

    `resid_out` [B, T, hidden] (any strides that flatten to one row stride, e.g. a slice of a wider tensor's last
    dim): also gets x + delta, the layer's input residual, which kernel 1 stores anyway (a token it skips, none).
    So the previous layer's output, which an EAGLE-3 head reads, costs no add of its own (`Transformer.forward`)."""
    cfg = block.cfg
    p_qkv, p_o, p_mlp, p_down = weights12 if weights12 is not None else (None,) * 4
    if weights12 is not None and x.shape[0] * x.shape[1] > FMA_MAX_TOKENS:
        raise ValueError(f"fused layer: 12-bit weights need a step of at most {FMA_MAX_TOKENS} tokens")
    if kv_cache.stride(-1) != 1:
        raise ValueError("fused layer: the KV cache needs unit stride along head_dim")
    B, T, hidden = x.shape
    M, D, H, Hkv, inter = B * T, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate_size
    dev, dt = x.device, x.dtype
    x, delta = x.reshape(M, hidden).contiguous(), delta.reshape(M, hidden).contiguous()
    cos, sin = cos.reshape(M, D).contiguous(), sin.reshape(M, D).contiguous()
    pos = positions.reshape(M).contiguous()
    token_rows = rows.reshape(M)
    if not token_rows.is_contiguous():
        raise ValueError("fused layer: rows must be contiguous (one cache row per token)")
    kv_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    width = MIN_PROGRAMS if dev.type == "cuda" else 1
    on = _step_pdl(M, dev)
    pdl = dict(PDL=on, launch_pdl=on)
    # Dead tokens are skipped by every kernel of the layer or by none: only the FMA path (a program a token) can
    # skip them in its GEMVs, so only there. A token that one kernel skips and the next reads is read from
    # uninitialized memory (in a CUDA graph: whatever the pool last held, NaN included), and on the tensor-core path
    # its K/V, computed from that, went into the cache past the row's end, where the modular layer's attention (the
    # next prefill; steps of more than 16 tokens) multiplies masked slots by zero: 0 x NaN = NaN (issue #20: garbage
    # tokens from the first one on, B = 2-8 on the H200).
    skip = dict(SKIP_DEAD=live is not None and skips_dead_tokens(M))
    live = live if live is not None else pos  # a pointer either way; read only with SKIP_DEAD
    precision = "ieee" if dt == torch.float32 else "tf32"  # fp32 models: exact fp32 products, as torch's matmul

    # 1. residual + norm + q/k/v + RoPE + cache write (a head's layer: q/k/v of its given input; the residual is x)
    aux = {}
    if resid_out is not None:
        if qkv_input is not None:
            raise ValueError("fused layer: resid_out needs the layer's own residual (no qkv_input)")
        out2 = resid_out.view(M, hidden)  # (raises where the rows do not flatten to one stride)
        if out2.stride(1) != 1:
            raise ValueError("fused layer: resid_out needs unit stride along the hidden dim")
        aux = dict(aux_ptr=out2, aux_stride=out2.stride(0), AUX=True)
    if qkv_input is None:
        resid, x1, k1 = torch.empty_like(x), x, hidden
    else:
        resid, k1 = x, qkv_input.shape[-1]
        x1 = qkv_input.reshape(M, k1).contiguous()
    q = torch.empty(M, H, D, dtype=dt, device=dev)
    n_pairs = (H + 2 * Hkv) * D // 2
    cfg1 = _cfg12(gemv_blocks(n_pairs, k1, M, width, pairs=True, role="qkv", w12=p_qkv is not None), p_qkv)
    # With Qwen3's per-head q/k norm, q and k go as computed to `raw`, and a kernel of their own norms and rotates them
    raw = torch.empty(M, H + Hkv, D, dtype=dt, device=dev) if cfg.qk_norm else q
    grid1, split1 = _split_k(cfg1, k1, n_pairs, M, dev, slots=2)
    _norm_pair_gemv[grid1](
        x1, delta if qkv_input is None else x1, resid, block.attn_norm, block.wqkv,
        block.bqkv if block.bqkv is not None else block.wqkv, raw,
        cos, sin, pos, token_rows, kv_cache, live, M, k1, n_pairs, cfg.rms_eps, H, Hkv, *kv_strides,
        MODE=ROPE_KV, HAS_BIAS=block.bqkv is not None, QK_NORM=cfg.qk_norm, HEAD_DIM=D, DOT=cfg1["DOT"],
        DOT_PRECISION=precision, SINGLE=_single(cfg1, k1, p_qkv, split1), BLOCK_M=cfg1["BLOCK_M"],
        BLOCK_P=cfg1["BLOCK_N"], BLOCK_K=cfg1["BLOCK_K"], num_warps=cfg1["num_warps"], **_stages(cfg1),
        NORM=qkv_input is None, **pdl, **_token_skip(skip, cfg1), **_w12(p_qkv), **split1, **aux)
    if cfg.qk_norm:
        _qk_norm_rope[(M * (H + Hkv),)](
            raw, q, kv_cache, _qk_norm_weights(block), cos, sin, pos, token_rows, live, H, Hkv, cfg.rms_eps,
            *kv_strides[1:], HEAD_DIM=D, num_warps=1, **pdl, **skip)

    # 2. attention, split over the cache, merged by each (token, head)'s last split
    n_slots = kv_cache.shape[3]
    splits, per_split = attention_splits(n_slots, M, dev)
    setting = attention_setting(M)
    n_splits = triton.next_power_of_2(splits)  # (the merge's arange; the grid runs `splits`)
    partial = torch.empty(M * H, n_splits, D, dtype=torch.float32, device=dev)
    stats = torch.empty(M * H, n_splits, 2, dtype=torch.float32, device=dev)
    attn = torch.empty(M, H * D, dtype=dt, device=dev)
    if tree is not None and block.window is not None:
        raise ValueError("fused layer: tree steps need full attention (a sliding window counts positions)")
    root, ancestors = (t.reshape(M).contiguous() for t in tree) if tree is not None else (pos, pos)
    _decode_attention[(M * H, splits)](
        q, kv_cache, pos, token_rows, live, partial, stats, _split_counters(M * H, dev), attn, root, ancestors,
        H, H // Hkv, block.window or n_slots + 1, D ** -0.5, per_split, splits, M, *kv_strides, HEAD_DIM=D,
        BLOCK_S=min(triton.next_power_of_2(per_split), setting["block_s"]), N_SPLITS=n_splits,
        num_warps=setting["num_warps"], TREE=tree is not None, MERGE=merge_width(n_splits),
        LATE_TRIGGER=late_trigger(M), **pdl, **skip)  # (the same tokens as every GEMV)

    # 3. o projection
    attn_delta = torch.empty_like(x)
    cfg3 = _cfg12(gemv_blocks(hidden, H * D, M, width, role="o", w12=p_o is not None), p_o)
    grid3, split3 = _split_k(cfg3, H * D, hidden, M, dev)
    _gemv[grid3](
        attn, block.wo, block.bo if block.bo is not None else block.wo, attn_delta, live, M, hidden, H * D,
        HAS_BIAS=block.bo is not None, DOT_PRECISION=precision, SINGLE=_single(cfg3, H * D, p_o, split3), **_tile(cfg3),
        **split3, **pdl, **_token_skip(skip, cfg3), **_w12(p_o))

    # 4. residual + norm + gate/up + SwiGLU
    x_out = torch.empty_like(x)
    act = torch.empty(M, inter, dtype=dt, device=dev)
    cfg4 = _cfg12(gemv_blocks(inter, hidden, M, width, pairs=True, role="mlp", w12=p_mlp is not None), p_mlp)
    grid4, split4 = _split_k(cfg4, hidden, inter, M, dev, slots=2)
    _norm_pair_gemv[grid4](
        resid, attn_delta, x_out, block.mlp_norm, block.w13, block.w13, act,
        cos, sin, pos, token_rows, kv_cache, live, M, hidden, inter, cfg.rms_eps, H, Hkv, *kv_strides,
        MODE=SILU, HAS_BIAS=False, QK_NORM=False, HEAD_DIM=D, DOT=cfg4["DOT"], DOT_PRECISION=precision,
        SINGLE=_single(cfg4, hidden, p_mlp, split4), BLOCK_M=cfg4["BLOCK_M"], BLOCK_P=cfg4["BLOCK_N"],
        BLOCK_K=cfg4["BLOCK_K"], num_warps=cfg4["num_warps"], **_stages(cfg4), **pdl, **_token_skip(skip, cfg4),
        **_w12(p_mlp), **split4)

    # 5. down projection: the layer's delta
    delta_out = torch.empty_like(x)
    cfg5 = _cfg12(gemv_blocks(hidden, inter, M, width, role="down", w12=p_down is not None), p_down)
    grid5, split5 = _split_k(cfg5, inter, hidden, M, dev)
    _gemv[grid5](
        act, block.w2, block.w2, delta_out, live, M, hidden, inter, HAS_BIAS=False, DOT_PRECISION=precision,
        SINGLE=_single(cfg5, inter, p_down, split5), **_tile(cfg5), **split5, **pdl, **_token_skip(skip, cfg5),
        **_w12(p_down))
    return x_out.view(B, T, hidden), delta_out.view(B, T, hidden)


def draft_layer(block, x_in: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, positions: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor,
                eps: float, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An EAGLE-3 head's decoder layer and LM head over tokens [B, T] at `positions` of its cache, in six kernels: q/k/v
    of `x_in` [B, T, K] (its [embedding; hidden] pair, normed by the caller), RoPE and the cache write, attention to
    slots 0..position of the row, o, the post-attention norm with gate/up and SwiGLU, down (`fused_layer` with
    `qkv_input`, the residual stream `residual`), then `draft_logits`. `block` holds the layer's weights as a Block
    does. Returns (pre-norm output [B, T, H], logits [B, T, rows of lm_head]), or None where this file cannot run the
    step (`supports`): the caller runs its modular layer. `rows` [B, T] int64, each token's row (b at [b, t]): the
    caller's where its glue is compiled (made here, they are two kernels of a step of some fifteen)."""
    B, T = x_in.shape[:2]
    if supports(block, B * T, x_in.device) is not None:
        return None
    if rows is None:
        rows = torch.arange(B, device=x_in.device)[:, None].expand(B, T).contiguous()
    h, mlp = fused_layer(block, residual, residual, cos, sin, kv_cache, rows, positions, None, None,
                         qkv_input=x_in)
    return draft_logits(h, mlp, norm, lm_head, eps)


def draft_logits(x: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft head's tail in one kernel: out = x + delta (its pre-norm output, which its next draft step reads) and
    logits = RMSNorm(out) @ lm_head^T [.., rows of lm_head] (`_norm_pair_gemv`, MODE PLAIN). x, delta [.., hidden]."""
    hidden, n = x.shape[-1], lm_head.shape[0]
    x2, d2 = x.reshape(-1, hidden).contiguous(), delta.reshape(-1, hidden).contiguous()
    M, dev = x2.shape[0], x.device
    out, logits = torch.empty_like(x2), torch.empty(M, n, dtype=x.dtype, device=dev)
    cfg = gemv_blocks(n, hidden, M, MIN_PROGRAMS if dev.type == "cuda" else 1, pairs=True)
    on = _step_pdl(M, dev)
    _norm_pair_gemv[grid(cfg, n, M)](
        x2, d2, out, norm, lm_head, lm_head, logits, x2, x2, x2, x2, x2, x2, M, hidden, n, eps, 1, 1, 0, 0, 0, 0,
        MODE=PLAIN, HAS_BIAS=False, QK_NORM=False, HEAD_DIM=2, DOT=cfg["DOT"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SINGLE=cfg["BLOCK_K"] >= hidden,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_P=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        **_stages(cfg), PDL=on, launch_pdl=on, SKIP_DEAD=False)
    return out.view(x.shape), logits.view(*x.shape[:-1], n)


def skips_dead_tokens(n_tokens: int) -> bool:
    """Whether a step of `n_tokens` tokens skips its dead tokens: on the FMA path (one token a program) only."""
    return n_tokens <= FMA_MAX_TOKENS


def _stages(cfg: dict) -> dict:
    """The launch's pipeline depth where its tile sets one (DOT_TILES), else Triton's default."""
    return {"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}


def _token_skip(skip: dict, cfg: dict) -> dict:
    assert not (skip["SKIP_DEAD"] and cfg["DOT"]), "dead tokens are skipped on the FMA path only"
    return dict(SKIP_DEAD=skip["SKIP_DEAD"])


def final_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
               live: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(x + delta) over the last dim, with the modular tail's numerics (engine.model.Transformer.forward);
    rows of dead tokens (`live`, as in fused_layer, and where the layers skipped them) are left unwritten."""
    hidden = x.shape[-1]
    x2, d2 = x.reshape(-1, hidden).contiguous(), delta.reshape(-1, hidden).contiguous()
    out = torch.empty_like(x2)
    pdl = _step_pdl(x2.shape[0], x.device)
    skip = live is not None and skips_dead_tokens(x2.shape[0])
    _add_rmsnorm[(x2.shape[0],)](x2, d2, weight, out, live if skip else x2, hidden, eps,
                                  BLOCK_K=triton.next_power_of_2(hidden), num_warps=4, PDL=pdl, launch_pdl=pdl,
                                  SKIP_DEAD=skip)
    return out.view(x.shape)


def supports_tree(block, batch: int, nodes: int, device: torch.device) -> str | None:
    """Why this layer cannot run a tree step of `nodes` nodes a row, or None when it can: a step it supports, full
    attention, and each node's ancestors in one int64 mask."""
    if nodes > TREE_MAX_NODES:
        return f"a tree of {nodes} nodes (an ancestor mask holds {TREE_MAX_NODES})"
    if block.window is not None:
        return "a sliding window (counted in positions; a tree's nodes share them)"
    return supports(block, batch * nodes, device)


def layer_function(fallback, packed: dict | None = None):
    """The engine's layer function for `layer: fused`: steps this file supports run here, others (prefill, large
    batches, the CPU without the interpreter, trees it cannot mask) run `fallback`, the modular layer. `packed`
    (`weights.format: lossless12`, engine/weights.py): each bf16 matrix's data_ptr() -> its 12-bit planes, which
    this file's steps then read (the fallback's linear slot reads them too)."""
    w12 = packed is not None

    def planes(block):
        """The block's 12-bit planes, or None for a block that has none (a separate draft model's, which the
        linear slot reads natively too)."""
        if not w12:
            return None
        found = tuple(packed.get(w.data_ptr()) for w in (block.wqkv, block.wo, block.w13, block.w2))
        return found if all(p is not None for p in found) else None

    def runs(block, n_tokens, device) -> bool:
        return supports(block, n_tokens, device, w12) is None

    def layer(block, x, delta, cos, sin, kv_cache, rows, positions, masks, ops, live=None, unpack=None, slots=None,
              tree_ancestors=None, resid_out=None):
        B, T = x.shape[:2]
        if slots is None and runs(block, B * T, x.device):  # packed or not, rows say where tokens go
            return fused_layer(block, x, delta, cos, sin, kv_cache, rows, positions, masks, ops, live,
                               weights12=planes(block), resid_out=resid_out)
        if (slots is not None and tree_ancestors is not None and supports_tree(block, B, T, x.device) is None
                and runs(block, B * T, x.device)):
            roots = slots[:, :1].expand(B, T)  # node 0, the root, sits at its tree's first slot
            return fused_layer(block, x, delta, cos, sin, kv_cache, rows, slots, masks, ops, live,
                               tree=(roots, tree_ancestors), weights12=planes(block), resid_out=resid_out)
        if resid_out is not None:
            torch.add(x, delta, out=resid_out)
        extra = {k: v for k, v in (("unpack", unpack), ("slots", slots)) if v is not None}
        return fallback(block, x, delta, cos, sin, kv_cache, rows, positions, masks, ops, **extra)

    def last(block, x, delta, weight, eps, live=None):
        """The final norm in one kernel for the steps this file runs; None for the others."""
        if runs(block, x.shape[0] * x.shape[1], x.device):
            return final_norm(x, delta, weight, eps, live)
        return None

    layer.needs_masks = lambda block, n_tokens, device: not runs(block, n_tokens, device)
    layer.tree_needs_masks = lambda block, batch, nodes, device: (supports_tree(block, batch, nodes, device) is not None
                                                                  or not runs(block, batch * nodes, device))
    layer.takes_tree_ancestors = True  # Transformer.forward passes TreeStep.ancestor_bits
    layer.final_norm = last
    layer.skips_dead_tokens = True  # takes `live` (Transformer.forward)
    layer.stores_input_residual = True  # takes `resid_out` (Transformer.forward's aux_layers)
    layer.draft_layer = draft_layer  # an EAGLE-3 head's chain steps (engine/eagle3.py)
    layer.draft_supports = lambda block, n_tokens, device: supports(block, n_tokens, device) is None
    return layer


# -- checking and timing -----------------------------------------------------------------------------------------
# Both take the layer to compare with as an argument (the engine's modular `Block.forward`, plain or compiled), since
# kernels never import the engine.
def check(model, reference, batch_tokens=((1, 1), (1, 5), (3, 2)), seed: int = 0, planes=None,
          n_slots: int = 512) -> float:
    """Compare `fused_layer` with `reference` (Block.forward with the torch slots) on every layer of `model`, at steps
    of (B, T) tokens at random, ragged positions over a randomly filled cache of `n_slots` slots: outputs and cache
    writes.

    fp32: the two must agree to 2e-5 (relative to the largest value). bf16/fp16: both round differently at every op,
    and attention with large logits magnifies one rounding step (a score's last bit moves its weight by e^ulp), so
    each is compared with the reference run in fp32 on the same inputs, and the fused layer's error must be at most
    twice the modular layer's own (plus 1e-3). The final norm (`final_norm`) is checked the same way against the
    modular tail's add and RMSNorm; the input residual stored through `resid_out` must be x + delta exactly.
    Returns the largest error; raises AssertionError beyond the bound. `planes`
    (block -> its (wqkv, wo, w13, w2) as Packed12Linear): the fused layer reads those 12-bit weights."""
    import copy

    g = torch.Generator().manual_seed(seed)
    cfg, dev, dt = model.cfg, model.device, model.dtype
    worst = 0.0

    def rel(a, b):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max())

    for B, T in batch_tokens:
        model._ensure_rope(n_slots)
        start = torch.randint(0, n_slots - T, (B,), generator=g)
        positions = (start[:, None] + torch.arange(T)[None]).to(dev)
        x = torch.randn(B, T, cfg.hidden_size, generator=g).to(dev, dt)
        delta = torch.randn(B, T, cfg.hidden_size, generator=g).to(dev, dt)
        cos, sin = (t[positions].unsqueeze(2) for t in model._rope)
        rows = torch.arange(B, device=dev)[:, None].expand(B, T).contiguous()
        masks = attention_masks(cfg, positions, n_slots)
        for i, block in enumerate(model.layers):
            cache = torch.randn(2, B, cfg.n_kv_heads, n_slots, cfg.head_dim, generator=g).to(dev, dt)
            mine = cache.clone()
            want = reference(block, x, delta, cos, sin, cache, rows, positions, masks, model.default_ops)
            # the input residual into the middle third of a wider tensor (an EAGLE-3 head's capture, `resid_out`):
            # x + delta, the same rounding as the modular layer's add, so equal bit for bit; the rest left alone
            wide = torch.full((B, T, 3 * cfg.hidden_size), 7.0, dtype=dt, device=dev)
            got = fused_layer(block, x, delta, cos, sin, mine, rows, positions, masks, model.default_ops,
                              weights12=planes(block) if planes is not None else None,
                              resid_out=wide[..., cfg.hidden_size: 2 * cfg.hidden_size])
            assert torch.equal(wide[..., cfg.hidden_size: 2 * cfg.hidden_size], x + delta), \
                f"fused layer {i}: the input residual stored at B={B}, T={T} is not x + delta"
            assert bool((wide[..., : cfg.hidden_size] == 7).all() and (wide[..., 2 * cfg.hidden_size:] == 7).all()), \
                f"fused layer {i}: the input residual's store wrote outside its slice at B={B}, T={T}"
            if dt == torch.float32:
                exact, bound = (*want, cache), None
            else:
                block32, cache32 = copy.deepcopy(block).float(), cache.float()  # cache: the inputs before the writes
                exact = (*reference(block32, x.float(), delta.float(), cos.float(), sin.float(), cache32, rows,
                                    positions, masks, model.default_ops), cache32)
            for name, a, b, e in (("x", got[0], want[0], exact[0]), ("delta", got[1], want[1], exact[1]),
                                  ("cache", mine, cache, exact[2])):
                if dt == torch.float32:
                    err, bound = rel(a, b), 2e-5
                else:
                    err, bound = rel(a, e), 2 * rel(b, e) + 1e-3
                assert err <= bound, (f"fused layer {i} {name} at B={B}, T={T}: error {err:.2e} > {bound:.2e}"
                                      f" ({'vs the modular layer' if dt == torch.float32 else 'vs fp32'})")
                worst = max(worst, err)
        # the final norm after the last layer, against the modular tail's add and RMSNorm
        want = model.default_ops.rmsnorm(x + delta, model.norm, cfg.rms_eps)
        err = rel(final_norm(x, delta, model.norm, cfg.rms_eps), want)
        bound = 2e-5 if dt == torch.float32 else 2 ** -7  # one bf16 rounding step of the largest value
        assert err <= bound, f"final norm at B={B}, T={T}: error {err:.2e} > {bound:.2e}"
        worst = max(worst, err)
    return worst


def benchmark(model, modular, tokens=(1, 5), n_slots: int = 512, filled: int = 300, attention=(None,),
              fma_max_tokens=(None,), batch: int = 1, tile_values=(None,), fma_tiles=(None,),
              planes=None, dot_tiles=(None,), dot_pdl=(None,)) -> list[dict]:
    """Microseconds per layer of the fused layer and of `modular` (the engine's compiled Block.forward), each over all
    of `model`'s layers captured in one CUDA graph (triton.testing.do_bench_cudagraph), for `batch` rows of T tokens
    each at position `filled` of an `n_slots` cache (a verification step of T - 1 drafts a row, or a tree of T
    nodes, at batch size `batch`); for each of the `attention` settings (dicts over attention_setting(batch * T);
    None: as set), each FMA_MAX_TOKENS in `fma_max_tokens`, each TILE_VALUES in `tile_values` and each FMA_TILES in
    `fma_tiles` and each DOT_TILES in `dot_tiles` (None: as set). `planes` (block -> its (wqkv, wo, w13, w2)
    Packed12Linear, as `check` takes it): the fused layer reads 12-bit weights (the modular one its bf16 matrices), and
    `fma_tiles` are FMA_TILES_12; with each DOT_PDL in `dot_pdl`. `modular` None: the modular layer is not timed (a
    sweep's many rows). GPU only."""
    from triton.testing import do_bench_cudagraph

    def fused(block, *args):
        return fused_layer(block, *args, weights12=planes(block) if planes is not None else None)

    require_gpu_compiled(_gemv)
    cfg, dev, dt = model.cfg, model.device, model.dtype
    cache = model.new_cache(batch, n_slots)
    out = []
    for T in tokens:
        positions = (filled + torch.arange(T, device=dev))[None].expand(batch, T).contiguous()
        x = torch.randn(batch, T, cfg.hidden_size, device=dev, dtype=dt)
        delta = torch.randn_like(x)
        cos, sin = (t[positions].unsqueeze(2) for t in model._rope)
        rows = torch.arange(batch, device=dev)[:, None].expand(batch, T).contiguous()
        masks = attention_masks(cfg, positions, n_slots)

        def run(fn):
            def layers():
                a, d = x, delta
                for i, block in enumerate(model.layers):
                    a, d = fn(block, a, d, cos, sin, cache.kv[:, i], rows, positions, masks, model.default_ops)
            return layers

        modular_us = None
        if modular is not None:
            run(modular)()  # compile before capture
            modular_us = do_bench_cudagraph(run(modular)) * 1e3 / cfg.n_layers
        global FMA_MAX_TOKENS, TILE_VALUES, FMA_TILES, FMA_TILES_12, DOT_TILES, DOT_PDL
        current = attention_setting(batch * T)
        fma_saved, tile_saved, dot_saved, dot_pdl_saved = FMA_MAX_TOKENS, TILE_VALUES, DOT_TILES, DOT_PDL
        tiles_saved = FMA_TILES if planes is None else FMA_TILES_12  # (the table of the weights' format)
        saved = dict(current)
        for fma, tile, tiles, setting, dot, pdl in itertools.product(fma_max_tokens, tile_values, fma_tiles, attention,
                                                                     dot_tiles, dot_pdl):
            current.update(setting or {})
            FMA_MAX_TOKENS, TILE_VALUES = fma or fma_saved, tile or tile_saved
            DOT_TILES = dot_saved if dot is None else dot
            DOT_PDL = dot_pdl_saved if pdl is None else pdl
            if planes is None:
                FMA_TILES = tiles_saved if tiles is None else tiles
            else:
                FMA_TILES_12 = tiles_saved if tiles is None else tiles
            try:
                run(fused)()
                fused_us = do_bench_cudagraph(run(fused)) * 1e3 / cfg.n_layers
            finally:
                current.clear()
                current.update(saved)
                FMA_MAX_TOKENS, TILE_VALUES, DOT_TILES, DOT_PDL = fma_saved, tile_saved, dot_saved, dot_pdl_saved
                if planes is None:
                    FMA_TILES = tiles_saved
                else:
                    FMA_TILES_12 = tiles_saved
            out.append(dict(batch=batch, tokens=T, attention=setting or saved, fma_max_tokens=fma or fma_saved,
                            tile_values=tile or tile_saved, fma_tiles=tiles_saved if tiles is None else tiles,
                            dot_tiles=dot_saved if dot is None else dot,
                            dot_pdl=dot_pdl_saved if pdl is None else pdl, fused_us=fused_us, modular_us=modular_us,
                            speedup=modular_us / fused_us if modular_us else None))
    return out
