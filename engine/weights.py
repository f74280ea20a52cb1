"""Weight formats a recipe can ask for besides the target's own (`weights.format`).

`lossless12` re-encodes every linear weight of the target (q/k/v, o, gate/up, down, LM head) in the 12-bit format of
kernels/lossless12_format.py. The model keeps its bf16 parameters (the embedding lookup and other engines sharing the
loaded target use them); the linear kernel slot is handed the packed copy of the weight it is called with, looked up
by the parameter's storage inside one custom op (`specpilot::linear12`), so model code stays format-agnostic and
one compiled layer serves every matrix.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.lossless12_format import Packed12Linear, to_linear_planes
from .errors import SpecPilotError
from .model import Transformer


def lossless12_weights(model: Transformer) -> dict[int, Packed12Linear]:
    """The bf16 parameter's data_ptr() -> its 12-bit planes on the model's device; encoded once per loaded model."""
    cached = getattr(model, "_lossless12", None)
    if cached is not None:
        return cached
    if model.dtype != torch.bfloat16:
        raise SpecPilotError(f"weights.format 'lossless12' encodes bf16 weights, but the target is loaded in "
                             f"{model.dtype}: load it with --dtype bf16")
    params = [model.lm_head] + [w for blk in model.layers for w in (blk.wqkv, blk.wo, blk.w13, blk.w2)]
    packed = {w.data_ptr(): to_linear_planes(w.detach(), model.device) for w in params}
    model._lossless12 = packed
    return packed


# Each bind_weights call: (the linear slot, its packed weights by the bf16 parameter's data_ptr()). A list, never
# shrunk: a binding's index is baked into the layer functions compiled with it.
_BINDINGS: list[tuple[Callable, dict[int, Packed12Linear]]] = []


@torch.library.custom_op("specpilot::linear12", mutates_args=())
def _linear12(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, binding: int) -> torch.Tensor:
    """The binding's linear slot called with w's packed copy (a weight without one: F.linear). One opaque op to
    torch.compile: which planes and which window's scales a matrix has is looked up here, when it runs, not traced,
    so the one compiled layer serves every layer's matrices. (Traced, the lookup by the parameter and the windows'
    Python floats specialized the layer per matrix: SmolLM2's layers hit torch's limit of 64 recompilations;
    docs/benchmarks/2026-11-29-eighth-lease.md, K. Uncompiled instead, a 12-bit AR step at 8B ran 0.76x the bf16
    one: seventeenth lease, D.)"""
    linear, packed = _BINDINGS[binding]
    planes = packed.get(w.data_ptr())
    return F.linear(x, w, b) if planes is None else linear(x, planes, b)


@_linear12.register_fake
def _(x, w, b, binding):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def bind_weights(linear: Callable, packed: dict[int, Packed12Linear]) -> Callable:
    """The linear slot called with each parameter's packed copy instead of the parameter itself (through the op
    above, whatever compiles it)."""
    _BINDINGS.append((linear, packed))
    binding = len(_BINDINGS) - 1

    def linear_packed(x, w, b=None):
        return torch.ops.specpilot.linear12(x, w, b, binding)
    return linear_packed
