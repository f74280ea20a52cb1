"""What an implementation of each kernel slot must do: a contract per slot, checked by tools/sandbox/kernel_check.py.

A contract names the slot's signature, its reference (the built-in torch implementation, in fp32 where the
built-in's own low-precision rounding is not part of the slot's meaning), a generator of random inputs for a shape,
the realistic shapes the engine calls it with (decode: one token a row; verify: the stock recipe's k drafts plus one;
batched rows of different lengths), the dtypes it runs in and the tolerance per dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import builtin

# Layer sizes from the models' HF config.json: the packaged SmolLM2-135M, Llama-3-8B (GQA, large vocabulary),
# Qwen3-8B (per-head q/k norm) and Mistral-7B-v0.1 (sliding window).
SMOLLM2 = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
QWEN3_8B = dict(heads=32, kv_heads=8, head_dim=128)
MISTRAL_7B = dict(heads=32, kv_heads=8, head_dim=128, sliding_window=4096)
# Drafts per verification in the stock recipe (a verify step has K + 1 rows per sequence). Kernels sit below the
# engine and do not import its recipes: tests/test_kernel_tools.py checks that this is the stock recipe's k.
K = 4


@dataclass(frozen=True)
class SlotContract:
    name: str
    signature: str
    reference: Callable  # (*inputs) -> the expected output(s), computed from the candidate's (untouched) inputs
    outputs: Callable  # (*inputs) -> ((shape, dtype), ...) of the output(s), known without computing them
    builtin: Callable  # the engine's default implementation: the timing baseline
    make_inputs: Callable[[dict, torch.dtype, torch.device, torch.Generator], tuple]
    shapes: tuple[dict, ...]
    dtypes: tuple[torch.dtype, ...]
    tolerance: Callable[[torch.dtype], tuple[float, float]]  # dtype -> (atol, rtol): |out - ref| <= atol + rtol |ref|


def rounding_tolerance(roundings: int, summed_terms: int) -> Callable[[torch.dtype], tuple[float, float]]:
    """atol = rtol = `roundings` ulps of the output dtype (the roundings where a correct kernel and the reference may
    differ) plus sqrt(summed_terms) fp32 ulps (the typical error of an fp32 sum of that many terms, which a kernel
    may add up in another order). Inputs are scaled so that outputs are of order one, so atol only matters near 0."""
    def tolerance(dtype: torch.dtype) -> tuple[float, float]:
        tol = roundings * torch.finfo(dtype).eps + math.sqrt(summed_terms) * torch.finfo(torch.float32).eps
        return tol, tol
    return tolerance


def exact(dtype: torch.dtype) -> tuple[float, float]:
    return 0.0, 0.0


def _randn(shape, gen: torch.Generator, dtype: torch.dtype, device, scale: float = 1.0) -> torch.Tensor:
    # drawn in fp32 on the generator's device (so a seed gives the same values on every device), then cast
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(device=device, dtype=dtype)


def _randint(high: int, shape, gen: torch.Generator, device, low: int = 0) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, device=gen.device).to(device)


# linear ---------------------------------------------------------------------------------------------------------

def linear_inputs(shape: dict, dtype, device, gen):
    """x [batch, tokens, in], w [out, in] with std 1/sqrt(in) (outputs of order one), b [out] or None."""
    x = _randn((shape["batch"], shape["tokens"], shape["in"]), gen, dtype, device)
    w = _randn((shape["out"], shape["in"]), gen, dtype, device, shape["in"] ** -0.5)
    b = _randn((shape["out"],), gen, dtype, device) if shape.get("bias") else None
    return x, w, b


def linear_reference(x, w, b=None):
    """In fp64: exact for these sums, so the tolerance measures the candidate's own error."""
    return builtin.linear_torch(x.double(), w.double(), None if b is None else b.double())


def _linear(batch, tokens, n_in, n_out, bias=False):
    return dict(batch=batch, tokens=tokens, **{"in": n_in, "out": n_out}, bias=bias)


