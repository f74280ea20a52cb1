"""The gate's handle on a candidate process: launch it, send it jobs, read its answers under a time budget.

The candidate runs `specpilot.tools.sandbox.candidate_worker` inside the sandbox of tools/sandbox/process.py
(docs/SANDBOX.md): its own PID, mount and network namespaces, a read-only filesystem with a tmpfs as HOME/TMPDIR, no
capabilities, a process bound, the exact allow-listed environment; stderr goes to a file the gate opened, and the gate
waits on it under a wall-clock budget. By default the worker is forked from a fork server that has imported torch and
transformers once (a worker then starts in about a second instead of five or more); the fork server itself is started
under the sandbox, so every worker it forks inherits its namespaces, read-only filesystem, dropped capabilities and
clean environment (workers share that one sandbox: they can see each other and the fork server, nothing outside).
SPECPILOT_GATE_LAUNCH=subprocess starts a fresh sandboxed `python -m` process per candidate instead. `launch` is the
one place a process starts. Anything that goes wrong on the candidate's side raises CandidateFailure.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ...engine.loader import cache_root
from . import process as sandbox

STDERR_TAIL = 2000


def exit_description(code: int | None) -> str:
    """'killed by SIGSEGV' for a signal (negative status, or the shell's 128 + N), else 'exit status N'."""
    if code is not None and (code < 0 or 128 < code < 128 + 65):
        number = -code if code < 0 else code - 128
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            pass
    return f"exit status {code}"


class CandidateFailure(Exception):
    """The candidate did not answer as the protocol requires; `kind`: crashed, timed_out, startup or protocol."""

    def __init__(self, kind: str, message: str, stderr_tail: str = ""):
        super().__init__(message)
        self.kind, self.message, self.stderr_tail = kind, message, stderr_tail


def _caches() -> dict[str, str]:
    """HOME becomes the sandbox's tmpfs, so the model caches are named explicitly."""
    return {"SPECPILOT_CACHE": str(cache_root()),
            "HF_HOME": os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))}


def _limits(gpu: bool) -> sandbox.SandboxLimits:
    """No address-space limit: torch reserves far more virtual memory than it uses. `gpu`: the GPU's device nodes
    in the sandbox's /dev (a candidate on CUDA; without them CUDA is not available there)."""
    return sandbox.SandboxLimits(memory_bytes=None, gpu=gpu)


_server_lock = threading.Lock()
_servers: dict[bool, "_ForkServer"] = {}  # with and without the GPU's device nodes


class _ForkServer:
    """The gate's end of tools/sandbox/candidate_forkserver.py: one per gate process, started on first use, itself
    inside the sandbox (it runs no candidate code; the workers it forks do)."""

    def __init__(self, gpu: bool):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # not tied to the starting thread's life (PDEATHSIG): it ends when the gate closes its socket
        self.box = sandbox.Sandbox(_limits(gpu), _caches(), die_with_parent=False)
        try:
            self.proc = self.box.popen([sys.executable, "-m", "specpilot.tools.sandbox.candidate_forkserver",
                                        str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except BaseException:
            self.box.cleanup()
            raise
        finally:
            theirs.close()
        self.sock, self.lock = ours, threading.Lock()
        self.isolation = self.box.isolation
        atexit.register(self.close)

    def worker_env(self) -> dict[str, str]:
        """A worker's environment: the allow-list; HOME and TMPDIR in the fork server's tmpfs (a directory per worker
        is made there by the fork server)."""
        return sandbox.child_env(str(self.box.work), self.isolation["net"], _caches())

    def request(self, msg: dict, fds: list[int] = ()) -> dict:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], list(fds))
            data = self.sock.recv(1 << 16)
        if not data:
            raise OSError("the candidate fork server exited")
        return json.loads(data)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        self.box.cleanup()  # the sandbox's init: everything forked from the server dies with it
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _fork_server(gpu: bool) -> _ForkServer:
    with _server_lock:
        server = _servers.get(gpu)
        if server is None or server.proc.poll() is not None:
            if server is not None:
                server.close()
            server = _servers[gpu] = _ForkServer(gpu)
        return server


class _Lines:
    """A thread that turns a blocking line source into a queue; None marks the end of the stream."""

    def __init__(self, source):
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(source,), daemon=True).start()

    def _pump(self, source) -> None:
        try:
            for line in source:
                self.queue.put(line)
        except (OSError, ValueError):
            pass
        self.queue.put(None)


class _Subprocess:
    """`python -m specpilot.tools.sandbox.candidate_worker` in a sandbox of its own (tools/sandbox/process.py).
    JSON lines on stdin and stdout."""

    def __init__(self, worker_args: list[str], cwd: Path, stderr_path: Path, gpu: bool):
        self.box = sandbox.Sandbox(_limits(gpu), _caches())
        self.isolation = self.box.isolation
        try:
            with open(stderr_path, "wb") as err:
                self.proc = self.box.popen([sys.executable, "-m", "specpilot.tools.sandbox.candidate_worker",
                                            *worker_args], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=err, text=True, bufsize=1)
        except BaseException:
            self.box.cleanup()
            raise
        self.lines = _Lines(self.proc.stdout).queue

    def send(self, line: str) -> None:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def stop(self) -> int:
        self.box.kill()  # the sandbox's init: the worker and anything it started
        status = self.proc.wait()
        self.box.cleanup()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        return status

    def exit_status(self) -> int:
        return self.proc.wait()


