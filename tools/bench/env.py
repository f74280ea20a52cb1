"""What a benchmark ran on: package versions, device, driver, git commit, command line, date.

Every probe degrades to null rather than failing: a missing triton or git must not cost a benchmark its results.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the repository root is the specpilot package


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # not installed, or broken on this machine (triton without a GPU toolchain)
        return None


def _specpilot_version() -> str | None:
    try:
        return importlib.metadata.version("specpilot")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout on the path, not installed (the H200)
        from ... import __version__

        return __version__


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def git_commit() -> tuple[str | None, bool | None]:
    """HEAD of the package's repository, and whether tracked files differ from it."""
    commit = _run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"])
    if commit is None:
        return None, None
    status = _run(["git", "-C", str(PACKAGE_DIR), "status", "--porcelain", "--untracked-files=no"])
    return commit, bool(status)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_facts(device: torch.device) -> tuple[str, str | None]:
    """(device name, NVIDIA driver version or null)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        return name, driver.splitlines()[0] if driver else None
    return cpu_name(), None


def header(args, device: torch.device, dtype: str, workloads: list[str], batch_sizes: list[int],
           recipes: list | None = None) -> dict:
    """The run's settings and environment; `recipes` ([(system, Recipe)]) go in as `recipes` {system: recipe}, so
    that a results file says what each engine system ran (`stock` depends on the target)."""
    commit, dirty = git_commit()
    argv = getattr(args, "argv", None) or sys.argv[1:]  # cli.main stores the argv it parsed
    name, driver = device_facts(device)
    return {
        "specpilot": _specpilot_version(), "torch": torch.__version__, "triton": _version("triton"),
        "transformers": _version("transformers"), "device_name": name, "driver": driver,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "git_commit": commit, "git_dirty": dirty, "command": "specpilot " + shlex.join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "target": args.target, "dtype": dtype, "device": str(device), "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos, "workloads": workloads, "batch_sizes": batch_sizes, "repeats": args.repeats,
        "limit": args.limit, "cell_requests": getattr(args, "cell_requests", None),
        "waves": getattr(args, "waves", 1) or 1, "batching": getattr(args, "batching", "continuous"),
        "lead_in_s": getattr(args, "lead_in", None),
        "threads": torch.get_num_threads(),
        "recipes": {name: dataclasses.asdict(r) for name, r in recipes or []},
    }
