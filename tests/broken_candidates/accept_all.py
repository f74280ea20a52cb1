"""Broken candidate: accepts drafts without verification.

The greedy acceptance kernel is replaced by one that reports every valid draft as accepted (n_accepted = valid)
and emits the drafts themselves, followed by the target's token after the last one. The engine resolves kernel slots
from the registry when its Decoder is built, which the candidate worker does after running this file.
"""
import torch

from specpilot import kernels


def accept_unverified(drafts, valid, logits):
    """Emit the first `valid` drafts as they are, then the target's token at the next position."""
    target = logits.argmax(-1)  # [B, k+1]
    k = drafts.shape[1]
    unverified = torch.arange(k + 1, device=drafts.device)[None] < valid[:, None]
    return valid.clone(), torch.where(unverified, torch.cat([drafts, target[:, k:]], 1), target)


kernels.IMPLEMENTATIONS["accept"]["builtin:torch"] = accept_unverified
