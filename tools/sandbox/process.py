"""Run untrusted candidate code in a child process that cannot take the caller down (docs/SANDBOX.md).

`run_python(code_or_module_args, payload, limits)` starts `python -c CODE` (a str) or `python -m MODULE ARGS...`
(a list) inside the sandbox and returns a SandboxResult; nothing the child does is raised. The sandbox:

* its own PID, mount and network namespaces (Linux, as root: this file run as a script is the tiny init that sets
  them up, `python -I -S process.py CONFIG`): the caller's processes are invisible and unsignalable, /proc is fresh,
  there is no network at all (loopback down), and when the sandbox's init ends the kernel kills everything it started
  (setsid daemons and double forks included);
* the whole filesystem read-only (recursive read-only remount), /run hidden, a fresh /dev with a few harmless nodes
  (GPU nodes with limits.gpu), a fresh read-only /proc, and one writable tmpfs as cwd/HOME/TMPDIR that vanishes with
  the namespace;
* every capability dropped (bounding set, securebits, no_new_privs) before the candidate's exec, so root in the
  sandbox cannot remount, mknod, write sysctls or open raw devices; a process bound (the PID namespace's own pid_max,
  kernel 6.14+, plus RLIMIT_NPROC, which binds only non-root callers);
* an environment built from an exact allow-list (ALLOWED, no prefixes), rlimits on memory, CPU, file size, cores;
* a new session, SIGKILLed whole on timeout, and PR_SET_PDEATHSIG so a caller killed by SIGKILL takes it along.

Where namespaces are refused (EPERM in unprivileged containers, not Linux), the same runs without them, one warning
line `specpilot: warning: sandbox without namespaces: ...` is written once per process, and SandboxResult.isolation
says which guarantees held. `Sandbox` is the reusable piece for long-lived workers (tools/sandbox/candidate_client.py).
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
STDOUT_TAIL = 256 << 20  # the last 256 MiB of stdout are read back to find the last line (a bench result with
# every timed output is megabytes; the child's file size is bounded by file_bytes)
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|PAT$|_PAT_|DATABASE_URL", re.I)
# The exact names a sandboxed worker may inherit (no prefix wildcards). HOME, TMPDIR, HF_HUB_OFFLINE and
# PYTHONUNBUFFERED are always set by child_env; SPECPILOT_CACHE, SPECPILOT_MODELS and HF_HOME default to the caller's
# resolved locations (the child's HOME is its temp dir, so ~-relative defaults would point at nothing).
ALLOWED = frozenset({
    "PATH", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONPATH",
    "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS",
    "HF_HOME", "HF_HUB_CACHE",
    "TRITON_INTERPRET",
    "SPECPILOT_CACHE", "SPECPILOT_MODELS",
    "SPECPILOT_FMA_MAX_TOKENS", "SPECPILOT_FUSED_MAX_TOKENS", "SPECPILOT_FMA_TILES_AS_ONE_TOKEN", "SPECPILOT_PDL",
    "SPECPILOT_DEAD_CHECK_FIRST", "SPECPILOT_FMA_TILE_VALUES", "SPECPILOT_FMA_TILES", "SPECPILOT_FMA_TILES_12",
    "SPECPILOT_DOT_TILES", "SPECPILOT_DOT_ATTENTION", "SPECPILOT_DOT_PDL",
    "SPECPILOT_FMA_ATTENTION", "SPECPILOT_ATTENTION_MERGE_SPLITS",
    "SPECPILOT_ATTENTION_LATE_TRIGGER",
    "SPECPILOT_COMPILED_PREFILL", "SPECPILOT_PROBE_BACKOFF", "SPECPILOT_PROBE_DOWN", "SPECPILOT_AR_PROBE_KIND",
    "SPECPILOT_SIDE_SEARCH",
    "SPECPILOT_BLIND_BACKLOG", "SPECPILOT_PRICE_AHEAD",
    "SPECPILOT_SYNTHETIC_TOKENIZER",
})
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: refused at once, when no network namespace is available
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
# The PID namespace's pid_max bounds the processes and threads alive in a sandbox at once. Once a namespace's pids
# have wrapped, the kernel allocates only from 300 (RESERVED_PIDS) to pid_max, so a long-lived sandbox (the gate's
# fork server, which forks worker after worker) would be left one pid by the smallest pid_max (301): "can't start
# new thread" in a worker after a few hundred tasks had come and gone. 601 leaves 300 to 600 tasks at once.
MAX_TASKS = 601
WARNING = "specpilot: warning: sandbox without namespaces: "
NO_ISOLATION = {"pid": False, "mount": False, "net": False}


@dataclass
class SandboxLimits:
    wall_s: float = 600.0
    memory_bytes: int | None = 8 << 30  # RLIMIT_AS; with gpu=True applied as RLIMIT_DATA (CUDA reserves huge VA)
    cpu_s: int | None = None            # RLIMIT_CPU (SIGXCPU, then SIGKILL, when exceeded)
    network: bool = False               # False: a new, empty network namespace where the OS allows it
    gpu: bool = False                   # True: hold the GPU lock for the duration of the child, GPU device nodes
    file_bytes: int | None = 4 << 30    # RLIMIT_FSIZE: also bounds the captured stdout/stderr files
    tmp_bytes: int = 2 << 30            # size of the writable tmpfs (cwd, HOME, TMPDIR) in the mount namespace
    max_procs: int = MAX_TASKS          # process bound: the PID namespace's pid_max (>= 601) and RLIMIT_NPROC


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
    isolation: dict = field(default_factory=lambda: dict(NO_ISOLATION))  # which namespaces held: pid, mount, net


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


# -- the caller's side ---------------------------------------------------------------------------------------------

INIT = [sys.executable, "-I", "-S", os.path.abspath(__file__)]
_warned = False


@functools.lru_cache(maxsize=1)
def namespaces() -> tuple[bool, str]:
    """Whether the sandbox's namespaces work here, and why not: one probe per process (the init with /bin/true)."""
    if not sys.platform.startswith("linux"):
        return False, f"not Linux ({sys.platform})"
    true = shutil.which("true") or "/bin/true"
    root = temp_root()
    probe = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-probe-", dir=root))
    cfg = {"argv": [true], "ns": {"pid": True, "mount": True, "net": True}, "work": str(probe), "hide": str(root),
           "tmp_bytes": 1 << 20, "max_procs": MAX_TASKS, "gpu": False, "rlimits": {}, "parent": os.getpid(),
           "pdeathsig": True}
    try:
        r = subprocess.run([*INIT, json.dumps(cfg)], capture_output=True, timeout=30, env=child_env(str(probe)),
                           start_new_session=True, cwd="/")
        if r.returncode == 0:
            return True, ""
        return False, (r.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit {r.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError) as e:
        return False, repr(e)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def isolation_for(limits: SandboxLimits) -> dict:
    """The namespaces a run with these limits gets; warns once per process when namespaces are unavailable."""
    global _warned
    ok, why = namespaces()
    if not ok:
        if not _warned:
            _warned = True
            print(WARNING + (why or "unavailable") + " (rlimits, the environment allow-list and the process-group "
                  "kill still hold; see docs/SANDBOX.md)", file=sys.stderr, flush=True)
        return dict(NO_ISOLATION)
    return {"pid": True, "mount": True, "net": not limits.network}


def temp_root() -> Path:
    """Where sandbox run directories live: $TMPDIR/specpilot-sandbox-UID/PID-xxxx. Directories whose PID is dead
    (a caller killed with SIGKILL) are swept on the first use in each process."""
    root = Path(tempfile.gettempdir()) / f"specpilot-sandbox-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    _sweep(str(root))
    return root


@functools.lru_cache(maxsize=None)
def _sweep(root: str) -> None:
    for entry in os.scandir(root):
        pid = entry.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except PermissionError:
            pass


def _models_dir() -> str:
    return os.environ.get("SPECPILOT_MODELS") or str(Path.home() / ".local" / "share" / "specpilot" / "models")


def child_env(home: str, network_isolated: bool = True, extra: dict | None = None) -> dict[str, str]:
    """The environment from the exact allow-list ALLOWED (also applied to `extra`), minus anything whose name looks
    like a secret; HOME and TMPDIR are `home`; the caches default to the caller's resolved paths."""
    src = {"SPECPILOT_CACHE": str(cache_dir()), "SPECPILOT_MODELS": _models_dir(),
           "HF_HOME": os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface"),
           **os.environ, **(extra or {})}
    env = {k: str(v) for k, v in src.items() if k in ALLOWED and not SECRET.search(k)}
    env.update(HOME=home, TMPDIR=home, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if not network_isolated:
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
            env[k] = DEAD_PROXY
        env["NO_PROXY"] = env["no_proxy"] = ""
    return env


def tasks_now() -> int:
    """Threads on the machine now (the kernel's count in /proc/loadavg): at least those of our uid."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return 0


def rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    # RLIMIT_NPROC counts every process and thread of the uid on the whole machine (and binds root too once its
    # capabilities are dropped), so max_procs alone would starve a sandbox on a busy machine ("can't start new
    # thread"): the bound is what runs now plus max_procs. Inside the PID namespace its pid_max is the tight bound.
    nproc = tasks_now() + limits.max_procs
    out = {"RLIMIT_CORE": (0, 0), "RLIMIT_NPROC": (nproc, nproc)}
    if limits.memory_bytes:
        out["RLIMIT_DATA" if limits.gpu else "RLIMIT_AS"] = (limits.memory_bytes, limits.memory_bytes)
    if limits.cpu_s:
        out["RLIMIT_CPU"] = (int(limits.cpu_s), int(limits.cpu_s) + 1)
    if limits.file_bytes:
        out["RLIMIT_FSIZE"] = (limits.file_bytes, limits.file_bytes)
    return out


def limiter(limits: SandboxLimits):
    """A preexec_fn that sets the rlimits (the sandbox's init sets them itself; kept for other launchers)."""
    def apply() -> None:
        for name, value in rlimits(limits).items():
            resource.setrlimit(getattr(resource, name), value)
    return apply


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class Sandbox:
    """One sandboxed process: `popen(argv, ...)` starts argv under the init (namespaces, read-only fs, tmpfs at
    `work`, dropped capabilities, rlimits, allow-listed environment) in a new session; `kill()` ends it and all it
    started; `cleanup()` removes the run directory. `isolation` says which namespaces it got."""

    def __init__(self, limits: SandboxLimits | None = None, env: dict | None = None, die_with_parent: bool = True):
        self.limits = limits or SandboxLimits()
        self.isolation = isolation_for(self.limits)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=temp_root()))
        self.work = self.run_dir / "work"  # the child's cwd, HOME and TMPDIR (a tmpfs over it in the mount namespace)
        self.work.mkdir(mode=0o700)
        self.io = self.run_dir / "io"      # the caller's files (stdin/stdout/stderr); hidden from the child
        self.io.mkdir(mode=0o700)
        self.env = child_env(str(self.work), self.isolation["net"], env)
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None

    def argv(self, target: list[str], cwd: str | None = None) -> list[str]:
        cfg = {"argv": list(target), "ns": self.isolation, "work": str(self.work), "cwd": cwd,
               "hide": str(self.run_dir.parent), "tmp_bytes": int(self.limits.tmp_bytes), "gpu": self.limits.gpu,
               "max_procs": int(self.limits.max_procs), "rlimits": rlimits(self.limits), "parent": os.getpid(),
               "pdeathsig": self.die_with_parent}
        return [*INIT, json.dumps(cfg)]

    def popen(self, target: list[str], cwd: str | os.PathLike | None = None, **kw) -> subprocess.Popen:
        """subprocess.Popen of `target` in the sandbox; `cwd` (read-only) instead of the tmpfs as working dir."""
        self.proc = subprocess.Popen(self.argv(target, str(cwd) if cwd else None), cwd=str(self.work), env=self.env,
                                     start_new_session=True, close_fds=True, **kw)
        return self.proc

    def kill(self) -> None:
        """SIGKILL the namespace's PID 1 and wait for the sandbox's outer process, which exits only once the kernel
        has killed and reaped every process of the namespace; then the group, for anything left (no PID namespace)."""
        if self.proc is None:
            return
        if self.isolation["pid"] and self.proc.poll() is None:
            for pid in _children(self.proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        kill_group(self.proc.pid)

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


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
    rc, timed_out, launch_error, stdout, stderr = None, False, "", "", ""
    box = None
    try:
        box = Sandbox(limits, env)
        iod = box.io
        (iod / "stdin").write_text(json.dumps(payload if payload is not None else {}))
        with gpu_lock(limits.gpu), open(iod / "stdin", "rb") as fin, \
                open(iod / "stdout", "wb") as fout, open(iod / "stderr", "wb") as ferr:
            try:
                proc = box.popen(py, stdin=fin, stdout=fout, stderr=ferr)
            except (OSError, subprocess.SubprocessError) as e:
                launch_error = f"sandbox: could not start the child: {e!r}"
            else:
                try:
                    rc = proc.wait(timeout=limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    box.kill()
                    rc = proc.wait()
                box.kill()  # stragglers (without a PID namespace: those still in the group)
        stdout, stderr = _tail(iod / "stdout", STDOUT_TAIL), _tail(iod / "stderr", STDERR_TAIL)
    except Exception as e:  # noqa: BLE001 - the caller must never die because of the child
        launch_error = launch_error or f"sandbox: {e!r}"
    finally:
        if box is not None:
            box.cleanup()
    isolation = box.isolation if box is not None else dict(NO_ISOLATION)
    work = str(box.work) if box is not None else ""
    if launch_error:
        return SandboxResult(False, "exception", rc, None, None, (stderr + launch_error)[-STDERR_TAIL:],
                             time.monotonic() - t0, isolation["net"], work, isolation=isolation)
    kind, sig, output = _classify(rc, timed_out, stdout, stderr)
    if timed_out:
        stderr = (stderr + f"\nsandbox: killed after {limits.wall_s:g} s wall clock")[-STDERR_TAIL:]
    return SandboxResult(kind == "ok", kind, rc, sig, output, stderr, time.monotonic() - t0, isolation["net"], work,
                         isolation=isolation)


# -- the init (this file run as a script: `python -I -S process.py CONFIG`; stdlib only) ---------------------------

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 24, 28, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECUREBITS_LOCKED_NOROOT = 0x3f  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED and their locks
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs", "kcore", "kmsg", "timer_list")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
GPU_NODES = ("nvidia", "dri")  # /dev/nvidia*, /dev/nvidia-caps, /dev/dri


def _die(msg: str, code: int = 125) -> None:
    os.write(2, f"sandbox init: {msg}\n".encode())
    os._exit(code)


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def call(name, *args):
        if getattr(libc, name)(*args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{name}{args[:2]}: {os.strerror(e)}")
    return ctypes, libc, call


def _mount(call, src, target, fstype, flags, data=None) -> None:
    enc = (lambda s: s if s is None else str(s).encode())
    call("mount", enc(src), enc(target), enc(fstype), flags, enc(data))


def _readonly_everything(ctypes, libc, call) -> None:
    """Every mount read-only: mount_setattr(AT_RECURSIVE) where the kernel has it (5.12+), else one remount each."""
    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                    ("userns_fd", ctypes.c_uint64)]
    attr = MountAttr(1, 0, 0, 0)  # MOUNT_ATTR_RDONLY
    AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = -100, 0x8000, 442
    if os.uname().machine == "x86_64" or os.uname().machine == "aarch64":
        if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                        ctypes.sizeof(attr)) == 0:
            return
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    for mp in points:
        with contextlib.suppress(OSError):
            _mount(call, None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if " - " in line and "ro" not in line.split()[5].split(","):
                raise OSError(f"could not make {line.split()[4]} read-only")


def _setup_fs(cfg: dict, call, ctypes, libc, fresh_proc: bool) -> None:
    _mount(call, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do propagates back to the caller's namespace
    with open("/proc/self/mountinfo") as f:  # other procfs mounts would show the caller's PID namespace
        for line in f:
            parts = line.split()
            if parts[parts.index("-") + 1] == "proc" and parts[4] != "/proc":
                with contextlib.suppress(OSError):
                    call("umount2", parts[4].encode(), MNT_DETACH)
    nodes = [n for n in DEV_NODES if os.path.exists(f"/dev/{n}")]
    if cfg.get("gpu"):
        nodes += [n for n in os.listdir("/dev") if n.startswith(GPU_NODES)]
    fds = {n: os.open(f"/dev/{n}", os.O_PATH) for n in nodes}
    _readonly_everything(ctypes, libc, call)
    # a fresh /dev: only the nodes above (no disks, no kmsg), a private /dev/shm
    _mount(call, "tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=1m")
    for n, fd in fds.items():
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.mkdir(f"/dev/{n}")
            _mount(call, f"/proc/self/fd/{fd}", f"/dev/{n}", None, MS_BIND | MS_REC)
        else:
            open(f"/dev/{n}", "w").close()
            _mount(call, f"/proc/self/fd/{fd}", f"/dev/{n}", None, MS_BIND)
        os.close(fd)
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2")):
        os.symlink(to, f"/dev/{name}")
    os.mkdir("/dev/shm")
    _mount(call, "tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['tmp_bytes']}")
    _mount(call, None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=755,size=1m")
    # sockets of system services (databases, docker, dbus) usually live under /run: hidden
    for run in ("/run", "/var/run"):
        if os.path.isdir(run) and not os.path.islink(run):
            _mount(call, "tmpfs", run, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    # the sandbox root (other runs' directories, the caller's stdin/stdout/stderr files) hidden; our work dir is a
    # tmpfs at the same path
    hide, work = cfg["hide"], cfg["work"]
    _mount(call, "tmpfs", hide, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    os.makedirs(work, mode=0o700)
    _mount(call, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=700,size={cfg['tmp_bytes']}")
    _mount(call, None, hide, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    if fresh_proc:
        _mount(call, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
        if release >= (6, 14):  # pid_max is per PID namespace from 6.14 on; before, it is global: never written
            with contextlib.suppress(OSError):
                with open("/proc/sys/kernel/pid_max", "w") as f:
                    f.write(str(max(int(cfg["max_procs"]), MAX_TASKS)))
        # /proc itself stays writable (CUDA's init fails under a read-only /proc: error 304); what a process without
        # capabilities but with uid 0 could still change through it is made read-only, as container runtimes do
        for sub in PROC_READONLY:
            path = f"/proc/{sub}"
            if os.path.exists(path):
                _mount(call, path, path, None, MS_BIND | MS_REC)
                _mount(call, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _drop_privileges(ctypes, libc) -> None:
    """No capabilities, now or after exec (bounding set emptied, securebits locked), no privilege gain (no_new_privs).
    Best effort without CAP_SETPCAP (an unprivileged caller has nothing to drop)."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    libc.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    libc.capset(header, data)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _exec_target(cfg: dict, ctypes, libc) -> None:
    try:
        os.chdir(cfg.get("cwd") or cfg["work"])
        for name, value in cfg["rlimits"].items():
            with contextlib.suppress(ValueError, OSError):  # e.g. RLIMIT_NPROC below the caller's current count
                resource.setrlimit(getattr(resource, name), tuple(value))
        _drop_privileges(ctypes, libc)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.execv(cfg["argv"][0], cfg["argv"])
    except OSError as e:
        _die(f"could not start {cfg['argv'][0]}: {e}", 127)


def _pid1(cfg: dict, status_w: int, ctypes, libc, call) -> None:
    """PID 1 of the new namespace: set up the filesystem, run the target as PID 2, reap orphans, and exit (which
    kills every process left in the namespace) as soon as the target exits, reporting its wait status."""
    try:
        if cfg.get("pdeathsig"):
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.setsid()  # killpg(0) inside the sandbox then reaches only the namespace's processes
        if cfg["ns"]["mount"]:
            _setup_fs(cfg, call, ctypes, libc, fresh_proc=True)
        pid = os.fork()
    except OSError as e:
        _die(f"setup failed: {e}")
    if pid == 0:
        os.close(status_w)
        os.setsid()  # a group of its own (not 1: killpg(1) would mean kill(-1))
        _exec_target(cfg, ctypes, libc)
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(125)
        if done == pid:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _init(cfg: dict) -> None:
    ctypes, libc, call = _libc()
    parent = cfg.get("parent")
    if cfg.get("pdeathsig"):
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if parent and os.getppid() != parent:  # the caller died before the prctl
            os._exit(137)
    ns = cfg["ns"]
    flags = (CLONE_NEWPID if ns["pid"] else 0) | (CLONE_NEWNS if ns["mount"] else 0) | (CLONE_NEWNET if ns["net"]
                                                                                         else 0)
    if flags:
        try:
            call("unshare", flags)
        except OSError as e:
            _die(f"unshare: {e}")
    if not ns["pid"]:  # no PID namespace: set up what we can and become the target
        if ns["mount"]:
            try:
                _setup_fs(cfg, call, ctypes, libc, fresh_proc=False)
            except OSError as e:
                _die(f"setup failed: {e}")
        _exec_target(cfg, ctypes, libc)
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        _pid1(cfg, status_w, ctypes, libc, call)
    os.close(status_w)
    _, init_status = os.waitpid(pid, 0)
    report = os.read(status_r, 64)
    status = int(report) if report else init_status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP cannot be changed
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 125)


if __name__ == "__main__":
    _init(json.loads(sys.argv[1]))
