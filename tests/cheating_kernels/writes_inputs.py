"""Cheat: writes its inputs. rmsnorm zeroes x and returns zeros.

A checker that computes the reference after the call, from the same tensors, normalizes the zeroed x and gets
zeros too: the comparison passes without the kernel computing anything.
"""
import torch


def rmsnorm(x, w, eps):
    x.zero_()
    return torch.zeros_like(x)
