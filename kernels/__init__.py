"""Kernel slots: named points where the engine calls a kernel, and the implementations a recipe can pick."""
from __future__ import annotations

from typing import Callable, NamedTuple

from .builtin import DEFAULTS, IMPLEMENTATIONS

SLOTS = tuple(DEFAULTS)


class Kernels(NamedTuple):
    linear: Callable
    rmsnorm: Callable
    attention: Callable
    accept: Callable


def resolve(choice: dict[str, str] | None = None) -> Kernels:
    """The implementation per slot; `choice` maps slot -> name and may leave slots at their defaults."""
    names = {**DEFAULTS, **(choice or {})}
    for slot, name in names.items():
        if slot not in IMPLEMENTATIONS:
            raise KeyError(f"unknown kernel slot {slot!r} (slots: {', '.join(SLOTS)})")
        if name not in IMPLEMENTATIONS[slot]:
            raise KeyError(f"unknown implementation {name!r} for slot {slot!r} "
                           f"(available: {', '.join(IMPLEMENTATIONS[slot])})")
    return Kernels(**{slot: IMPLEMENTATIONS[slot][names[slot]] for slot in SLOTS})