S, L = SMOLLM2, LLAMA3_8B
LINEAR_SHAPES = (
    _linear(1, 1, S["hidden"], (S["heads"] + 2 * S["kv_heads"]) * S["head_dim"]),  # decode, fused qkv
    _linear(1, K + 1, S["hidden"], 2 * S["intermediate"]),                          # verify, fused gate/up
    _linear(1, K + 1, S["hidden"], S["vocab"]),                                     # verify, LM head
    _linear(4, K + 1, S["hidden"], (S["heads"] + 2 * S["kv_heads"]) * S["head_dim"]),  # batch 4 (3..7: between 1
    # and 8, where a kernel may switch tiles; tests/test_verdicts.py has a kernel 1% off only there)
    _linear(8, K + 1, L["hidden"], (L["heads"] + 2 * L["kv_heads"]) * L["head_dim"], bias=True),  # batched qkv
    _linear(1, 1, L["intermediate"], L["hidden"]),                                  # decode, down projection
)
LINEAR = SlotContract(
    name="linear",
    signature="linear(x [..., in], w [out, in], b [out] | None) -> [..., out]",
    reference=linear_reference,
    outputs=lambda x, w, b=None: (((*x.shape[:-1], w.shape[0]), x.dtype),),
    builtin=builtin.linear_torch,
    make_inputs=linear_inputs,
    shapes=LINEAR_SHAPES,
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    # against the exact (fp64) reference: one ulp = two roundings of half an ulp (the output's, and a bias added
    # after it), and an fp32 accumulation over `in` products (so an fp32 candidate must not round its inputs to
    # TF32, nor a bf16 one accumulate in bf16). fp32: 1.4e-5 relative, so a 1% error fails everywhere; bf16: 0.79%
    # (+ the same atol), so a 1% error fails wherever |out| > 3.6 (3 in 10,000 elements of outputs of order one)
    tolerance=rounding_tolerance(1, max(s["in"] for s in LINEAR_SHAPES)),
)


# rmsnorm --------------------------------------------------------------------------------------------------------

def rmsnorm_inputs(shape: dict, dtype, device, gen):
    """x [*lead, d], w [d] near one, eps as in the models' configs. With `fused_width`, x is what the engine norms
    per head: the query part of a fused qkv projection [*lead[:-1], fused_width], viewed as heads (not contiguous)."""
    lead, d = shape["lead"], shape["d"]
    if shape.get("fused_width"):
        qkv = _randn((*lead[:-1], shape["fused_width"]), gen, dtype, device)
        x = qkv[..., : lead[-1] * d].unflatten(-1, (lead[-1], d))
    else:
        x = _randn((*lead, d), gen, dtype, device)
    w = (1.0 + _randn((shape["d"],), gen, torch.float32, device, 0.1)).to(dtype)
    return x, w, shape.get("eps", 1e-5)


RMSNORM_SHAPES = (
    dict(lead=[1, 1], d=S["hidden"]),                                      # decode
    dict(lead=[8, K + 1], d=L["hidden"]),                                  # batched verify
    dict(lead=[1, K + 1, QWEN3_8B["heads"]], d=QWEN3_8B["head_dim"], eps=1e-6,  # per-head q-norm (Qwen3)
         fused_width=(QWEN3_8B["heads"] + 2 * QWEN3_8B["kv_heads"]) * QWEN3_8B["head_dim"]),
)
RMSNORM = SlotContract(
    name="rmsnorm",
    signature="rmsnorm(x [..., d], w [d], eps: float) -> [..., d]  (normalize in fp32, cast to x's dtype, scale by w)",
    reference=builtin.rmsnorm_torch,  # HF numerics: the cast before the scale is part of the slot's meaning
    outputs=lambda x, w, eps: ((tuple(x.shape), x.dtype),),
    builtin=builtin.rmsnorm_torch,
    make_inputs=rmsnorm_inputs,
    shapes=RMSNORM_SHAPES,
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    # two roundings in the reference (the cast, then the scale) that a fused kernel may do as one; the mean square
    # summed over d in another order
    tolerance=rounding_tolerance(2, max(s["d"] for s in RMSNORM_SHAPES)),
)


# attention ------------------------------------------------------------------------------------------------------

def attention_inputs(shape: dict, dtype, device, gen):
    """q [B, Hkv, rep*T, D], k/v caches [B, Hkv, S, D] and the engine's mask [B, 1, rep*T, S]: row b has a random
    number of cached tokens before its T new ones; query t sees the keys at positions <= its own (and, with a
    window, > position - window). Cache slots past a row's length hold random values, as stale slots do."""
    B, H, rep, T, D, S = (shape[n] for n in ("batch", "kv_heads", "rep", "tokens", "head_dim", "cache"))
    q = _randn((B, H, rep * T, D), gen, dtype, device)
    k = _randn((B, H, S, D), gen, dtype, device)
    v = _randn((B, H, S, D), gen, dtype, device)
    past = _randint(S - T + 1, (B,), gen, device)  # cached tokens per row, 0 .. S - T
    positions = past[:, None] + torch.arange(T, device=device)[None]  # [B, T]
    keys = torch.arange(S, device=device)
    visible = keys[None, None, :] <= positions[:, :, None]  # [B, T, S]
    if shape.get("window"):
        visible &= keys[None, None, :] > positions[:, :, None] - shape["window"]
    # query row r = j * T + t (head j of the group, token t), as the engine stacks them
    mask = visible[:, None, None].expand(B, 1, rep, T, S).reshape(B, 1, rep * T, S)
    return q, k, v, mask


