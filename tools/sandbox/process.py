"""Run untrusted candidate code in a child process that cannot take the caller down (docs/SANDBOX.md).

`run_python(code_or_module_args, payload, limits)` starts `python -c CODE` (a str) or `python -m MODULE ARGS...`
(a list) with: a new session (process group, SIGKILLed whole on timeout and after exit), rlimits set in preexec_fn
(address space or data segment, CPU seconds, no core files, a cap on file size), a fresh temporary directory as cwd
and HOME (removed afterwards), an allow-listed environment with anything named like a secret removed, a new network
namespace (`unshare --net`) unless limits.network, and, with limits.gpu, an flock on $SPECPILOT_CACHE/gpu.lock held
for the whole run. The payload is the child's stdin as JSON; the child's last stdout line must be JSON. Every child
behaviour (hang, signal, OOM, exception, garbage output) comes back as a SandboxResult; nothing is raised.

The pieces (`child_env`, `command`, `limiter`, `gpu_lock`) are public so that long-lived workers
(tools/sandbox/candidate_client.py) can be launched the same way.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

STDERR_TAIL = 2000
STDOUT_TAIL = 1 << 20  # only the last MiB of stdout is read back to find the last line
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.I)
ALLOWED = {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_CACHE"}
ALLOWED_PREFIXES = ("TRITON_", "TORCH", "SPECPILOT_")
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: refused at once, when no namespace is available
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}


@dataclass
class SandboxLimits:
    wall_s: float = 600.0
    memory_bytes: int | None = 8 << 30  # RLIMIT_AS; with gpu=True applied as RLIMIT_DATA (CUDA reserves huge VA)
    cpu_s: int | None = None            # RLIMIT_CPU (SIGXCPU, then SIGKILL, when exceeded)
    network: bool = False               # False: a new, empty network namespace where the OS allows it
    gpu: bool = False                   # True: hold the GPU lock for the duration of the child
    file_bytes: int | None = 4 << 30    # RLIMIT_FSIZE: also bounds the captured stdout/stderr files


@dataclass
class SandboxResult:
    ok: bool
    kind: str  # ok | timeout | crash | signal | oom | exception | bad_output
    returncode: int | None
    signal: str | None
    output: object
    stderr_tail: str
    seconds: float
    network_isolated: bool = False
    temp_dir: str = ""
    extra: dict = field(default_factory=dict)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE") or Path.home() / ".cache" / "specpilot")


@contextlib.contextmanager
def gpu_lock(enabled: bool = True):
    """An exclusive flock on cache_dir()/gpu.lock: one measurement on the GPU at a time, across processes and
    threads (each call opens its own file description, so flock excludes even within one process)."""
    if not enabled:
        yield
        return
    path = cache_dir() / "gpu.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=1)
def netns_available() -> bool:
    """Whether `unshare --net` works here (missing binary, or EPERM in unprivileged containers, means no)."""
    exe = shutil.which("unshare")
    if not exe:
        return False
    try:
        return subprocess.run([exe, "--net", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def child_env(home: str, network_isolated: bool = True, extra: dict | None = None) -> dict[str, str]:
    """The allow-listed environment; anything whose name matches KEY|TOKEN|SECRET|PASSWORD is dropped, even from
    `extra`."""
    src = {**os.environ, **(extra or {})}
    env = {k: v for k, v in src.items() if (k in ALLOWED or k.startswith(ALLOWED_PREFIXES)) and not SECRET.search(k)}
    env.update(HOME=home, TMPDIR=home, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if not network_isolated:
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
            env[k] = DEAD_PROXY
        env["NO_PROXY"] = env["no_proxy"] = ""
    return env


def command(argv: list[str], limits: SandboxLimits) -> tuple[list[str], bool]:
    """argv, prefixed with `unshare --net` when the network is to be cut and that works; (argv, isolated)."""
    if limits.network:
        return list(argv), False
    if netns_available():
        return [shutil.which("unshare"), "--net", *argv], True
    return list(argv), False


def limiter(limits: SandboxLimits):
    """A preexec_fn that sets the rlimits (runs in the child after fork, before exec)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limits.memory_bytes:
            which = resource.RLIMIT_DATA if limits.gpu else resource.RLIMIT_AS
            resource.setrlimit(which, (limits.memory_bytes, limits.memory_bytes))
        if limits.cpu_s:
            resource.setrlimit(resource.RLIMIT_CPU, (int(limits.cpu_s), int(limits.cpu_s) + 1))
        if limits.file_bytes:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    return apply


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - n, 0))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _classify(rc: int | None, timed_out: bool, stdout: str, stderr: str):
    """(kind, signal name, parsed output)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    try:
        output = json.loads(lines[-1]) if lines else None
        parsed = bool(lines)
    except ValueError:
        output, parsed = None, False
    sig = signal.Signals(-rc).name if rc is not None and rc < 0 and -rc in signal.Signals._value2member_map_ else None
    if timed_out or sig == "SIGXCPU":
        return "timeout", sig, output
    if rc != 0 and "MemoryError" in stderr[-500:]:
        return "oom", sig, output
    if rc is not None and rc < 0:
        if -rc in CRASH_SIGNALS:
            return "crash", sig, output
        return ("oom" if sig == "SIGKILL" else "signal"), sig, output  # a SIGKILL we did not send: the OOM killer
    if rc != 0:
        return "exception", sig, output
    return ("ok" if parsed else "bad_output"), sig, output


def run_python(code_or_module_args: str | list[str], payload: dict | None = None,
               limits: SandboxLimits | None = None, env: dict | None = None) -> SandboxResult:
    """Run `python -c CODE` (str) or `python -m MODULE ARGS...` (list) in the sandbox; never raises for anything
    the child does."""
    limits = limits or SandboxLimits()
    t0 = time.monotonic()
    if isinstance(code_or_module_args, str):
        py = [sys.executable, "-c", code_or_module_args]
    else:
        py = [sys.executable, "-m", *code_or_module_args]
    argv, isolated = command(py, limits)
    io = tempfile.TemporaryDirectory(prefix="specpilot-sandbox-io-")  # ours: stdin/stdout/stderr files
    work = tempfile.TemporaryDirectory(prefix="specpilot-sandbox-")    # the child's cwd and HOME
    iod = Path(io.name)
    rc, timed_out, launch_error = None, False, ""
    try:
        (iod / "stdin").write_text(json.dumps(payload if payload is not None else {}))
        with gpu_lock(limits.gpu), open(iod / "stdin", "rb") as fin, \
                open(iod / "stdout", "wb") as fout, open(iod / "stderr", "wb") as ferr:
            try:
                proc = subprocess.Popen(argv, cwd=work.name, env=child_env(work.name, isolated, env), stdin=fin,
                                        stdout=fout, stderr=ferr, start_new_session=True,
                                        preexec_fn=limiter(limits), close_fds=True)
            except (OSError, subprocess.SubprocessError) as e:
                launch_error = f"sandbox: could not start the child: {e!r}"
            else:
                try:
                    rc = proc.wait(timeout=limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    kill_group(proc.pid)
                    rc = proc.wait()
                kill_group(proc.pid)  # stragglers left in the group (a child that called setsid escapes: see docs)
        stdout, stderr = _tail(iod / "stdout", STDOUT_TAIL), _tail(iod / "stderr", STDERR_TAIL)
    except Exception as e:  # noqa: BLE001 - the caller must never die because of the child
        stdout, stderr, launch_error = "", "", launch_error or f"sandbox: {e!r}"
    finally:
        io.cleanup()
        with contextlib.suppress(OSError):
            work.cleanup()
        if os.path.exists(work.name):  # a child may leave read-only dirs behind
            shutil.rmtree(work.name, ignore_errors=True)
    if launch_error:
        return SandboxResult(False, "exception", rc, None, None, (stderr + launch_error)[-STDERR_TAIL:],
                             time.monotonic() - t0, isolated, work.name)
    kind, sig, output = _classify(rc, timed_out, stdout, stderr)
    if timed_out:
        stderr = (stderr + f"\nsandbox: killed after {limits.wall_s:g} s wall clock")[-STDERR_TAIL:]
    return SandboxResult(kind == "ok", kind, rc, sig, output, stderr, time.monotonic() - t0, isolated, work.name)
