"""argparse `type=` validators shared by every `specpilot` subcommand, so that a number is checked the same way
wherever it is typed and a bad one is rejected by the parser, before anything slow (a model load) starts.

Each raises argparse.ArgumentTypeError, which argparse reports as `argument --flag: <message>`; cli.main turns that
into one line on stderr and exit code 2, like every other bad input. `check` applies a validator to a value that
did not come through argparse (run_bench's callers build their arguments in code).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..engine.errors import SpecPilotError


def _int(text) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {str(text)!r}") from None


def _float(text) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # nan and inf pass float() but are no budget, timeout or temperature
        raise argparse.ArgumentTypeError(f"must be a finite number, got {str(text)!r}")
    return value


def positive_int(text) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {str(text)!r}")
    return value


def non_negative_int(text) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {str(text)!r}")
    return value


def positive_float(text) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {str(text)!r}")
    return value


def non_negative_float(text) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {str(text)!r}")
    return value


def probability(text) -> float:
    """A nucleus (top-p) mass: in (0, 1]; 0 would keep no token at all."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {str(text)!r}")
    return value


def positive_int_list(text) -> list[int]:
    """"1,8,32" -> [1, 8, 32]: comma-separated positive integers, repeats dropped, order kept."""
    parts = [p for p in str(text).split(",") if p.strip()]
    try:
        values = [positive_int(p) for p in parts]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {str(text)!r}")
    return list(dict.fromkeys(values))


def acceptance_profile(text) -> list[float]:
    """"0.8,0.6,0.4" -> [0.8, 0.6, 0.4]: a per-position acceptance profile, each a share between 0 and 1 (the replay
    drafter checks the rest: at most non-increasing, one a draft)."""
    try:
        values = [_float(p) for p in str(text).split(",")]
    except argparse.ArgumentTypeError:
        values = []
    if not values or not all(0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated shares between 0 and 1, got {str(text)!r}")
    return values


def replay_profile(text) -> dict:
    """A drafter's acceptance to replay: {"acceptance": [a_1, ...], "ranks": [[...], ...]} from "A1,A2,..." (no
    ranks), or from a JSON file holding those keys (`ranks`: per depth, the chances that the target's token is the
    drafter's 2nd, 3rd, ... candidate), at its top level or as the head_ranks experiment writes them (under
    results.pooled), or a packaged head's name: the profile measured for it and shipped beside it
    (replay_profile.json). The replay drafter checks the values' rules."""
    path = Path(str(text)) if Path(str(text)).is_file() else shipped_profile(str(text))
    if path is None:
        try:
            return {"acceptance": acceptance_profile(text), "ranks": []}
        except argparse.ArgumentTypeError:
            heads = [name for name in _head_aliases() if shipped_profile(name)]
            raise argparse.ArgumentTypeError(f"must be comma-separated shares between 0 and 1, a JSON file or a "
                                             f"packaged head's name ({', '.join(heads)}), got {str(text)!r}") from None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text}: not a JSON file ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("results"), dict):
        data = data["results"].get("pooled", data)
    if not isinstance(data, dict) or not isinstance(data.get("acceptance"), list):
        raise argparse.ArgumentTypeError(f"{text}: no \"acceptance\" list (and optional \"ranks\") in it")
    ranks = data.get("ranks") or []
    if not isinstance(ranks, list) or not all(isinstance(r, list) for r in ranks):
        raise argparse.ArgumentTypeError(f"{text}: \"ranks\" must be a list of lists (one a depth)")
    return {"acceptance": acceptance_profile(",".join(map(str, data["acceptance"]))), "ranks": ranks}


def _head_aliases() -> list[str]:
    from ..engine.loader import ALIASES

    return [name for name in ALIASES if name.endswith("-eagle3")]


def shipped_profile(name: str) -> Path | None:
    """The replay profile measured for a packaged head and shipped beside it (replay_profile.json), or None."""
    if name not in _head_aliases():
        return None
    from ..engine.loader import ALIASES

    path = Path(ALIASES[name]()) / "replay_profile.json"
    return path if path.is_file() else None


def check(validator, flag: str, value):
    """`validator(value)` for a value set in code, its complaint as argparse would word it, as a SpecPilotError."""
    try:
        return validator(value)
    except argparse.ArgumentTypeError as e:
        raise SpecPilotError(f"argument {flag}: {e}") from None


# --target's help, the same for every command that loads a target (engine/loader.py resolves it; engine/synthetic.py
# holds the synthetic architectures, which a test keeps this list in step with)
SYNTHETIC_NAMES = ("llama-3.1-8b", "qwen3-8b", "llama-3.2-1b")
TARGET_HELP = ("alias (smollm2-135m), GGUF file, model directory, cached hub id, or synthetic:NAME (a published "
               f"architecture with random weights, nothing downloaded: {', '.join(SYNTHETIC_NAMES)})")


def add_target_argument(parser, default: str | None = "smollm2-135m", **kwargs) -> None:
    """`--target` with the shared help."""
    parser.add_argument("--target", default=default, help=TARGET_HELP, **kwargs)


DEVICE_HELP = "cpu or cuda (default: cuda when available)"
DTYPE_HELP = "fp32, bf16 or fp16 (default: bf16 on cuda, fp32 on cpu)"


def add_device_arguments(parser, dtype_help: str | None = DTYPE_HELP) -> None:
    """`--device`, and `--dtype` (with this help; None: no --dtype), the same for every command that loads a model."""
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    if dtype_help is not None:
        parser.add_argument("--dtype", default=None, help=dtype_help)
