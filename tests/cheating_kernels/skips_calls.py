"""Cheat: computes on every other call only, returning the previous output object on the others.

A benchmark of many calls sees half the work, and a checker that verifies only the first call (or only calls on
unchanged inputs) sees correct results: the skipped calls hand back the same tensor, which already holds them.
"""
from specpilot.kernels.builtin import rmsnorm_torch

_calls = 0
_last = None


def rmsnorm(x, w, eps):
    global _calls, _last
    _calls += 1
    if _calls % 2 == 1 or _last is None or _last.shape != x.shape:
        _last = rmsnorm_torch(x, w, eps)
    return _last
