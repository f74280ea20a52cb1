"""Kernel slots: named points where the engine calls a kernel, and the implementations a recipe can pick.

A recipe names one implementation per slot: `builtin:NAME` (registered below) or the path of a candidate source file
that defines a function named after the slot (`def linear(x, w, b): ...`). Built-ins that need Triton are registered
as "module:function" and imported only when picked, so that importing the engine never imports Triton (and
TRITON_INTERPRET can still be set before a kernel module is first imported). `cross_compile` compiles the kernels
for the H200 on a machine without a GPU (what the interpreter cannot check).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Callable, NamedTuple

from . import builtin

SLOTS = ("linear", "rmsnorm", "attention", "accept")

# slot -> {name: callable or "module:function" relative to this package}
IMPLEMENTATIONS: dict[str, dict[str, Callable | str]] = {
    "linear": {"builtin:torch": builtin.linear_torch, "builtin:triton": ".triton_linear:linear",
               "builtin:lossless12": ".lossless12_linear:linear"},
    "rmsnorm": {"builtin:torch": builtin.rmsnorm_torch, "builtin:triton": ".triton_rmsnorm:rmsnorm"},
    "attention": {"builtin:sdpa": builtin.attention_sdpa, "builtin:math": builtin.attention_math,
                  "builtin:triton": ".triton_attention:attention"},
    "accept": {"builtin:torch": builtin.accept_torch, "builtin:triton": ".triton_accept:accept"},
}
DEFAULTS = dict(builtin.DEFAULTS)
# The fused layer (recipe `layer: fused`, triton_fused_layer.py) runs steps of at most this many tokens (B * T);
# larger steps are tensor-core GEMM work and run the modular layer. Here so that it is known without importing Triton.
# Past 16 its tensor-core path runs tiles of 16 tokens side by side (each reading the weight tile, from L2 after the
# first). 32, on the H100 with PDL on that path: at the layer every 32-token shape beats the modular layer (4 x 8
# 1.04x-1.05x, 8 x 4 1.07x, 16 x 2 1.14x; 48-64 tokens lose), and end to end, with the batch controller pricing
# its kinds at mid-decode and timing the kind below its choice, the head's chat B = 16 ran 1.13x our AR against 1.09x
# at 24 (one draft a row fused, 1.09 ms in the loop, against two drafts a row at 1.38) and chat B = 8 level within
# the runs' noise (the same 16-token steps chosen at both limits); before those two, code B = 8 1.65x-1.66x against
# 1.62x-1.63x
# (docs/benchmarks/2026-12-07-forty-second-lease.md, A and C; forty-third, B). (24 before: 4 x 8 lost, 38.1
# against 36.7 µs, thirty-second lease, before PDL.) SPECPILOT_FUSED_MAX_TOKENS sets the limit for a run.
FUSED_LAYER_MAX_TOKENS = int(os.environ.get("SPECPILOT_FUSED_MAX_TOKENS", "32"))
# Its steps of up to this many tokens run a program per token on the FMA units (the only path that reads 12-bit
# weights, `weights.format: lossless12`); the reasons for 6 are at FMA_MAX_TOKENS in triton_fused_layer.py.
FUSED_LAYER_FMA_MAX_TOKENS = int(os.environ.get("SPECPILOT_FMA_MAX_TOKENS", "6"))


class Kernels(NamedTuple):
    linear: Callable
    rmsnorm: Callable
    attention: Callable
    accept: Callable


def is_candidate_path(name: str) -> bool:
    return not name.startswith("builtin:") and name.endswith(".py")


def check_choice(slot: str, name: str) -> str | None:
    """Why `name` cannot implement `slot`, or None when it can (the candidate file is only looked at, not run)."""
    if slot not in IMPLEMENTATIONS:
        return f"unknown kernel slot (slots: {', '.join(SLOTS)})"
    if is_candidate_path(name):
        return None if Path(name).is_file() else f"candidate source {name!r} does not exist"
    if name not in IMPLEMENTATIONS[slot]:
        return (f"unknown implementation {name!r} (available: {', '.join(IMPLEMENTATIONS[slot])}, "
                f"or the path of a .py file defining {slot}())")
    return None


def load_candidate(slot: str, path: str | Path) -> Callable:
    """The function `slot` defined by the candidate source file at `path`."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"specpilot_candidate_{slot}_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, slot, None)
    if not callable(fn):
        raise KeyError(f"candidate {path} defines no function {slot}()")
    return fn


def implementation(slot: str, name: str) -> Callable:
    why = check_choice(slot, name)
    if why:
        raise KeyError(f"kernel slot {slot!r}: {why}")
    if is_candidate_path(name):
        return load_candidate(slot, name)
    impl = IMPLEMENTATIONS[slot][name]
    if isinstance(impl, str):
        module, attr = impl.split(":")
        impl = getattr(importlib.import_module(module, __name__), attr)
    return impl


def resolve(choice: dict[str, str] | None = None) -> Kernels:
    """The implementation per slot; `choice` maps slot -> name and may leave slots at their defaults."""
    names = {**DEFAULTS, **(choice or {})}
    for slot in names:
        if slot not in IMPLEMENTATIONS:
            raise KeyError(f"unknown kernel slot {slot!r} (slots: {', '.join(SLOTS)})")
    return Kernels(**{slot: implementation(slot, names[slot]) for slot in SLOTS})
