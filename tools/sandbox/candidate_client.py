"""The gate's handle on a candidate process: launch it, send it jobs, read its answers under a time budget.

The candidate runs `specpilot.tools.sandbox.candidate_worker` in its own process, with a scrubbed environment (no variable
whose name contains KEY, TOKEN, SECRET or PASSWORD), its own temporary directory as working directory, stderr
captured to a file, and a wall-clock budget for the time the gate waits on it. By default the process is forked from
a fork server that has imported torch and transformers once (a worker then starts in about a second instead of
five or more); SPECPILOT_GATE_LAUNCH=subprocess starts a fresh `python -m` process in the sandbox instead
(tools/sandbox/process.py: network namespace, allow-listed environment, process group; docs/SANDBOX.md). The fork-server
path is not network-isolated yet. `launch` is the one place a process starts. Anything that goes wrong on the candidate's side raises
CandidateFailure.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ...engine.loader import cache_root
from . import process as sandbox

SCRUBBED = ("KEY", "TOKEN", "SECRET", "PASSWORD")
STDERR_TAIL = 2000


class CandidateFailure(Exception):
    """The candidate did not answer as the protocol requires; `kind`: crashed, timed_out, startup or protocol."""

    def __init__(self, kind: str, message: str, stderr_tail: str = ""):
        super().__init__(message)
        self.kind, self.message, self.stderr_tail = kind, message, stderr_tail


def scrubbed_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not any(s in k.upper() for s in SCRUBBED)}


_server_lock = threading.Lock()
_server = None


class _ForkServer:
    """The gate's end of tools/sandbox/candidate_forkserver.py: one per gate process, started on first use."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "specpilot.tools.sandbox.candidate_forkserver",
                                      str(theirs.fileno())], pass_fds=[theirs.fileno()], env=scrubbed_env(),
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.lock = ours, threading.Lock()

    def request(self, msg: dict, fds: list[int] = ()) -> dict:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], list(fds))
            data = self.sock.recv(1 << 16)
        if not data:
            raise OSError("the candidate fork server exited")
        return json.loads(data)


def _fork_server() -> _ForkServer:
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _ForkServer()
        return _server


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
    """`python -m specpilot.tools.sandbox.candidate_worker` in the sandbox (tools/sandbox/process.py): its own process group, a
    network namespace where the OS allows one, the allow-listed environment, no core dumps, bounded file writes.
    No address-space limit: torch reserves far more virtual memory than it uses. JSON lines on stdin and stdout."""

    def __init__(self, worker_args: list[str], cwd: Path, env: dict, stderr_path: Path):
        limits = sandbox.SandboxLimits(memory_bytes=None)
        argv, isolated = sandbox.command([sys.executable, "-m", "specpilot.tools.sandbox.candidate_worker", *worker_args],
                                         limits)
        # HOME becomes the temp dir, so the model caches are named explicitly
        caches = {"SPECPILOT_CACHE": str(cache_root()),
                  "HF_HOME": os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))}
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=sandbox.child_env(str(cwd), isolated, caches),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         bufsize=1, start_new_session=True, preexec_fn=sandbox.limiter(limits))
        self.lines = _Lines(self.proc.stdout).queue

    def send(self, line: str) -> None:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def stop(self) -> int:
        sandbox.kill_group(self.proc.pid)  # the worker and anything it started
        status = self.proc.wait()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        return status

    def exit_status(self) -> int:
        return self.proc.wait()


class _Forked:
    """The same worker, forked from the fork server (tools/sandbox/candidate_forkserver.py) with pipes as stdin and stdout."""

    def __init__(self, worker_args: list[str], cwd: Path, env: dict, stderr_path: Path):
        self.server = _fork_server()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.pid = self.server.request({"spawn": worker_args, "cwd": str(cwd), "env": env,
                                            "stderr": str(stderr_path)}, [in_r, out_w])["pid"]
        finally:
            os.close(in_r)
            os.close(out_w)
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
            self.status, self.pid = self.server.request({"release": self.pid, "grace": grace})["status"], None
        return self.status

    def stop(self) -> int | None:
        return self._release(0.0)

    def exit_status(self) -> int | None:
        return self._release(2.0)


def launch(worker_args: list[str], cwd: Path, stderr_path: Path):
    """Start a candidate worker (the one function a sandbox replaces): forked from the preloaded fork server, or as
    a plain `python -m` process when SPECPILOT_GATE_LAUNCH=subprocess or the platform has no fork server."""
    env = scrubbed_env()
    if os.environ.get("SPECPILOT_GATE_LAUNCH") == "subprocess" or not sys.platform.startswith("linux"):
        return _Subprocess(worker_args, cwd, env, stderr_path)
    return _Forked(worker_args, cwd, env, stderr_path)


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
        self.worker = launch(args, self.dir, self.stderr_path)
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
            raise self._fail("crashed", f"candidate crashed (exit status {code})")
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
