"""Decode / verify attention in Triton: the `attention` kernel slot, flash-decoding style.

`attention(q [B, Hkv, rep*T, D], k [B, Hkv, S, D], v [B, Hkv, S, D], mask bool [B, 1, rep*T, S]) -> like q`

What the engine asks of this slot while decoding: a few queries (the T = k + 1 tokens of a verification step, times
the `rep` query heads that share a kv head, stacked along the query axis) attend over the whole static KV cache
(S slots, at least 512: engine/decode.cache_length; most of them not yet written or stale). `mask` is True where a
query may attend: slots up to the query's own position, and in sliding-window layers only the last `window` of them.

The reference, `builtin.attention_math`, makes three passes over memory: scores q @ k^T rounded to the model dtype,
an fp32 masked softmax, and probs (rounded to the model dtype) @ v. Here one kernel does all three in one pass over
K and V:

* One program per (query block, kv head, batch row, split of the cache). It keeps its queries in registers and
  walks its keys in blocks of BLOCK_N, so K and V are read from memory once and the [queries, S] score matrix is
  never written out.
* Online softmax in fp32 (Milakov and Gimelshein, 2018; as in FlashAttention): a running max and running sum per
  query, and an accumulator rescaled whenever the max grows. After the last block, acc / sum is the answer.
* A key block that no query of the program may see is skipped after loading only its mask tile: K and V are not
  read. The static cache is longer than any row, so all blocks past the longest row's position (and, in a sliding
  window, before the window) cost almost nothing, where the reference reads the whole cache every step.
* Split-S (flash-decoding): with few rows and kv heads, (query blocks x heads x rows) programs would leave most of
  the GPU idle while each walks thousands of keys. The cache is then cut into `n_splits` ranges, one program each,
  and a second small kernel merges the partial results (each split's unnormalized accumulator, max and sum) into the
  output. With n_splits = 1 the first kernel writes the output itself and the second is not launched.
* Scores are rounded to the input dtype before scaling, exactly where the reference's `q @ k^T` rounds its output
  (a no-op in fp32); without that, bf16 outputs drift from the reference by more than bf16's own rounding.

Numerics: matrix products accumulate in fp32 (tensor cores take bf16 inputs directly; fp32 inputs use IEEE fp32
products, not TF32, as PyTorch's matmul does by default). The softmax is fp32 and the output is rounded once, to
q's dtype, on the store. That is also why the kernel runs under Triton's CPU interpreter, which has no bf16
arithmetic: with fp32 inputs every cast is a no-op. Probabilities enter the P @ V product in V's dtype relative to
the running max (FlashAttention's choice) where the reference rounds normalized probabilities: in bf16 the two
round differently, within bf16's precision.

A query row with no allowed key at all gets NaN (0 / 0), as the reference's softmax over only -inf does; the engine
never produces one, since a query always sees its own slot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import require_gpu_compiled

# Keys per loop iteration. 64 keys x 128 dims of bf16 is a 16 KB tile of K and one of V: large enough for tensor-core
# products and long memory transactions, small enough that skipping is fine-grained.
BLOCK_N = 64
# Query rows per program: rep * T is 1..64 in decode and verify steps; tl.dot needs at least 16 rows.
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64
# Split-S choice, from benchmark(n_splits=s) for s = 1, 2, 4, .., 64 on an H200 (132 multiprocessors):
# the fastest split counts gave about 4 programs per multiprocessor, never more than 16 splits, and splits shorter
# than 256 keys did not pay.
PROGRAMS_PER_MULTIPROCESSOR, MAX_SPLITS, MIN_KEYS_PER_SPLIT = 4, 16, 256


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, partial_ptr, stats_ptr,
    n_queries, n_keys, head_dim, keys_per_split,
    q_stride_b, q_stride_h, q_stride_m,
    k_stride_b, k_stride_h, k_stride_s,
    v_stride_b, v_stride_h, v_stride_s,
    mask_stride_b, mask_stride_m,
    o_stride_b, o_stride_h, o_stride_m,
    SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, N_SPLITS: tl.constexpr,
):
    program, head, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_block, split = program // N_SPLITS, program % N_SPLITS
    queries = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    is_query, is_dim = queries < n_queries, dims < head_dim

    q = tl.load(q_ptr + row * q_stride_b + head * q_stride_h + queries[:, None] * q_stride_m + dims[None, :],
                mask=is_query[:, None] & is_dim[None, :], other=0.0)
    k_head = k_ptr + row * k_stride_b + head * k_stride_h
    v_head = v_ptr + row * v_stride_b + head * v_stride_h
    mask_rows = mask_ptr + row * mask_stride_b + queries[:, None] * mask_stride_m
    split_start = split * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, n_keys)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(split_start, split_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        is_key = keys < split_end
        # Padding queries and keys read as "not allowed": they never contribute and never unmask a block.
        allowed = tl.load(mask_rows + keys[None, :], mask=is_query[:, None] & is_key[None, :], other=0)
        if tl.max(allowed.to(tl.int32)) > 0:  # skip key blocks no query may see, without loading K or V
            k = tl.load(k_head + keys[:, None] * k_stride_s + dims[None, :], mask=is_key[:, None] & is_dim[None, :],
                        other=0.0)
            v = tl.load(v_head + keys[:, None] * v_stride_s + dims[None, :], mask=is_key[:, None] & is_dim[None, :],
                        other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            # Round where the reference's q @ k^T rounds (a no-op in fp32), then scale in fp32 as it does.
            scores = scores.to(q_ptr.dtype.element_ty).to(tl.float32) * SCALE
            scores = tl.where(allowed, scores, float("-inf"))

            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # A query with no allowed key so far has max -inf; it is shifted by 0 instead, so that exp(-inf - -inf)
            # = NaN never appears (its p and rescale factor are exp(-inf) = 0).
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(running_max - shift)
            p = tl.exp(scores - shift[:, None])
            running_sum = running_sum * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            running_max = new_max

    if N_SPLITS == 1:
        # Padding queries have an empty sum: divide them by 1 (they are not stored) to keep 0 / 0 out.
        out = acc / tl.where(is_query, running_sum, 1.0)[:, None]
        tl.store(o_ptr + row * o_stride_b + head * o_stride_h + queries[:, None] * o_stride_m + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=is_query[:, None] & is_dim[None, :])
    else:
        # The split's unnormalized accumulator and its (max, sum) go to fp32 scratch for _combine_kernel:
        # partial [B, heads, N_SPLITS, n_queries, BLOCK_D], stats [B, heads, N_SPLITS, 2, n_queries].
        slot = (row * tl.num_programs(1) + head) * N_SPLITS + split
        tl.store(partial_ptr + (slot * n_queries + queries[:, None]) * BLOCK_D + dims[None, :], acc,
                 mask=is_query[:, None])
        tl.store(stats_ptr + (slot * 2) * n_queries + queries, running_max, mask=is_query)
        tl.store(stats_ptr + (slot * 2 + 1) * n_queries + queries, running_sum, mask=is_query)


@triton.jit
def _combine_kernel(partial_ptr, stats_ptr, o_ptr, n_queries, head_dim, o_stride_b, o_stride_h, o_stride_m,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, N_SPLITS: tl.constexpr):
    """out = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s with m = max_s m_s: the softmax over all keys."""
    query_block, head, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    queries = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    is_query = queries < n_queries
    first_slot = (row * tl.num_programs(1) + head) * N_SPLITS

    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(N_SPLITS):
        split_max = tl.load(stats_ptr + ((first_slot + split) * 2) * n_queries + queries, mask=is_query,
                            other=float("-inf"))
        top = tl.maximum(top, split_max)
    shift = tl.where(top == float("-inf"), 0.0, top)  # as in the main kernel: no -inf - -inf
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(N_SPLITS):
        slot = first_slot + split
        split_max = tl.load(stats_ptr + (slot * 2) * n_queries + queries, mask=is_query, other=float("-inf"))
        split_sum = tl.load(stats_ptr + (slot * 2 + 1) * n_queries + queries, mask=is_query, other=0.0)
        split_acc = tl.load(partial_ptr + (slot * n_queries + queries[:, None]) * BLOCK_D + dims[None, :],
                            mask=is_query[:, None], other=0.0)
        weight = tl.exp(split_max - shift)  # 0 for a split in which no key was visible
        total += weight * split_sum
        acc += weight[:, None] * split_acc
    out = acc / tl.where(is_query, total, 1.0)[:, None]
    tl.store(o_ptr + row * o_stride_b + head * o_stride_h + queries[:, None] * o_stride_m + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=is_query[:, None] & (dims < head_dim)[None, :])


_MULTIPROCESSORS: dict[int, int] = {}


def choose_splits(n_programs: int, n_keys: int, device: torch.device) -> int:
    """Cache splits that bring (query blocks x heads x rows) programs up to PROGRAMS_PER_MULTIPROCESSOR per
    multiprocessor, a power of two, at most MAX_SPLITS and with at least MIN_KEYS_PER_SPLIT keys each. 1 off-GPU."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    wanted = PROGRAMS_PER_MULTIPROCESSOR * _MULTIPROCESSORS[index] // n_programs
    most = min(MAX_SPLITS, max(1, n_keys // MIN_KEYS_PER_SPLIT))
    return min(most, 1 << max(wanted, 1).bit_length() - 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v for stacked grouped queries over the static cache (module docstring)."""
    B, n_kv_heads, n_queries, _ = q.shape
    n_programs = triton.cdiv(n_queries, _block_m(n_queries)) * n_kv_heads * B
    return attention_with_splits(q, k, v, mask, choose_splits(n_programs, k.shape[2], q.device))


def _block_m(n_queries: int) -> int:
    return min(max(triton.next_power_of_2(n_queries), MIN_BLOCK_M), MAX_BLOCK_M)


def attention_with_splits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          n_splits: int) -> torch.Tensor:
    """`attention` with the cache cut into (at most) `n_splits` ranges of whole key blocks."""
    B, n_kv_heads, n_queries, head_dim = q.shape
    n_keys = k.shape[2]
    assert k.shape == v.shape == (B, n_kv_heads, n_keys, head_dim), (q.shape, k.shape, v.shape)
    assert mask.dtype == torch.bool and mask.shape == (B, 1, n_queries, n_keys), (mask.shape, mask.dtype)
    # The kernels walk the last dim of every tensor with unit stride (the engine's tensors all have it).
    q, k, v, mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, mask))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: the engine views it per head
    block_m, block_d = _block_m(n_queries), max(triton.next_power_of_2(head_dim), 16)
    keys_per_split = triton.cdiv(triton.cdiv(n_keys, n_splits), BLOCK_N) * BLOCK_N
    n_splits = triton.cdiv(n_keys, keys_per_split)  # whole blocks per split can leave fewer splits than asked
    if n_splits > 1:
        partial = torch.empty(B, n_kv_heads, n_splits, n_queries, block_d, dtype=torch.float32, device=q.device)
        stats = torch.empty(B, n_kv_heads, n_splits, 2, n_queries, dtype=torch.float32, device=q.device)
    else:
        partial = stats = out  # not touched: the kernel stores the output directly
    n_query_blocks = triton.cdiv(n_queries, block_m)
    _attention_kernel[(n_query_blocks * n_splits, n_kv_heads, B)](
        q, k, v, mask, out, partial, stats,
        n_queries, n_keys, head_dim, keys_per_split,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        # A compile-time constant, so that it is an fp32 literal however the launch passes Python floats
        # (torch.compile passes them as fp64, which would turn the softmax into fp64).
        SCALE=head_dim ** -0.5, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", N_SPLITS=n_splits,
    )
    if n_splits > 1:
        _combine_kernel[(n_query_blocks, n_kv_heads, B)](partial, stats, out, n_queries, head_dim,
                                                         out.stride(0), out.stride(1), out.stride(2),
                                                         BLOCK_M=block_m, BLOCK_D=block_d, N_SPLITS=n_splits)
    return out


# -- checking and timing -----------------------------------------------------------------------------------------
def engine_mask(positions: torch.Tensor, rep: int, n_keys: int, window: int | None = None) -> torch.Tensor:
    """The mask the engine builds (model.Transformer.forward) for queries at `positions` [B, T]: slot s is visible
    to a query at position p when s <= p (and s > p - window in a sliding-window layer); [B, 1, rep*T, n_keys]."""
    B, T = positions.shape
    slots = torch.arange(n_keys, device=positions.device)[None, None, :]
    visible = slots <= positions[:, :, None]
    if window is not None:
        visible &= slots > positions[:, :, None] - window
    return visible[:, None, None].expand(B, 1, rep, T, n_keys).reshape(B, 1, rep * T, n_keys)


# (batch, kv heads, rep, T, cache slots, head dim, per-row length before the step, sliding window): GQA and MHA,
# decode (T = 1) and verify (T > 1) steps, ragged rows, slots past a row's end (stale or never written), caches that
# are not a multiple of BLOCK_N, query counts over one query block, and a window that hides the oldest slots.
CHECK_CASES = (
    (1, 1, 1, 1, 64, 16, (10,), None),
    (2, 2, 2, 3, 200, 64, (150, 7), None),
    (3, 2, 4, 5, 130, 32, (1, 60, 120), None),
    (1, 1, 16, 5, 300, 128, (290,), None),
    (2, 2, 3, 4, 257, 64, (200, 33), 40),
)


def check(cases=CHECK_CASES, dtype=torch.float32, device: str = "cpu", n_splits=(1, 3)) -> None:
    """Compare with builtin.attention_math on random inputs, unsplit and split; raises AssertionError on a mismatch.
    fp32 inputs on CPU (the interpreter), any float dtype on a GPU."""
    from .builtin import attention_math

    g = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for B, n_kv_heads, rep, T, n_keys, head_dim, lengths, window in cases:
        q, k, v = (torch.randn(B, n_kv_heads, n, head_dim, generator=g).to(device=device, dtype=dtype)
                   for n in (rep * T, n_keys, n_keys))
        positions = torch.tensor(lengths, device=device)[:, None] - 1 + torch.arange(T, device=device)[None]
        mask = engine_mask(positions, rep, n_keys, window)
        want = attention_math(q, k, v, mask)
        for splits in n_splits:
            got = attention_with_splits(q, k, v, mask, splits)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=tol, atol=tol,
                                       msg=lambda m: f"attention {B, n_kv_heads, rep, T, n_keys, head_dim} "
                                                     f"splits={splits} {dtype}: {m}")


# (name, kv heads, rep, head dim) of two deployments: SmolLM2-135M (9 heads over 3 kv heads) and Llama-3.1-8B
# (32 heads over 8 kv heads).
BENCH_MODELS = (("smollm2-135m", 3, 3, 64), ("llama-3.1-8b", 8, 4, 128))


def benchmark(batches=(1, 8, 32), steps=(1, 9), n_keys: int = 4096, filled=(0.25, 1.0), models=BENCH_MODELS,
              dtype=torch.bfloat16, n_splits: int | None = None) -> list[dict]:
    """Milliseconds per call of this kernel and of builtin.attention_math, each captured in a CUDA graph and timed by
    triton.testing.do_bench_cudagraph with CUDA events (the engine replays its steps as CUDA graphs); GPU only.

    `steps` are query tokens per row (1: decode, k + 1: verification of k drafts); `filled` is the fraction of the
    `n_keys`-slot cache each row's queries see; `n_splits` None lets choose_splits() pick, a number forces it (the
    sweep behind the split constants above). Every call reads another layer's cache, and there are enough layers
    that together they exceed twice the L2 cache, so K and V come from memory as they do in a real step."""
    from triton.testing import do_bench_cudagraph

    from .builtin import attention_math

    require_gpu_compiled(_attention_kernel)
    check(dtype=dtype, device="cuda")
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size

    def timed_attention(q, k, v, mask):
        return attention(q, k, v, mask) if n_splits is None else attention_with_splits(q, k, v, mask, n_splits)

    results = []
    for name, n_kv_heads, rep, head_dim in models:
        for B in batches:
            layer_bytes = 2 * B * n_kv_heads * n_keys * head_dim * torch.finfo(dtype).bits // 8
            n_layers = max(1, triton.cdiv(2 * l2_bytes, layer_bytes))
            caches = [torch.randn(2, B, n_kv_heads, n_keys, head_dim, device="cuda", dtype=dtype)
                      for _ in range(n_layers)]
            for T in steps:
                q = torch.randn(B, n_kv_heads, rep * T, head_dim, device="cuda", dtype=dtype)
                for fraction in filled:
                    length = max(1, int(n_keys * fraction) - T)
                    mask = engine_mask(length + torch.arange(T, device="cuda")[None].expand(B, T), rep, n_keys)

                    def over_layers(fn):
                        return lambda: [fn(q, kv[0], kv[1], mask) for kv in caches]

                    results.append({
                        "model": name, "batch": B, "T": T, "n_keys": n_keys, "visible": length + T,
                        "dtype": str(dtype).removeprefix("torch."),
                        "triton_ms": do_bench_cudagraph(over_layers(timed_attention)) / n_layers,
                        "torch_ms": do_bench_cudagraph(over_layers(attention_math)) / n_layers,
                    })
            del caches
    return results

if __name__ == "__main__":
    for r in benchmark():
        print(r)