class _Forked:
    """The same worker, forked from the fork server (tools/sandbox/candidate_forkserver.py) with pipes as stdin and stdout."""

    def __init__(self, worker_args: list[str], cwd: Path, stderr_path: Path, gpu: bool):
        self.server = _fork_server(gpu)
        self.isolation = self.server.isolation
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self.pid = self.server.request({"spawn": worker_args, "cwd": str(cwd), "env": self.server.worker_env()},
                                           [in_r, out_w, err])["pid"]
        finally:
            os.close(in_r)
            os.close(out_w)
            os.close(err)
        self.stdin, self.stdout = os.fdopen(in_w, "w", buffering=1), os.fdopen(out_r, "r")
        self.lines = _Lines(self.stdout).queue
        self.status = None

    def send(self, line: str) -> None:
        self.stdin.write(line)
        self.stdin.flush()

    def _release(self, grace: float) -> int | None:
        if self.pid is not None:
            try:
                self.stdin.close()
            except OSError:
                pass
            try:
                self.status = self.server.request({"release": self.pid, "grace": grace})["status"]
            except (OSError, ValueError):  # the fork server is gone: its sandbox, the worker included, died with it
                self.status = None
            self.pid = None
        return self.status

    def stop(self) -> int | None:
        return self._release(0.0)

    def exit_status(self) -> int | None:
        return self._release(2.0)


def launch(worker_args: list[str], cwd: Path, stderr_path: Path, gpu: bool = False):
    """Start a candidate worker in the sandbox: forked from the preloaded fork server (itself sandboxed), or as a
    fresh sandboxed `python -m` process when SPECPILOT_GATE_LAUNCH=subprocess or the platform has no fork server.
    `gpu`: the sandbox has the GPU's device nodes (a candidate on CUDA)."""
    if os.environ.get("SPECPILOT_GATE_LAUNCH") == "subprocess" or not sys.platform.startswith("linux"):
        return _Subprocess(worker_args, cwd, stderr_path, gpu)
    return _Forked(worker_args, cwd, stderr_path, gpu)


class Candidate:
    def __init__(self, target: str, recipe_json: str, dtype: str, device: str, patch: str | None,
                 timeout_s: float):
        self.dir = Path(tempfile.mkdtemp(prefix="specpilot-candidate-"))
        (self.dir / "recipe.json").write_text(recipe_json)
        args = ["--target", target, "--recipe", str(self.dir / "recipe.json"), "--dtype", dtype, "--device", device]
        if patch:
            args += ["--patch", patch]
        self.stderr_path = self.dir / "stderr.txt"
        self.budget = self.timeout_s = timeout_s
        self.worker = launch(args, self.dir, self.stderr_path, gpu=device.startswith("cuda"))
        self.lines = self.worker.lines
        self._next_id = 0
        self._done = False

    def stderr_tail(self) -> str:
        try:
            data = self.stderr_path.read_bytes()[-STDERR_TAIL:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def _fail(self, kind: str, message: str) -> CandidateFailure:
        self.close()
        return CandidateFailure(kind, message, self.stderr_tail())

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[str]]:
        """Decode `prompts`; the candidate's tokens and finish reasons per prompt."""
        job_id, self._next_id = self._next_id, self._next_id + 1
        try:
            self.worker.send(json.dumps({"id": job_id, "prompts": prompts, "max_new_tokens": max_new_tokens}) + "\n")
        except (OSError, ValueError):
            pass  # it has exited: the read below reports how
        t0 = time.monotonic()
        try:
            line = self.lines.get(timeout=max(self.budget, 0.0))
        except queue.Empty:
            raise self._fail("timed_out", f"candidate timed out (no answer within {self.timeout_s:g} s)") from None
        finally:
            self.budget -= time.monotonic() - t0
        if line is None:
            code = self.worker.exit_status()
            raise self._fail("crashed", f"candidate crashed: {exit_description(code)}")
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            raise self._fail("protocol", f"candidate protocol error: not a JSON line: {line[:200]!r}") from None
        if isinstance(answer, dict) and "error" in answer:
            raise self._fail("startup", f"candidate could not start: {answer['error']}")
        return self._validate(answer, job_id, len(prompts))

    def _validate(self, answer, job_id: int, n: int) -> tuple[list[list[int]], list[str]]:
        ok = (isinstance(answer, dict) and answer.get("id") == job_id and isinstance(answer.get("tokens"), list)
              and len(answer["tokens"]) == n
              and all(isinstance(row, list) and all(type(t) is int for t in row) for row in answer["tokens"]))
        if not ok:
            raise self._fail("protocol", f"candidate protocol error: answer to job {job_id} is not {n} rows of "
                                         f"token ids: {json.dumps(answer)[:200]}")
        reasons = answer.get("finish_reasons")
        reasons = [str(r) for r in reasons] if isinstance(reasons, list) and len(reasons) == n else [""] * n
        return answer["tokens"], reasons

    def close(self) -> None:
        """End the worker. It keeps no state worth a graceful exit, so it is killed (a no-op once it has exited)."""
        if not self._done:
            self._done = True
            self.worker.stop()

    def cleanup(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
