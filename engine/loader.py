"""Find a model's weights and tokenizer and build our Transformer from them, offline.

A target is an alias (`smollm2-135m`), a GGUF file, an HF model directory (safetensors), a hub id already in the
local HF cache, or a synthetic target (`synthetic:llama-3.1-8b`: a published architecture with random weights drawn on
the device, engine/synthetic.py). GGUF files are dequantized by transformers' GGUF loader once and kept as a safetensors directory in
the SpecPilot cache, so later loads take seconds instead of re-parsing and re-dequantizing the file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import packaged, synthetic
from .errors import SpecPilotError
from .model import SUPPORTED_ARCHITECTURES, Transformer, from_hf_state_dict

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download at run time
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE", Path.home() / ".cache" / "specpilot"))


# The packaged target and its packaged EAGLE-3 head (trained by `specpilot train-drafter`: docs/TRAINING.md)
PACKAGED_HEAD = Path(__file__).parent / "data" / "heads" / "smollm2-135m-eagle3"
ALIASES = {"smollm2-135m": packaged.path, "smollm2-135m-eagle3": lambda: PACKAGED_HEAD}
_PACKAGED_GGUF_CHECKED: dict = {}  # (path, size, mtime) -> whether the file is the packaged GGUF


def packaged_heads(target: str) -> list[str]:
    """The drafter heads that ship for `target` (by alias): smollm2-135m's EAGLE-3 head for the packaged target,
    named by its alias or as its GGUF file anywhere (a staged copy is recognized by its sha256)."""
    if target == "smollm2-135m":
        return ["smollm2-135m-eagle3"]
    path = Path(target).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return []
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _PACKAGED_GGUF_CHECKED:
        _PACKAGED_GGUF_CHECKED[key] = packaged.sha256_of(path) == packaged.GGUF_SHA256
    return ["smollm2-135m-eagle3"] if _PACKAGED_GGUF_CHECKED[key] else []


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise SpecPilotError(f"unknown dtype {name!r} (choose from fp32, bf16, fp16)")
    return DTYPES[name]


def resolve(target: str) -> Path:
    """Path of a GGUF file or a model directory (a hub id's cached snapshot included; a synthetic target's directory,
    made once in the cache: engine/synthetic.py)."""
    if target in ALIASES:
        return ALIASES[target]()
    if synthetic.is_synthetic(target):
        return synthetic.materialize(target, cache_root(), source_dir)
    path = Path(target).expanduser()
    if path.exists():
        return path
    if target.count("/") == 1 and not target.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:  # the cached snapshot's directory: from here on a hub id is just a model directory
            return Path(snapshot_download(target, local_files_only=True))
        except (LocalEntryNotFoundError, ValueError, OSError):
            pass
    raise SpecPilotError(f"model not found: {target!r} is not a file, a directory, an alias "
                         f"({', '.join(ALIASES)}), a synthetic target "
                         f"({', '.join(synthetic.PREFIX + n for n in synthetic.CONFIGS)}) or a hub id in the local cache")


def _gguf_as_directory(gguf: Path) -> Path:
    """Dequantize a GGUF once into a cached HF directory (config, tokenizer, fp32 safetensors)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers raises many types for a truncated or foreign file
        raise SpecPilotError(f"could not read GGUF file {gguf}: {type(e).__name__}: {e}") from e
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # transformers refuses save_pretrained on a GGUF-loaded model; the dequantized weights are plain tensors.
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def source_dir(target: str) -> Path:
    """Where a target's config, weights and tokenizer live, without loading it: a model directory (a GGUF is
    dequantized into one once; a hub id is its cached snapshot)."""
    where = resolve(target)
    if where.is_file():
        if where.suffix != ".gguf":
            raise SpecPilotError(f"unsupported model file {where}: expected a .gguf file or a model directory")
        where = _gguf_as_directory(where)
    if not (where / "config.json").is_file():
        raise SpecPilotError(f"model directory {where} has no config.json")
    return where


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object
    hf_config: object
    source: str
    eos_token_ids: tuple[int, ...] = ()


def _eos_ids(tokenizer, hf_model) -> tuple[int, ...]:
    """Every id generation stops on, as HF's generate does: the generation config's list plus the tokenizer's EOS
    (chat models often end a turn with a token only the generation config names, e.g. Llama 3's <|eot_id|>)."""
    ids: list[int] = []
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        for i in (eos if isinstance(eos, (list, tuple)) else [eos]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def load(target: str, dtype: str | torch.dtype = "fp32", device: str = "cpu") -> LoadedModel:
    """Load a target as our Transformer plus its tokenizer. Errors name the cause."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = parse_dtype(dtype)
    check_device(device)
    where = source_dir(target)
    try:
        hf_config = AutoConfig.from_pretrained(str(where))
    except Exception as e:
        raise SpecPilotError(f"could not read the model config of {target}: {e}") from e
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise SpecPilotError(f"unsupported architecture {hf_config.model_type!r} in {target} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    seed = synthetic.synthetic_seed(where / "config.json")
    hf = None
    if seed is None:
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32)
        except Exception as e:
            raise SpecPilotError(f"could not load weights of {target}: {type(e).__name__}: {e}") from e
    tokenizer = None
    if any((where / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(where))
        except Exception as e:
            raise SpecPilotError(f"could not load the tokenizer of {target}: {type(e).__name__}: {e}") from e
    try:
        if seed is not None:  # random weights drawn on the device; no end-of-sequence id (engine/synthetic.py)
            return LoadedModel(synthetic.random_transformer(hf_config, dtype, device, seed), tokenizer, hf_config,
                               str(where), ())
        model = from_hf_state_dict(hf_config, hf.state_dict(), dtype).to(device)
    except ValueError as e:
        raise SpecPilotError(f"cannot run {target}: {e}") from e
    return LoadedModel(model, tokenizer, hf_config, str(where), _eos_ids(tokenizer, hf))


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecPilotError(f"device {device!r} was asked for but CUDA is not available on this machine")
    if not (device == "cpu" or device.startswith("cuda")):
        raise SpecPilotError(f"unknown device {device!r} (use cpu or cuda)")
