"""The fused layer's attention (triton_fused_layer.py's module docstring: kernel 2, and with a per-head q/k norm
the sixth kernel): `_decode_attention`, one query over one range of cache slots a program, merged by each (token,
head)'s last split, with its helpers; `_decode_attention_gqa`, the same with the query heads of one kv head in one
program (ATTENTION_GQA); `_decode_attention_rows`, a row's tokens and one kv head's query heads in one program, on
tensor cores (ATTENTION_ROWS); `_qk_norm_rope`, Qwen3's q/k norm and RoPE; and `attention_masks`, the modular
layer's masks, which `check` and `benchmark` compare with.

What a step launches them with stays in triton_fused_layer.py, where it is read: the settings (ATTENTION,
ATTENTION_MULTI, MAX_SPLITS) and which one a step takes and its splits (`attention_setting`, `attention_splits`),
since they follow FMA_MAX_TOKENS, which picks the step's path there (and which `benchmark` and the tests rebind).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_layer_common import _rounded


@triton.jit
def _qk_norm_rope(raw_ptr, q_ptr, kv_ptr, norm_ptr, cos_ptr, sin_ptr, positions_ptr, rows_ptr, live_ptr,
                  n_heads, n_kv_heads, eps, stride_b, stride_h, stride_s,
                  HEAD_DIM: tl.constexpr, PDL: tl.constexpr, SKIP_DEAD: tl.constexpr):
    """Qwen3's per-head RMSNorm of q and k (q_norm, k_norm stacked in `norm_ptr`), then RoPE: q to its buffer
    [M, n_heads, D], k into the cache. Program (token, q or k head), reading the head's values as the q/k/v kernel
    computed them (`raw_ptr`). A kernel of its own so that the q/k/v GEMV keeps the tiles of every other model: with
    a whole head in one program (the norm's reduction in its epilogue), Qwen3-8B's q/k/v ran as 48 programs of 128
    rows and 157 µs a layer against 12 at the copy bandwidth (docs/benchmarks/2026-12-03-twenty-second-lease.md, A)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = n_heads + n_kv_heads
    m, head = tl.program_id(0) // heads, tl.program_id(0) % heads
    dims = tl.arange(0, HALF)
    which = tl.where(head < n_heads, 0, HEAD_DIM)
    na = tl.load(norm_ptr + which + dims).to(tl.float32)
    nb = tl.load(norm_ptr + which + dims + HALF).to(tl.float32)
    cos_a = tl.load(cos_ptr + m * HEAD_DIM + dims).to(tl.float32)
    sin_a = tl.load(sin_ptr + m * HEAD_DIM + dims).to(tl.float32)
    cos_b = tl.load(cos_ptr + m * HEAD_DIM + dims + HALF).to(tl.float32)
    sin_b = tl.load(sin_ptr + m * HEAD_DIM + dims + HALF).to(tl.float32)
    pos = tl.load(positions_ptr + m)
    row = tl.load(rows_ptr + m)
    if SKIP_DEAD:
        if tl.load(live_ptr + m) == 0:
            return
    if PDL:
        tl.extra.cuda.gdc_wait()
    at = raw_ptr + (m * heads + head) * HEAD_DIM + dims
    ya = tl.load(at).to(tl.float32)
    yb = tl.load(at + HALF).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(ya * ya, axis=0) + tl.sum(yb * yb, axis=0)) / HEAD_DIM + eps)
    a = _rounded(na * _rounded(ya * inv, q_ptr), q_ptr)
    b = _rounded(nb * _rounded(yb * inv, q_ptr), q_ptr)
    out_a = a * cos_a - b * sin_a
    out_b = b * cos_b + a * sin_b
    if head < n_heads:
        q_at = q_ptr + (m * n_heads + head) * HEAD_DIM + dims
        tl.store(q_at, out_a.to(q_ptr.dtype.element_ty))
        tl.store(q_at + HALF, out_b.to(q_ptr.dtype.element_ty))
    else:
        cache_at = kv_ptr + row * stride_b + pos * stride_s + (head - n_heads) * stride_h + dims
        tl.store(cache_at, out_a.to(kv_ptr.dtype.element_ty))
        tl.store(cache_at + HALF, out_b.to(kv_ptr.dtype.element_ty))


