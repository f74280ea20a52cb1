"""The n-gram drafter's search (prompt lookup) in one Triton kernel.

`ngram_search(history [B, S] int64, lengths [B] int64, k, max_ngram, min_ngram) -> (tokens [B, k], valid [B])`:
for each row, the latest earlier occurrence of its last n tokens (n from max_ngram down to min_ngram, the longest
that matches), whose next token exists, and the up-to-k tokens that followed it. The reference is
`engine.drafters.NgramDrafter._search`: per n a sliding-window compare over the whole history, an all-reduce and a
max, then gathers, which torch.compile turns into five or six kernels of 1-3 µs each, plus a launch gap each inside
the step's CUDA graph. A decoding step runs this search every time (in an AR step after a miss too), so it is paid
per token where the drafter finds little.

* One program per row walks the row's history once, in blocks of BLOCK_S candidates e for the token after a match
  (e = start + n). For d = 1..max_ngram it loads history[e - d] once and compares it with the row's d-th last
  token, keeping a running AND: an n-gram ends just before e exactly when the AND holds through d = n. So all n
  are searched in max_ngram loads a block, and each n keeps the latest e that matches.
* Every load stays inside the row's first min(length, S) tokens: the masks bound each block of candidates by the
  row's length, not only by 0 (a block is BLOCK_S wide whatever S is, so without that a row of S = 512 read 4 KB
  past its end, and the last row past the history tensor's).
* The output is the reference's exactly, filler included: tokens at history[clamp(start + i, 0, S - 1)] with start
  = -1 when nothing matched, valid = min(length - start, k) for a match and 0 otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import require_gpu_compiled

BLOCK_S = 1024  # candidate starts a loop iteration
MAX_NGRAM = 8  # the longest n-gram the kernel compares (the recipe's max_ngram is checked against it)


@triton.jit
def _ngram_kernel(history_ptr, lengths_ptr, tokens_ptr, valid_ptr, S, history_stride, tokens_stride,
                  K: tl.constexpr, MAX_N: tl.constexpr, MIN_N: tl.constexpr, N_SLOTS: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    hist = history_ptr + row * history_stride
    L = tl.load(lengths_ptr + row)
    # A candidate is where a match's next token sits, e = start + n: an n-gram ends just before e exactly when the
    # last d tokens before e equal the row's last d tokens for d = 1..n. latest[n - 1]: the latest such e (-1: none).
    slot = tl.arange(0, N_SLOTS)
    latest = tl.full([N_SLOTS], -1, tl.int64)
    for e0 in range(0, L, BLOCK_S):
        e = e0 + tl.arange(0, BLOCK_S)
        run = e < L  # still matching at every distance so far (and a next token exists: e < L)
        for d in tl.static_range(1, MAX_N + 1):
            # Only candidates e < L load: the block runs BLOCK_S past the row's end, and for the last row of the
            # history past the tensor's end (a read that faults when no allocation follows it: issue #20).
            before = tl.load(hist + e - d, mask=(e - d >= 0) & (e < L) & (e - d < S), other=-1)
            tail = tl.load(hist + L - d, mask=(L - d >= 0) & (L - d < S), other=-2)
            run = run & (e - d >= 0) & (before == tail)
            if d >= MIN_N:  # an n-gram of n = d ends before e; the tail itself needs L >= n + 1
                best = tl.max(tl.where(run & (L >= d + 1), e, -1), axis=0)
                latest = tl.where(slot == d - 1, tl.maximum(latest, best), latest)
    found = tl.max(tl.where(latest >= 0, slot, -1), axis=0)  # the longest n with a match, less one; -1: none
    start = tl.sum(tl.where(slot == found, latest, 0), axis=0)
    start = tl.where(found >= 0, start, -1)
    i = tl.arange(0, BLOCK_K)
    offs = tl.minimum(tl.maximum(start + i, 0), S - 1)
    tl.store(tokens_ptr + row * tokens_stride + i, tl.load(hist + offs), mask=i < K)
    tl.store(valid_ptr + row, tl.where(start >= 0, tl.minimum(L - start, K), 0))


def ngram_search(history: torch.Tensor, lengths: torch.Tensor, k: int, max_ngram: int, min_ngram: int):
    """(tokens [B, k] int64, valid [B] int64): NgramDrafter's proposal for every row, in one launch."""
    if not 1 <= min_ngram <= max_ngram <= MAX_NGRAM:
        raise ValueError(f"ngram search: needs 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got {min_ngram}, "
                         f"{max_ngram}")
    B, S = history.shape
    tokens = torch.empty(B, k, dtype=history.dtype, device=history.device)
    valid = torch.empty(B, dtype=torch.long, device=history.device)
    _ngram_kernel[(B,)](history, lengths, tokens, valid, S, history.stride(0), tokens.stride(0), K=k,
                        MAX_N=max_ngram, MIN_N=min_ngram, N_SLOTS=triton.next_power_of_2(max_ngram),
                        BLOCK_S=BLOCK_S, BLOCK_K=triton.next_power_of_2(k), num_warps=4)
    return tokens, valid


# -- checking and timing -----------------------------------------------------------------------------------------
def check(reference, k: int = 4, max_ngram: int = 4, min_ngram: int = 2, device: str = "cpu", seed: int = 0) -> int:
    """Compare ngram_search with `reference(history, lengths, k)` (the drafter's torch search; kernels never import
    the engine) on random histories over a 6-token alphabet (many repeats), ragged lengths from 1 to S, a row without
    any repeat and a row of one token: tokens and valid counts must be equal. Returns the rows compared; raises AssertionError on a difference."""
    g = torch.Generator().manual_seed(seed)
    rows = 0
    for B, S in ((1, 64), (3, 200), (5, 513), (2, 40)):
        history = torch.randint(0, 6, (B, S), generator=g).to(device)
        lengths = torch.randint(1, S + 1, (B,), generator=g).to(device)
        lengths[0] = S
        if S == 40:  # no n-gram repeats in row 0; row 1 has a single token
            history[0] = torch.arange(S)
            lengths[1] = 1
        got = ngram_search(history, lengths, k, max_ngram, min_ngram)
        want = reference(history, lengths, k)
        for name, a, b in (("tokens", got[0], want[0]), ("valid", got[1], want[1])):
            assert torch.equal(a.cpu(), b.cpu()), f"ngram search {name} at B={B}, S={S}: {a.tolist()} != {b.tolist()}"
        rows += B
    return rows


def benchmark(reference, B: int = 1, S: int = 1024, k: int = 4, max_ngram: int = 4, min_ngram: int = 2) -> dict:
    """µs of one search, this kernel against `reference` (compiled by the caller as the engine compiles it), each as
    a CUDA graph of 20 calls (triton.testing.do_bench_cudagraph), on a history whose last tokens repeat. GPU only."""
    from triton.testing import do_bench_cudagraph

    require_gpu_compiled(_ngram_kernel)
    history = torch.arange(S, device="cuda").remainder(50).repeat(B, 1)
    lengths = torch.full((B,), S - 100, device="cuda")
    reference(history, lengths, k)

    def many(fn):
        def run():
            for _ in range(20):
                fn()
        return run

    ours = do_bench_cudagraph(many(lambda: ngram_search(history, lengths, k, max_ngram, min_ngram))) * 1e3 / 20
    theirs = do_bench_cudagraph(many(lambda: reference(history, lengths, k))) * 1e3 / 20
    return dict(B=B, S=S, k=k, triton_us=ours, reference_us=theirs)
