"""Greedy verification in Triton: the `accept` kernel slot as one fused kernel.

`accept(drafts [B, k] int64, valid [B] int64, logits [B, k+1, V]) -> (n_accepted [B] int64, tokens [B, k+1] int64)`

After the target model scores [last, d_1 .. d_k], greedy speculative decoding keeps the longest prefix of drafts that
equal the target's own argmax, and one more token of the target's: the row emits tokens[:, : n_accepted + 1]. Only
the first `valid[b]` drafts of row b are real (a drafter may propose fewer than k). The reference,
`builtin.accept_torch`, is an argmax over [B, k+1, V] followed by half a dozen tiny kernels (compare, mask, cumprod,
sum); here one kernel does the argmax, the comparison and the prefix count (after a fill of n_accepted).

* One program per (row, position): each streams that position's V logits once, in blocks of BLOCK_V, and writes
  the argmax token. A single program per row, looping over the k+1 positions, leaves all but B multiprocessors
  idle: measured with benchmark() on an H200 it was several times slower than the reference for k > 0. So the
  positions are spread over programs, and the per-row prefix count is done with an atomic, as follows.
* The prefix count needs no second pass. n_accepted[b] is the first position whose draft is rejected (or k when
  none is), so it starts at k (one fill) and every program whose valid draft differs from its argmax, or whose
  draft is beyond valid[b], lowers it with an atomic min to its position. The order in which programs finish
  does not matter.
* Inside the V loop every lane keeps its own running (max, index) and nothing is reduced across lanes; only after
  the loop does one reduction pick the winner. The loop body is then loads and elementwise compares only, and wide
  (MAX_BLOCK_V) so that many loads are in flight at once.

Exactly torch.argmax's answer:
* Ties go to the lowest index: a lane replaces its best only on a strictly greater value (its indices grow), and
  the final reduction takes the lowest index among lanes holding the maximum.
* NaN counts as the maximum, as in torch.argmax: the first NaN of the row wins. Comparisons with NaN are false, so
  a lane tracks "my best is NaN" explicitly.
* A row of only -inf gives index 0 (no lane ever sees a value strictly greater than -inf).

Logits are read in their own dtype and compared in fp32: widening is exact, so the order of values is unchanged and
the result equals an argmax in the original dtype. This also keeps the kernel runnable in Triton's CPU interpreter,
which has no bf16 arithmetic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import require_gpu_compiled

# Logits per loop iteration, and warps per program. The V loop is bound by memory latency, so what counts is the
# bytes in flight per iteration: with benchmark()'s shapes on an H200 at V = 151936, 8192 logits on 8 warps took
# about half the time of 2048 on 4 warps, and 16384 on 16 warps was no better overall.
MAX_BLOCK_V = 8192
NUM_WARPS = 8


@triton.jit
def _accept_kernel(drafts_ptr, valid_ptr, logits_ptr, n_accepted_ptr, tokens_ptr,
                   n_drafts, vocab, drafts_stride_b, logits_stride_b, logits_stride_p, tokens_stride_b,
                   BLOCK_V: tl.constexpr):
    row, position = tl.program_id(0), tl.program_id(1)
    logits_row = logits_ptr + row * logits_stride_b + position * logits_stride_p
    lanes = tl.arange(0, BLOCK_V)

    best_value = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_index = lanes  # a lane that never improves on -inf keeps its first index
    best_is_nan = lanes < 0  # all False
    for start in range(0, vocab, BLOCK_V):
        ids = start + lanes
        x = tl.load(logits_row + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
        x_is_nan = x != x
        better = (x > best_value) | (x_is_nan & ~best_is_nan)  # strictly greater: earlier index wins ties
        best_value = tl.where(better, x, best_value)
        best_index = tl.where(better, ids, best_index)
        best_is_nan = best_is_nan | x_is_nan

    any_nan = tl.max(best_is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(best_is_nan, float("-inf"), best_value), axis=0)
    is_winner = tl.where(any_nan, best_is_nan, best_value == top)
    token = tl.min(tl.where(is_winner, best_index, vocab), axis=0).to(tl.int64)
    tl.store(tokens_ptr + row * tokens_stride_b + position, token)

    # The last position has no draft: its token is the target's own next token and never shortens the prefix.
    is_draft = position < n_drafts
    draft = tl.load(drafts_ptr + row * drafts_stride_b + position, mask=is_draft, other=-1)
    n_valid = tl.load(valid_ptr + row)
    rejected = is_draft & ((position >= n_valid) | (draft != token))
    tl.atomic_min(n_accepted_ptr + row, position.to(tl.int64), mask=rejected)


def accept(drafts: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_accepted [B], tokens [B, k+1]): the greedy tokens and the length of the verified draft prefix per row."""
    B, n_positions, vocab = logits.shape
    n_drafts = drafts.shape[1]
    assert n_positions == n_drafts + 1 and drafts.shape[0] == valid.shape[0] == B, (drafts.shape, valid.shape,
                                                                                     logits.shape)
    # Unit stride along the vocabulary and along the drafts (the engine's drafts are a slice of its inputs).
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    drafts = drafts if drafts.stride(-1) == 1 else drafts.contiguous()
    valid = valid.contiguous()
    n_accepted = torch.full((B,), n_drafts, dtype=torch.int64, device=logits.device)  # lowered by rejections
    tokens = torch.empty(B, n_positions, dtype=torch.int64, device=logits.device)
    _accept_kernel[(B, n_positions)](drafts, valid, logits, n_accepted, tokens,
                                     n_drafts, vocab, drafts.stride(0), logits.stride(0), logits.stride(1),
                                     tokens.stride(0), BLOCK_V=min(triton.next_power_of_2(vocab), MAX_BLOCK_V),
                                     num_warps=NUM_WARPS)
    return n_accepted, tokens