@triton.jit
def _visible(slots, last, pos, window, root, ancestors, TREE: tl.constexpr):
    """Which cache slots a query at `pos` sees among `slots`: before `last`, inside the window, and in a tree step
    a slot before the tree's first (`root`) or an ancestor's (a bit of `ancestors`, itself included)."""
    seen = (slots < last) & (slots > pos - window)
    if TREE:
        node = tl.maximum(slots - root, 0).to(tl.int64)
        seen = seen & ((slots < root) | (((ancestors >> node) & 1) != 0))
    return seen


@triton.jit
def _attend(q, k, v, seen, run_max, run_sum, acc, scale, q_ptr):
    """One tile of slots into the online softmax: (running max, running sum, unnormalized output) updated."""
    scores = _rounded(tl.sum(k * q[None, :], axis=1), q_ptr) * scale  # rounded where q @ k^T rounds
    scores = tl.where(seen, scores, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(scores, axis=0))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no -inf - -inf
    p = tl.exp(scores - shift)
    rescale = tl.exp(run_max - shift)
    return new_max, run_sum * rescale + tl.sum(p, axis=0), acc * rescale + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def _split_start(kv_ptr, rows_ptr, root_ptr, ancestors_ptr, m, pos, kv_head, split, keys_per_split, window, n_tokens,
                 stride_kv, stride_b, stride_h, stride_s, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                 TREE: tl.constexpr):
    """Token m's split `split` of kv head `kv_head`: what its queries see (`_visible`'s root and ancestors; `fresh`,
    the first slot this step may have written), its slots [first, last), and its first K/V tile with the slots
    written by earlier steps only (loaded before the PDL wait; `_fresh_slots` adds the others after it)."""
    if TREE:
        root = tl.load(root_ptr + m)
        ancestors = tl.load(ancestors_ptr + m)
        fresh = root
    else:
        root = pos
        ancestors = pos.to(tl.int64)
        fresh = pos - (n_tokens - 1)
    first = split * keys_per_split
    last = tl.minimum(first + keys_per_split, pos + 1)  # a query sees no slot past its position
    k_base = kv_ptr + tl.load(rows_ptr + m) * stride_b + kv_head * stride_h
    slots = first + tl.arange(0, BLOCK_S)
    seen = _visible(slots, last, pos, window, root, ancestors, TREE)
    at = slots[:, None] * stride_s + tl.arange(0, HEAD_DIM)[None, :]
    old = (seen & (slots < fresh))[:, None]
    k = tl.load(k_base + at, mask=old, other=0.0).to(tl.float32)
    v = tl.load(k_base + stride_kv + at, mask=old, other=0.0).to(tl.float32)
    return root, ancestors, fresh, first, last, k_base, slots, seen, at, k, v


@triton.jit
def _fresh_slots(k, v, k_base, at, seen, slots, fresh, stride_kv):
    """The first tile's slots from `fresh` on (written by this step's q/k/v kernel: read after the PDL wait)."""
    new = (seen & (slots >= fresh))[:, None]
    k = tl.where(new, tl.load(k_base + at, mask=new, other=0.0).to(tl.float32), k)
    v = tl.where(new, tl.load(k_base + stride_kv + at, mask=new, other=0.0).to(tl.float32), v)
    return k, v


@triton.jit
def _next_tile(k_base, s0, last, pos, window, root, ancestors, stride_kv, stride_s, HEAD_DIM: tl.constexpr,
               BLOCK_S: tl.constexpr, TREE: tl.constexpr):
    """The split's tile of slots from s0: which of them the query sees, and their K and V."""
    tile = s0 + tl.arange(0, BLOCK_S)
    tile_seen = _visible(tile, last, pos, window, root, ancestors, TREE)
    tile_at = tile[:, None] * stride_s + tl.arange(0, HEAD_DIM)[None, :]
    tile_k = tl.load(k_base + tile_at, mask=tile_seen[:, None], other=0.0).to(tl.float32)
    tile_v = tl.load(k_base + stride_kv + tile_at, mask=tile_seen[:, None], other=0.0).to(tl.float32)
    return tile_seen, tile_k, tile_v


