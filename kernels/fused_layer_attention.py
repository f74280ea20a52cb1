"""The fused layer's attention (triton_fused_layer.py's module docstring: kernel 2, and with a per-head q/k norm
the sixth kernel): `_decode_attention`, one query over one range of cache slots a program, merged by each (token,
head)'s last split, with its helpers; `_qk_norm_rope`, Qwen3's q/k norm and RoPE; and `attention_masks`, the modular
layer's masks, which `check` and `benchmark` compare with.

Two kernels that read each K/V tile once for several queries were tried here and removed after the H100 timed them
(docs/BENCHMARKS.md, "What is not yet fast"; git history has them): a program per (token, kv head, split) for the kv
head's query heads (0.46x-0.92x this kernel at 33 shapes, forty-fourth lease) and, for the tensor-core path's steps,
a program per (row, kv head, split) for the row's tokens and query heads on tensor cores (forty-fifth lease: slower
than this kernel or the modular layer at every shape of 16 rows x 1-4 tokens at 64-2,000 cached slots).

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
def _partials(stats_ptr, partial_ptr, mh, first, n_used, dims, N_SPLITS: tl.constexpr, MERGE: tl.constexpr,
              HEAD_DIM: tl.constexpr):
    """Splits first .. first + MERGE - 1 of (token, head) `mh`, those the token used: their (max, sum, unnormalized
    output) as `_attend` left them, -inf / 0 / 0 for the others."""
    splits = first + tl.arange(0, MERGE)
    used = splits < n_used
    at = mh * N_SPLITS + splits
    s_max = tl.load(stats_ptr + at * 2, mask=used, other=float("-inf"))
    s_sum = tl.load(stats_ptr + at * 2 + 1, mask=used, other=0.0)
    s_acc = tl.load(partial_ptr + at[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None], other=0.0)
    return s_max, s_sum, s_acc


@triton.jit
def _decode_attention(q_ptr, kv_ptr, positions_ptr, rows_ptr, live_ptr, partial_ptr, stats_ptr, count_ptr, out_ptr,
                      root_ptr, ancestors_ptr, n_heads, rep, window, scale, keys_per_split, grid_splits, n_tokens,
                      stride_kv, stride_b, stride_h, stride_s,
                      HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, N_SPLITS: tl.constexpr, PDL: tl.constexpr,
                      SKIP_DEAD: tl.constexpr, TREE: tl.constexpr, MERGE: tl.constexpr,
                      LATE_TRIGGER: tl.constexpr = False):
    """Program (token m * n_heads + head, split): one query over one range of cache slots. A row's T tokens read the
    same K/V tiles, from L2 after the first. The token's last split to finish merges the splits' partials MERGE at a
    time (a power of two, at most N_SPLITS), over the splits the token used: the merge's work then follows the token's
    position, not the cache's length. TREE: the token is a
    draft-tree node whose `positions` entry is its cache slot; of the slots from its tree's first (`root_ptr`) on it
    sees those whose bit, counted from that first slot, is set in its ancestor mask (`ancestors_ptr`, int64).

    The split's first tile of K/V is loaded before the PDL wait, all but the slots this step may have written: those
    from the tree's first on, or in a chain step the last `n_tokens` up to the token's own (a row's tokens in a step
    are consecutive positions, at most all the step's tokens). The earlier slots were written by earlier steps, so
    their DRAM round trip overlaps the q/k/v kernel's tail; the others are read after the wait.

    PDL: the next kernel (the o projection) may launch once every program has called `gdc_launch_dependents` or
    ended: at the program's start, or with LATE_TRIGGER once its split's tiles are attended (a split past the
    position never calls it: its end counts), so that the next kernel's programs, which load their weights before
    their own wait, neither hold an SM's registers nor compete for its bandwidth while splits still attend."""
    if PDL and not LATE_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    mh, split = tl.program_id(0), tl.program_id(1)
    m, head = mh // n_heads, mh % n_heads
    dims = tl.arange(0, HEAD_DIM)
    pos = tl.load(positions_ptr + m)
    if SKIP_DEAD:
        if tl.load(live_ptr + m) == 0:
            return
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
    k_base = kv_ptr + tl.load(rows_ptr + m) * stride_b + (head // rep) * stride_h
    slots = first + tl.arange(0, BLOCK_S)
    seen = _visible(slots, last, pos, window, root, ancestors, TREE)
    at = slots[:, None] * stride_s + dims[None, :]
    old = (seen & (slots < fresh))[:, None]
    k = tl.load(k_base + at, mask=old, other=0.0).to(tl.float32)
    v = tl.load(k_base + stride_kv + at, mask=old, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + mh * HEAD_DIM + dims).to(tl.float32)
    if first < last:
        new = (seen & (slots >= fresh))[:, None]
        k = tl.where(new, tl.load(k_base + at, mask=new, other=0.0).to(tl.float32), k)
        v = tl.where(new, tl.load(k_base + stride_kv + at, mask=new, other=0.0).to(tl.float32), v)
        run_max, run_sum, acc = _attend(q, k, v, seen, float("-inf"), 0.0, tl.zeros((HEAD_DIM,), tl.float32), scale,
                                        q_ptr)
        for s0 in range(first + BLOCK_S, last, BLOCK_S):  # (names of their own: no loop-carried type changes)
            tile = s0 + tl.arange(0, BLOCK_S)
            tile_seen = _visible(tile, last, pos, window, root, ancestors, TREE)
            tile_at = tile[:, None] * stride_s + dims[None, :]
            tile_k = tl.load(k_base + tile_at, mask=tile_seen[:, None], other=0.0).to(tl.float32)
            tile_v = tl.load(k_base + stride_kv + tile_at, mask=tile_seen[:, None], other=0.0).to(tl.float32)
            run_max, run_sum, acc = _attend(q, tile_k, tile_v, tile_seen, run_max, run_sum, acc, scale, q_ptr)
        if PDL and LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
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
                # The first MERGE splits, then (a token past them) the next MERGE at a time, rescaled to the running
                # maximum as the splits themselves combine their tiles (`_attend`). Why not all N_SPLITS at once: on
                # the H200 SmolLM2's AR step at B = 2 cost 3.6% more in caches of 576, 640 and 1,024 slots than in
                # 512, alike, at the same position, and what those share against 512 is this merge over 32 lanes
                # instead of 16 (forty-eighth lease, `benchmarks/run.py cache_length`; this change not yet timed).
                # A token within the first MERGE splits gets the same sums in every cache of MERGE splits or more
                # (SmolLM2's one-token steps: every cache).
                s_max, s_sum, s_acc = _partials(stats_ptr, partial_ptr, mh, 0, n_used, dims, N_SPLITS, MERGE, HEAD_DIM)
                top = tl.max(s_max, axis=0)
                weight = tl.exp(s_max - tl.where(top == float("-inf"), 0.0, top))  # 0 where no slot was seen
                num = tl.sum(s_acc * weight[:, None], axis=0)
                den = tl.sum(s_sum * weight, axis=0)
                for c0 in range(MERGE, n_used, MERGE):  # (names of their own: no loop-carried type changes)
                    m_max, m_sum, m_acc = _partials(stats_ptr, partial_ptr, mh, c0, n_used, dims, N_SPLITS, MERGE,
                                                    HEAD_DIM)
                    new_top = tl.maximum(top, tl.max(m_max, axis=0))
                    ref = tl.where(new_top == float("-inf"), 0.0, new_top)
                    m_weight = tl.exp(m_max - ref)
                    rescale = tl.exp(top - ref)
                    num = num * rescale + tl.sum(m_acc * m_weight[:, None], axis=0)
                    den = den * rescale + tl.sum(m_sum * m_weight, axis=0)
                    top = new_top
                tl.store(out_ptr + mh * HEAD_DIM + dims, (num / den).to(out_ptr.dtype.element_ty))
                tl.atomic_xchg(count_ptr + mh, 0)  # ready for the next layer and step


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
