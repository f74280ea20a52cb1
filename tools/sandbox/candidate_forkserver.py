"""A fork server for candidate workers: imports torch and transformers once, then forks a fresh worker per request.

    python -m specpilot.tools.sandbox.candidate_forkserver FD

Started by the gate (tools/sandbox/candidate_client.py) inside the sandbox (tools/sandbox/process.py: PID, mount and
network namespaces, read-only filesystem, no capabilities, the allow-listed environment), so every worker forked from
it inherits all of that; FD is one end of a Unix datagram socket pair. Requests are JSON datagrams:

    {"spawn": [worker args], "cwd": DIR, "env": {...}}  + three file descriptors (stdin, stdout, stderr)
        -> {"pid": N}: a forked child with those as fd 0, 1 and 2, DIR as cwd and exactly `env` except that HOME and
           TMPDIR become a fresh directory of its own under env's HOME (the sandbox's tmpfs), running
           candidate_worker.main(worker args): the same worker `python -m specpilot.tools.sandbox.candidate_worker` runs
    {"release": N, "grace": S}
        -> {"status": exit status, negative for a signal}: waits up to S seconds for child N to exit, kills it if
           it has not, reaps it, removes its directory, and kills whatever released workers left running (a setsid
           daemon: every process of the sandbox outside the sessions of the workers still held). Children are reaped
           only here, so a pid the gate holds is never reused.

Forking from this process (which has run no torch operation, so no thread pool exists) rather than from the gate
(which has) is what makes forking safe. The server exits when the gate closes its end.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
import traceback

PRELOAD = ["torch", "transformers", "specpilot.engine.engine", "specpilot.tools.sandbox.candidate_worker",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           *[f"transformers.models.{a}.modeling_{a}" for a in ("llama", "mistral", "qwen2", "qwen3")]]


def _home(pid: int, env: dict) -> str:
    return os.path.join(env.get("HOME") or "/tmp", f"worker-{pid}")


def _child(req: dict, fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()  # its own group: a worker's killpg(0) reaches only itself and what it started
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        home = _home(os.getpid(), req["env"])
        os.makedirs(home, mode=0o700, exist_ok=True)
        os.environ.clear()
        os.environ.update(req["env"], HOME=home, TMPDIR=home)
        sys.stdin = open(0, closefd=False)
        sys.argv = ["candidate_worker", *req["spawn"]]  # as `python -m specpilot.tools.sandbox.candidate_worker ...` sees it
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        from . import candidate_worker

        code = candidate_worker.main(req["spawn"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _release(pid: int, grace: float, homes: dict) -> int:
    deadline = time.monotonic() + grace
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    shutil.rmtree(homes.pop(pid, ""), ignore_errors=True)
    _kill_strays(set(homes))
    return os.waitstatus_to_exitcode(status)


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3])  # after "pid (comm)": state ppid pgrp session
    except (OSError, ValueError, IndexError):
        return None


def _kill_strays(live: set[int]) -> None:
    """Kill what released workers left behind (a setsid daemon, a double fork): every process of this sandbox that is
    neither its init (1), this server, nor in the session of a worker still held (each worker is a session leader).
    The server's /proc is the sandbox's own, so nothing outside the sandbox is touched."""
    me = os.getpid()
    for _ in range(5):  # a stray that forks while we look is caught on the next pass
        strays = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                  if pid not in (1, me) and _session(pid) not in (live | {me, None})]
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def serve(sock: socket.socket) -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    homes: dict[int, str] = {}
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        except OSError:
            return
        if not data:
            return
        req = json.loads(data)
        if "spawn" in req:
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(req, fds)
            for fd in fds:
                os.close(fd)
            homes[pid] = _home(pid, req["env"])
            reply = {"pid": pid}
        else:
            try:
                reply = {"status": _release(int(req["release"]), float(req.get("grace", 0)), homes)}
            except ChildProcessError:
                reply = {"status": None}
        sock.send(json.dumps(reply).encode())


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