@triton.jit
def _decode_attention(q_ptr, kv_ptr, positions_ptr, rows_ptr, live_ptr, partial_ptr, stats_ptr, count_ptr, out_ptr,
                      root_ptr, ancestors_ptr, n_heads, rep, window, scale, keys_per_split, grid_splits, n_tokens,
                      stride_kv, stride_b, stride_h, stride_s,
                      HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, N_SPLITS: tl.constexpr, PDL: tl.constexpr,
                      SKIP_DEAD: tl.constexpr, TREE: tl.constexpr):
    """Program (token m * n_heads + head, split): one query over one range of cache slots. A row's T tokens read the
    same K/V tiles, from L2 after the first. Splits past the token's position do nothing. TREE: the token is a
    draft-tree node whose `positions` entry is its cache slot; of the slots from its tree's first (`root_ptr`) on it
    sees those whose bit, counted from that first slot, is set in its ancestor mask (`ancestors_ptr`, int64).

    The split's first tile of K/V is loaded before the PDL wait, all but the slots this step may have written: those
    from the tree's first on, or in a chain step the last `n_tokens` up to the token's own (a row's tokens in a step
    are consecutive positions, at most all the step's tokens). The earlier slots were written by earlier steps, so
    their DRAM round trip overlaps the q/k/v kernel's tail; the others are read after the wait."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    mh, split = tl.program_id(0), tl.program_id(1)
    m, head = mh // n_heads, mh % n_heads
    dims = tl.arange(0, HEAD_DIM)
    pos = tl.load(positions_ptr + m)
    if SKIP_DEAD:
        if tl.load(live_ptr + m) == 0:
            return
    root, ancestors, fresh, first, last, k_base, slots, seen, at, k, v = _split_start(
        kv_ptr, rows_ptr, root_ptr, ancestors_ptr, m, pos, head // rep, split, keys_per_split, window, n_tokens,
        stride_kv, stride_b, stride_h, stride_s, HEAD_DIM, BLOCK_S, TREE)
    if PDL:
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + mh * HEAD_DIM + dims).to(tl.float32)
    if first < last:
        k, v = _fresh_slots(k, v, k_base, at, seen, slots, fresh, stride_kv)
        run_max, run_sum, acc = _attend(q, k, v, seen, float("-inf"), 0.0, tl.zeros((HEAD_DIM,), tl.float32), scale,
                                        q_ptr)
        for s0 in range(first + BLOCK_S, last, BLOCK_S):  # (names of their own: no loop-carried type changes)
            tile_seen, tile_k, tile_v = _next_tile(k_base, s0, last, pos, window, root, ancestors, stride_kv,
                                                   stride_s, HEAD_DIM, BLOCK_S, TREE)
            run_max, run_sum, acc = _attend(q, tile_k, tile_v, tile_seen, run_max, run_sum, acc, scale, q_ptr)
        # The splits that run for this token; clamped to the grid's, so that a position past the cache cannot hang
        # the merge. (N_SPLITS, the partials' stride, is their count rounded up to a power of two.)
        n_used = tl.minimum(pos // keys_per_split + 1, grid_splits)
        if n_used == 1:  # the whole context in this one split: the output, no merge
            tl.store(out_ptr + mh * HEAD_DIM + dims, (acc / run_sum).to(out_ptr.dtype.element_ty))
        else:
            # This split's partial: partial [M * n_heads, N_SPLITS, D] and stats [M * n_heads, N_SPLITS, 2], fp32.
            tl.store(partial_ptr + (mh * N_SPLITS + split) * HEAD_DIM + dims, acc)
            tl.store(stats_ptr + (mh * N_SPLITS + split) * 2, run_max)
            tl.store(stats_ptr + (mh * N_SPLITS + split) * 2 + 1, run_sum)
            # The last of the token's splits to arrive merges them all. The barrier orders every thread's stores
            # before the counter's (acq_rel, device-wide) increment, whose acquire side makes the other splits'
            # stores visible.
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + mh, 1) == n_used - 1:
                splits = tl.arange(0, N_SPLITS)
                used = splits < n_used
                s_max = tl.load(stats_ptr + (mh * N_SPLITS + splits) * 2, mask=used, other=float("-inf"))
                s_sum = tl.load(stats_ptr + (mh * N_SPLITS + splits) * 2 + 1, mask=used, other=0.0)
                s_acc = tl.load(partial_ptr + (mh * N_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                                mask=used[:, None], other=0.0)
                top = tl.max(s_max, axis=0)
                weight = tl.exp(s_max - tl.where(top == float("-inf"), 0.0, top))  # 0 where no slot was seen
                out = tl.sum(s_acc * weight[:, None], axis=0) / tl.sum(s_sum * weight, axis=0)
                tl.store(out_ptr + mh * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))
                tl.atomic_xchg(count_ptr + mh, 0)  # ready for the next layer and step


@triton.jit
def _attend_group(q, k, v, seen, run_max, run_sum, acc, scale, q_ptr):
    """`_attend` for the REP queries of one kv head at once, q [REP, D]: each query's scores, max, sum and output
    computed as `_attend` computes one query's, from the K/V tile loaded once for them all."""
    scores = _rounded(tl.sum(k[None, :, :] * q[:, None, :], axis=2), q_ptr) * scale  # [REP, S]
    scores = tl.where(seen[None, :], scores, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.exp(scores - shift[:, None])
    rescale = tl.exp(run_max - shift)
    return (new_max, run_sum * rescale + tl.sum(p, axis=1),
            acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1))