# -- checking and timing -----------------------------------------------------------------------------------------
def make_case(B: int, k: int, vocab: int, generator: torch.Generator, dtype=torch.float32, device: str = "cpu",
              ties: bool = False, n_valid: torch.Tensor | None = None, wrong_at: torch.Tensor | None = None):
    """(drafts, valid, logits) for a check: drafts equal the logits' argmax up to position `wrong_at[b]` of each row
    (default: random), so every acceptance length occurs; `ties` rounds the logits to a few values, so most rows
    hold many equal maxima."""
    logits = torch.randn(B, k + 1, vocab, generator=generator)
    if ties:
        logits = logits.round()
    logits = logits.to(dtype)
    drafts = logits.float().argmax(-1)[:, :k].clone()
    if wrong_at is None:
        wrong_at = torch.randint(0, k + 1, (B,), generator=generator)
    for b, at in enumerate(wrong_at.tolist()):
        if at < k:
            drafts[b, at] = (drafts[b, at] + 1) % vocab
    if n_valid is None:
        n_valid = torch.randint(0, k + 1, (B,), generator=generator)
    return drafts.to(device), n_valid.to(device), logits.to(device)


# (batch, k, vocab, ties): AR steps (k = 0), one vocabulary block and two (9000 > MAX_BLOCK_V), vocabularies that
# are not a multiple of the block, and tie-heavy logits.
CHECK_CASES = ((2, 0, 300, False), (3, 4, 5000, False), (4, 8, 9000, True), (2, 3, 100, True))


def check(cases=CHECK_CASES, dtype=torch.float32, device: str = "cpu") -> None:
    """Compare with builtin.accept_torch (exact equality); raises AssertionError on a mismatch. fp32 inputs on CPU (the
    interpreter), any float dtype on a GPU."""
    from .builtin import accept_torch

    g = torch.Generator().manual_seed(0)
    for B, k, vocab, ties in cases:
        drafts, valid, logits = make_case(B, k, vocab, g, dtype, device, ties)
        want, got = accept_torch(drafts, valid, logits), accept(drafts, valid, logits)
        for name, w, o in zip(("n_accepted", "tokens"), want, got):
            assert o.dtype == w.dtype and torch.equal(o, w), (f"accept {B, k, vocab} ties={ties} {dtype}: {name} "
                                                             f"{o.tolist()} != {w.tolist()}")


# Vocabulary sizes of the brief's range: SmolLM2 (49152), Llama 3 (128256), Qwen2 / Qwen3 (151936).
BENCH_VOCABS = (49152, 128256, 151936)


def benchmark(batches=(1, 8, 32), ks=(0, 4, 8), vocabs=BENCH_VOCABS, dtype=torch.bfloat16) -> list[dict]:
    """Milliseconds per call of this kernel and of builtin.accept_torch, each captured in a CUDA graph and timed by
    triton.testing.do_bench_cudagraph with CUDA events (the engine replays its steps as CUDA graphs); GPU only."""
    from triton.testing import do_bench_cudagraph

    from .builtin import accept_torch

    require_gpu_compiled(_accept_kernel)
    check(dtype=dtype, device="cuda")
    g = torch.Generator().manual_seed(0)
    results = []
    for vocab in vocabs:
        for B in batches:
            for k in ks:
                drafts, valid, logits = make_case(B, k, vocab, g, dtype, "cuda")
                results.append({"vocab": vocab, "batch": B, "k": k, "dtype": str(dtype).removeprefix("torch."),
                                "triton_ms": do_bench_cudagraph(lambda: accept(drafts, valid, logits)),
                                "torch_ms": do_bench_cudagraph(lambda: accept_torch(drafts, valid, logits))})
    return results


if __name__ == "__main__":
    for r in benchmark():
        print(r)
