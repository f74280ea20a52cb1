"""Weight formats a recipe can ask for besides the target's own (`weights.format`).

`lossless12` re-encodes every linear weight of the target (q/k/v, o, gate/up, down, LM head) in the 12-bit format of
kernels/lossless12_format.py. The model keeps its bf16 parameters (the embedding lookup and other engines sharing the
loaded target use them); the linear kernel slot is handed the packed copy of the weight it is called with, looked up
by the parameter's identity, so model code stays format-agnostic.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..kernels.lossless12_format import Packed12Linear, to_linear_planes
from .errors import SpecPilotError
from .model import Transformer


def lossless12_weights(model: Transformer) -> dict[int, Packed12Linear]:
    """id(parameter) -> its 12-bit planes on the model's device; encoded once per loaded model."""
    cached = getattr(model, "_lossless12", None)
    if cached is not None:
        return cached
    if model.dtype != torch.bfloat16:
        raise SpecPilotError(f"weights.format 'lossless12' encodes bf16 weights, but the target is loaded in "
                             f"{model.dtype}: load it with --dtype bf16")
    params = [model.lm_head] + [w for blk in model.layers for w in (blk.wqkv, blk.wo, blk.w13, blk.w2)]
    packed = {id(w): to_linear_planes(w.detach(), model.device) for w in params}
    model._lossless12 = packed
    return packed


def bind_weights(linear: Callable, packed: dict[int, Packed12Linear]) -> Callable:
    """The linear slot called with each parameter's packed copy instead of the parameter itself."""
    def linear_packed(x, w, b=None):
        return linear(x, packed.get(id(w), w), b)
    return linear_packed
