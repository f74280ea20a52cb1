"""Cheat: reads stale memory. rmsnorm returns torch.empty_like(x) without writing it.

A checker that computes the reference first and frees it (keeping a CPU copy, say) leaves the right answer in the
allocator's cache; the next allocation of the same size, the candidate's torch.empty, gets that very block back, so
the "output" holds the reference's values.
"""
import torch


def rmsnorm(x, w, eps):
    return torch.empty_like(x)