def attention_reference(q, k, v, mask):
    return builtin.attention_math(q.float(), k.float(), v.float(), mask)


def _attention(model, batch, tokens, cache, window=None):
    return dict(batch=batch, kv_heads=model["kv_heads"], rep=model["heads"] // model["kv_heads"], tokens=tokens,
                head_dim=model["head_dim"], cache=cache, window=window)


M = MISTRAL_7B
ATTENTION_SHAPES = (
    _attention(S, 1, 1, 512),                                  # decode
    _attention(S, 1, K + 1, 512),                              # verify
    _attention(L, 4, K + 1, 2048),                             # batched verify, GQA, ragged rows
    _attention(M, 1, K + 1, 2 * M["sliding_window"], M["sliding_window"]),  # sliding window
)
ATTENTION = SlotContract(
    name="attention",
    signature=("attention(q [B, Hkv, rep*T, D], k [B, Hkv, S, D], v [B, Hkv, S, D], mask bool [B, 1, rep*T, S]) "
               "-> like q  (GQA: the rep query heads of a kv head stacked along the query axis; mask True = attend)"),
    reference=attention_reference,
    outputs=lambda q, k, v, mask: ((tuple(q.shape), q.dtype),),
    builtin=builtin.attention_math,
    make_inputs=attention_inputs,
    shapes=ATTENTION_SHAPES,
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    # the probabilities rounded to the dtype before the weighted sum (as the built-in and flash kernels do) and the
    # output's rounding; softmax and weighted sums over the cache in another order
    tolerance=rounding_tolerance(2, max(s["cache"] for s in ATTENTION_SHAPES)),
)


# accept ---------------------------------------------------------------------------------------------------------

def accept_inputs(shape: dict, dtype, device, gen):
    """logits [B, k+1, V] with a unique argmax per position (so every exact kernel agrees); drafts [B, k] that
    match the argmax for a random prefix then differ; valid [B] in 0..k, so some rows have fewer valid drafts than
    matching ones (a kernel must stop at `valid` too)."""
    B, k, V = shape["batch"], shape["k"], shape["vocab"]
    logits = _randn((B, k + 1, V), gen, torch.float32, device)
    target = _randint(V, (B, k + 1), gen, device)
    logits.scatter_(-1, target[..., None], logits.amax(-1, keepdim=True) + 1.0)
    matching = _randint(k + 1, (B,), gen, device)  # leading drafts that equal the target's choice
    wrong = (target[:, :k] + _randint(V - 1, (B, k), gen, device, low=1)) % V  # anything but the argmax
    drafts = torch.where(torch.arange(k, device=device)[None] < matching[:, None], target[:, :k], wrong)
    valid = _randint(k + 1, (B,), gen, device)
    return drafts, valid, logits.to(dtype)


ACCEPT = SlotContract(
    name="accept",
    signature=("accept(drafts int64 [B, k], valid int64 [B], logits [B, k+1, V]) -> (n_accepted int64 [B], "
               "tokens int64 [B, k+1])  (greedy verification; the row emits tokens[:, :n_accepted + 1])"),
    reference=builtin.accept_torch,
    outputs=lambda drafts, valid, logits: (((drafts.shape[0],), torch.int64),
                                           ((drafts.shape[0], drafts.shape[1] + 1), torch.int64)),
    builtin=builtin.accept_torch,
    make_inputs=accept_inputs,
    shapes=(
        dict(batch=1, k=K, vocab=S["vocab"]),
        dict(batch=8, k=K, vocab=S["vocab"]),
        dict(batch=32, k=K, vocab=L["vocab"]),
    ),
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    tolerance=exact,  # integers: token ids and counts match exactly
)

CONTRACTS: dict[str, SlotContract] = {c.name: c for c in (LINEAR, RMSNORM, ATTENTION, ACCEPT)}
