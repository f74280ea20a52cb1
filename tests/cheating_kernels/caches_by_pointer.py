"""Cheat: caches results keyed on the inputs' addresses and shapes.

A benchmark that calls the kernel again and again on the same buffers gets the first answer back at no cost, and a
checker that compares each call with a reference of the same (unchanged) inputs sees a correct result. Fresh
values written into the same buffers are not noticed.
"""
from specpilot.kernels.builtin import rmsnorm_torch

_cache = {}


def rmsnorm(x, w, eps):
    key = (x.data_ptr(), w.data_ptr(), tuple(x.shape), eps)
    if key not in _cache:
        _cache[key] = rmsnorm_torch(x, w, eps)
    return _cache[key].clone()  # a new tensor each call, so the answer does not look reused
