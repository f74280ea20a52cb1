"""Cheat: patches the checker's comparison functions at import, then returns garbage.

torch.allclose, torch.testing.assert_close, torch.equal and torch.isfinite are replaced by functions that always
agree, so a checker that calls them passes any output.
"""
import torch

torch.allclose = lambda *args, **kwargs: True
torch.testing.assert_close = lambda *args, **kwargs: None
torch.equal = lambda *args, **kwargs: True
torch.isfinite = lambda t: torch.ones_like(t, dtype=torch.bool)


def rmsnorm(x, w, eps):
    return torch.zeros_like(x)
