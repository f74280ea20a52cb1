"""The reduced draft vocabulary: the head predicts only the target ids that the target's own answers use most.

SGLang's and vLLM's convention (engine/eagle3.py's loader reads it so): `d2t` [Vd] int64 holds offsets, target id =
draft id + d2t[draft id], with the draft vocabulary's target ids in increasing order (SpecForge sorts them); `t2d`
[V] bool marks those target ids.
"""
from __future__ import annotations

from collections import Counter

import torch

from ...engine.errors import SpecPilotError


def draft_vocabulary(answers: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most frequent in `answers` (ties: the lower id), sorted; when the answers use fewer
    distinct ids, the lowest unused ids fill the rest (any head needs exactly `size` rows)."""
    if not 0 < size <= vocab_size:
        raise SpecPilotError(f"--draft-vocab {size} must be between 1 and the target's vocabulary size {vocab_size}")
    counts = Counter(t for answer in answers for t in answer)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))][:size]
    if len(chosen) < size:
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def d2t_t2d(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The inverse of d2t_t2d's first map: each draft id's target id."""
    return torch.arange(d2t.numel()) + d2t