@triton.jit
def _finish_group(partial_ptr, stats_ptr, counter_ptr, out_ptr, mh, ok, n_used, group_used, split, acc, run_max,
                  run_sum, HEAD_DIM: tl.constexpr, N_SPLITS: tl.constexpr):
    """A program's queries [Q] (their (token, head) indices `mh`, `ok` the real ones) after one split: where the
    program's queries use one split only (`group_used`), their outputs; else this split's partials and stats, and
    the program's last split to arrive (its counter) merges each query's own `n_used` splits, one at a time (no
    [Q, N_SPLITS, D] tile), as `_decode_attention` merges one query's."""
    dims = tl.arange(0, HEAD_DIM)
    out_at = out_ptr + mh[:, None] * HEAD_DIM + dims[None, :]
    if group_used == 1:
        tl.store(out_at, (acc / tl.where(ok, run_sum, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=ok[:, None])
    else:
        tl.store(partial_ptr + (mh[:, None] * N_SPLITS + split) * HEAD_DIM + dims[None, :], acc, mask=ok[:, None])
        tl.store(stats_ptr + (mh * N_SPLITS + split) * 2, run_max, mask=ok)
        tl.store(stats_ptr + (mh * N_SPLITS + split) * 2 + 1, run_sum, mask=ok)
        tl.debug_barrier()  # (as in _decode_attention: every thread's stores before the counter's increment)
        if tl.atomic_add(counter_ptr, 1) == group_used - 1:
            splits = tl.arange(0, N_SPLITS)
            used = ok[:, None] & (splits[None, :] < n_used[:, None])  # [Q, N_SPLITS]: a query's own
            stat_at = (mh[:, None] * N_SPLITS + splits[None, :]) * 2
            s_max = tl.load(stats_ptr + stat_at, mask=used, other=float("-inf"))
            s_sum = tl.load(stats_ptr + stat_at + 1, mask=used, other=0.0)
            best = tl.max(s_max, axis=1)
            weight = tl.exp(s_max - tl.where(best == float("-inf"), 0.0, best)[:, None])  # 0 where none was seen
            total = tl.where(ok, tl.sum(s_sum * weight, axis=1), 1.0)  # (a padding query: no 0 / 0)
            out = tl.zeros(acc.shape, tl.float32)
            for s in range(0, group_used):
                w = tl.sum(tl.where(splits[None, :] == s, weight, 0.0), axis=1)
                part = tl.load(partial_ptr + (mh[:, None] * N_SPLITS + s) * HEAD_DIM + dims[None, :],
                               mask=(ok & (s < n_used))[:, None], other=0.0)
                out += part * w[:, None]
            tl.store(out_at, (out / total[:, None]).to(out_ptr.dtype.element_ty), mask=ok[:, None])
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next layer and step


@triton.jit
def _decode_attention_gqa(q_ptr, kv_ptr, positions_ptr, rows_ptr, live_ptr, partial_ptr, stats_ptr, count_ptr,
                          out_ptr, root_ptr, ancestors_ptr, n_heads, rep, window, scale, keys_per_split, grid_splits,
                          n_tokens, stride_kv, stride_b, stride_h, stride_s,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, N_SPLITS: tl.constexpr, REP: tl.constexpr,
                          PDL: tl.constexpr, SKIP_DEAD: tl.constexpr, TREE: tl.constexpr):
    """`_decode_attention` with a program per (token m * n_kv_heads + kv head, split): the `rep` query heads that
    share a kv head (GQA; REP is rep rounded up to a power of two) attend over the split's slots from one load of
    its K/V tiles, where `_decode_attention` loads them once per query head (from L2 after the first), and the
    token's last split to arrive merges all of them (one counter per (token, kv head)). The same visibility, PDL
    prefetch and merge; a query's sums run in the same order whatever the step's tokens, so a verification step's
    outputs stay those of one-token steps. (On SmolLM2, 9 heads over 3 kv heads, the attention of 16 rows of two
    tokens at 1,000 cached slots doubled the fused layer's cost: docs/benchmarks/2026-12-07-forty-third-lease.md,
    A.)"""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    n_kv = n_heads // rep
    mg, split = tl.program_id(0), tl.program_id(1)
    m, kv_head = mg // n_kv, mg % n_kv
    dims = tl.arange(0, HEAD_DIM)
    members = tl.arange(0, REP)
    member = members < rep
    mh = m * n_heads + kv_head * rep + members  # [REP] the (token, query head) indices of the group
    pos = tl.load(positions_ptr + m)
    if SKIP_DEAD:
        if tl.load(live_ptr + m) == 0:
            return
    root, ancestors, fresh, first, last, k_base, slots, seen, at, k, v = _split_start(
        kv_ptr, rows_ptr, root_ptr, ancestors_ptr, m, pos, kv_head, split, keys_per_split, window, n_tokens,
        stride_kv, stride_b, stride_h, stride_s, HEAD_DIM, BLOCK_S, TREE)
    if PDL:
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + mh[:, None] * HEAD_DIM + dims[None, :], mask=member[:, None], other=0.0).to(tl.float32)
    if first < last:
        k, v = _fresh_slots(k, v, k_base, at, seen, slots, fresh, stride_kv)
        run_max, run_sum, acc = _attend_group(q, k, v, seen, tl.full((REP,), float("-inf"), tl.float32),
                                              tl.zeros((REP,), tl.float32), tl.zeros((REP, HEAD_DIM), tl.float32),
                                              scale, q_ptr)
        for s0 in range(first + BLOCK_S, last, BLOCK_S):
            tile_seen, tile_k, tile_v = _next_tile(k_base, s0, last, pos, window, root, ancestors, stride_kv,
                                                   stride_s, HEAD_DIM, BLOCK_S, TREE)
            run_max, run_sum, acc = _attend_group(q, tile_k, tile_v, tile_seen, run_max, run_sum, acc, scale, q_ptr)
        n_used = tl.minimum(pos // keys_per_split + 1, grid_splits)
        _finish_group(partial_ptr, stats_ptr, count_ptr + mg, out_ptr, mh, member, n_used + 0 * mh, n_used, split,
                      acc, run_max, run_sum, HEAD_DIM, N_SPLITS)


@triton.jit
def _decode_attention_rows(q_ptr, kv_ptr, positions_ptr, rows_ptr, partial_ptr, stats_ptr, count_ptr, out_ptr,
                           root_ptr, ancestors_ptr, n_heads, rep, window, scale, keys_per_split, grid_splits,
                           row_tokens, chunk, stride_kv, stride_b, stride_h, stride_s,
                           HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr,
                           N_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                           TREE: tl.constexpr):
    """Program ((row b * n_kv_heads + kv head) * chunks + c, split): tokens c * chunk.. of row b's `row_tokens` (at
    most `chunk` of them) times the `rep` query heads of one kv head, BLOCK_Q queries (padded to at least 16; the
    chunks keep a program's queries few enough not to spill), over one range of cache slots, as a flash kernel does it:
    scores q @ K^T and outputs p @ V on tensor cores, each K/V tile loaded once for all of them (`_decode_attention`
    loads it once per query, `_decode_attention_gqa` once per token). A query's visibility, its splits and the merge
    (by the chunk's last split to arrive: one counter per program) are the per-query kernels'; p goes into its dot
    in V's type, as the modular layer's flash attention does (DOT_PRECISION: "ieee" for an fp32 model). The step's
    tokens must sit [B, T], row b's T tokens in cache row rows[b * T] (not a packed step). (PDL: everything it loads
    is read after the wait.)

    Why (ATTENTION_ROWS): steps of several tokens a row at long contexts, where the per-query programs read each
    tile again per query head and token: 16 rows x 2 tokens of SmolLM2 at 2,000 cached slots 82.4 µs a fused layer
    against the modular layer's 67.4 (docs/benchmarks/2026-12-07-forty-fourth-lease.md, A)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    n_kv, chunks = n_heads // rep, tl.cdiv(row_tokens, chunk)
    bg, split = tl.program_id(0), tl.program_id(1)
    b, kv_head, t0 = bg // (n_kv * chunks), bg // chunks % n_kv, bg % chunks * chunk
    dims = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, BLOCK_Q)
    valid = j < tl.minimum(chunk, row_tokens - t0) * rep
    m = b * row_tokens + t0 + tl.where(valid, j // rep, 0)  # each query's token
    mh = m * n_heads + kv_head * rep + j % rep  # [BLOCK_Q] its (token, query head)
    pos = tl.load(positions_ptr + m, mask=valid, other=-1)  # (a padding query sees no slot)
    if TREE:
        root = tl.load(root_ptr + m, mask=valid, other=0)
        ancestors = tl.load(ancestors_ptr + m, mask=valid, other=0)
    else:
        root = pos
        ancestors = pos.to(tl.int64)
    first = split * keys_per_split
    top = tl.max(pos, axis=0)
    last_row = tl.minimum(first + keys_per_split, top + 1)  # the split's slots any query of the row sees
    if PDL:
        tl.extra.cuda.gdc_wait()
    if first < last_row:
        last = tl.minimum(first + keys_per_split, pos + 1)
        k_base = kv_ptr + tl.load(rows_ptr + b * row_tokens) * stride_b + kv_head * stride_h
        q = tl.load(q_ptr + mh[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
        run_max = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
        run_sum = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)
        for s0 in range(first, last_row, BLOCK_S):
            slots = s0 + tl.arange(0, BLOCK_S)
            seen = _visible(slots[None, :], last[:, None], pos[:, None], window, root[:, None], ancestors[:, None],
                            TREE)  # [BLOCK_Q, BLOCK_S]
            # slots no query sees load as zeros: never a stale NaN into p @ V, where a 0 weight cannot hide it
            wanted = (tl.max(seen.to(tl.int32), axis=0) > 0)[:, None]
            at = slots[:, None] * stride_s + dims[None, :]
            k = tl.load(k_base + at, mask=wanted, other=0.0)
            v = tl.load(k_base + stride_kv + at, mask=wanted, other=0.0)
            scores = _rounded(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), q_ptr) * scale  # (as q @ k^T)
            scores = tl.where(seen, scores, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            p = tl.exp(scores - shift[:, None])
            rescale = tl.exp(run_max - shift)
            run_sum = run_sum * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            run_max = new_max
        n_used = tl.minimum(pos // keys_per_split + 1, grid_splits)  # each query's splits
        _finish_group(partial_ptr, stats_ptr, count_ptr + bg, out_ptr, mh, valid, n_used,
                      tl.minimum(top // keys_per_split + 1, grid_splits), split, acc, run_max, run_sum, HEAD_DIM,
                      N_SPLITS)


def attention_masks(cfg, positions, n_slots):
    """The masks the modular layer attends with (True: may attend): slots up to each token's position, within the
    layer's sliding window; {window: [B, 1, rep * T, n_slots]} with the `rep` heads of a kv head stacked."""
    B, T = positions.shape
    key = torch.arange(n_slots, device=positions.device)
    visible = key[None, None, :] <= positions[:, :, None]
    rep = cfg.n_heads // cfg.n_kv_heads
    out = {}
    for window in set(cfg.sliding_windows):
        m = visible if window is None else visible & (key[None, None, :] > positions[:, :, None] - window)
        out[window] = m[:, None, None].expand(B, 1, rep, T, n_slots).reshape(B, 1, rep * T, n_slots)
    return out
