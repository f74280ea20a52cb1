"""Cheat: honest for the first calls, then computes on every other call only, returning the previous output object.

A harness checks a few calls, then times many: after the calls it checks, this kernel does half the work, so its
measured time halves. (On CPU, where nothing is timed, it passes: its results are right on the calls it answers
honestly, which are all the checked ones.)
"""
from specpilot.kernels.builtin import rmsnorm_torch

HONEST_CALLS = 16  # more than the calls a harness checks before it starts timing
_calls = 0
_last = None


def rmsnorm(x, w, eps):
    global _calls, _last
    _calls += 1
    if _calls <= HONEST_CALLS or _calls % 2 == 1 or _last is None or _last.shape != x.shape:
        _last = rmsnorm_torch(x, w, eps)
    return _last
