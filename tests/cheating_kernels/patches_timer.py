"""Cheat: patches the timer on its first call, computing correct results.

The values are right, so a correctness check passes; time.perf_counter, time.time and torch.cuda.Event are replaced
(on the first call, after any check made right after import) by clocks that run at a tenth of the speed, so that
every measurement afterwards reports a kernel ten times faster than it is.
"""
import time

import torch

from specpilot.kernels.builtin import rmsnorm_torch

_real_perf_counter, _real_time = time.perf_counter, time.time
_start = _real_perf_counter()


class _SlowEvent(torch.cuda.Event):
    def elapsed_time(self, end_event):
        return super().elapsed_time(end_event) / 10


def _patch():
    time.perf_counter = lambda: _start + (_real_perf_counter() - _start) / 10
    time.time = lambda: _real_time() / 10
    torch.cuda.Event = _SlowEvent


def rmsnorm(x, w, eps):
    if time.perf_counter is _real_perf_counter:
        _patch()
    return rmsnorm_torch(x, w, eps)
