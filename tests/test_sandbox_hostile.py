"""Hostile candidates against the sandbox (issue #19: secrets, harm to the caller, escapes), through `run_python` and
through the gate's candidate launch path (tools/sandbox/candidate_client.py, fork server and plain subprocess).

Each case fails closed and the test process survives. Why each test would fail without its defense:
- environ/kill probes: without a PID namespace the caller's pid is visible, /proc/<caller>/environ readable (same
  uid) and os.kill(caller, 9) lands (the helper-caller dies, exit -9); test_probes_have_teeth_without_namespaces
  shows the environ probe finding the secret once the namespaces are toggled off;
- the setsid daemon: without a PID namespace it leaves the process group, survives the group kill, and writes its
  file (the filesystem is writable); the process scan and the file check both catch it;
- 700 forks: as root RLIMIT_NPROC is ignored, so without the namespace's pid_max every fork succeeds;
- network: without a network namespace the loopback listener accepts and a route to 192.0.2.1 exists (only a UDP
  connect() is tried for the external address: a route lookup, no packet is sent);
- writes outside the temp dir: without the read-only mount namespace they succeed (root);
- environment: without the exact allow-list GITHUB_PAT, DATABASE_URL, AWS_CREDENTIAL reach the child.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specpilot.tools.sandbox import process as sandbox
from test_sandbox import _alive_with  # one scan of /proc for both sandbox test files
from specpilot.tools.sandbox.process import SandboxLimits, run_python

SECRETS = {"GITHUB_PAT": "ghp_hostile_test_secret_1", "DATABASE_URL": "postgres://u:hostile_test_secret_2@db/x",
           "AWS_CREDENTIAL": "hostile_test_secret_3", "OPENAI_API_KEY": "sk-hostile_test_secret_4"}
QUICK = SandboxLimits(wall_s=20, memory_bytes=1 << 30)

pytestmark = pytest.mark.skipif(not sandbox.namespaces()[0],
                                reason=f"no namespaces here: {sandbox.namespaces()[1]} (the fallback is tested in "
                                       "tests/test_sandbox.py)")

# One probe script, run as the candidate. {cfg} is a JSON dict: caller_pid, caller_pgid, port, outside (a path the
# caller owns), token, forks. It prints one JSON line of findings (or writes it to stderr as 'HOSTILE {...}').
PROBE = r'''
import errno, json, os, socket, sys, time
cfg = json.loads({cfg!r})
out = {{}}
def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except Exception as e:
        out[name] = [type(e).__name__, getattr(e, "errno", None)]
secrets = [v.encode() for v in cfg["secrets"]]
def environ_leaks():
    found = []
    for pid in [os.getppid(), cfg["caller_pid"]] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            data = open(f"/proc/{{pid}}/environ", "rb").read()
        except OSError:
            continue
        found += [s.decode() for s in secrets if s in data]
    return sorted(set(found))
out["environ_leaks"] = environ_leaks()
out["own_env_leaks"] = [k for k in cfg["secret_names"] if k in os.environ]
out["env_names"] = sorted(os.environ)
out["visible_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["caller_visible"] = os.path.exists(f"/proc/{{cfg['caller_pid']}}")
attempt("kill_caller", lambda: os.kill(cfg["caller_pid"], 9))
attempt("killpg_caller", lambda: os.killpg(cfg["caller_pgid"], 9))
def loopback():
    s = socket.create_connection(("127.0.0.1", cfg["port"]), timeout=2)
    s.sendall(b"leak")
    return "connected"
attempt("loopback", loopback)
def route():  # a UDP connect() is a route lookup only: no packet leaves
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("192.0.2.1", 9))
    return s.getsockname()[0]
attempt("external_route", route)
def write(path):
    with open(path, "w") as f:
        f.write("escaped")
    return path
attempt("write_outside", lambda: write(cfg["outside"]))
attempt("write_tmp", lambda: write("/tmp/specpilot-hostile-" + cfg["token"]))
attempt("write_package", lambda: write(os.path.join(cfg["package"], "hostile-" + cfg["token"])))
attempt("write_cwd", lambda: write(os.path.join(os.environ["HOME"], "mine")))
attempt("read_package", lambda: len(open(os.path.join(cfg["package"], "__init__.py")).read()) > 0)
def remount():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, b"/", None, 32 | 4096, None) != 0:  # MS_REMOUNT|MS_BIND, without MS_RDONLY
        raise OSError(ctypes.get_errno(), "mount")
    return "remounted"
attempt("remount_rw", remount)
# a daemon: setsid + double fork, then exec (so its command line carries the token); it tries, every 0.2 s for 30 s,
# to write `outside` + '.late', so it is still there when the sandbox ends unless something kills it
DAEMON = ("import sys, time\nfor _ in range(150):\n    time.sleep(0.2)\n    try:\n"
          "        open(sys.argv[2], 'w').write('daemon ' + sys.argv[1])\n    except OSError:\n        pass")
if os.fork() == 0:
    try:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", DAEMON, cfg["token"], cfg["outside"] + ".late"])
    finally:
        os._exit(0)
def forks():
    kids, err = [], None
    try:
        for _ in range(cfg["forks"]):
            pid = os.fork()
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            kids.append(pid)
    except OSError as e:
        err = e.errno
    for pid in kids:  # then free the slots again (the gate's worker still has to build its engine)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return [len(kids), err]
out["forks"] = forks()
line = json.dumps(out)
if cfg.get("to_stderr"):
    sys.stderr.write("HOSTILE " + line + "\n")
    sys.stderr.flush()
else:
    print(line)
'''


def _ours() -> list[str]:
    """Our run dirs, but the gate's fork server's (long-lived by design: removed when it is replaced or at exit)."""
    from specpilot.tools.sandbox import candidate_client

    keep = {server.box.run_dir.name for server in candidate_client._servers.values()}
    return sorted(e for e in os.listdir(sandbox.temp_root()) if e.startswith(f"{os.getpid()}-") and e not in keep)


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A listener on loopback, secrets in our environment, a probe config; afterwards: no temp dir of ours left,
    nothing of the candidate's alive, the daemon's late file never written."""
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    token = f"hostile{os.getpid()}x{time.monotonic_ns()}"
    import specpilot
    cfg = {"caller_pid": os.getpid(), "caller_pgid": os.getpgid(0), "port": srv.getsockname()[1],
           "outside": str(tmp_path / "escaped.txt"), "token": token, "forks": 700,
           "package": os.path.dirname(specpilot.__file__), "secrets": list(SECRETS.values()),
           "secret_names": list(SECRETS)}
    before = _ours()
    yield cfg
    try:
        srv.accept()
        reached = True
    except (BlockingIOError, OSError):
        reached = False
    srv.close()
    assert not reached, "the candidate reached the caller's loopback listener"
    assert _ours() == before, "a sandbox temp dir was left behind"
    assert not _alive_with(token), "a process the candidate started outlived the sandbox"
    time.sleep(1.3)  # the daemon's write time has passed
    assert not Path(cfg["outside"] + ".late").exists(), "a daemon wrote a file after the sandbox ended"
    assert not Path(f"/tmp/specpilot-hostile-{token}").exists()


def check_findings(out: dict, cfg: dict, exact_env: bool = True) -> None:
    assert out["environ_leaks"] == [], out["environ_leaks"]
    assert out["own_env_leaks"] == [] and not set(SECRETS) & set(out["env_names"])
    if exact_env:  # (the gate's worker sets a few variables of its own, e.g. TRANSFORMERS_VERBOSITY)
        assert set(out["env_names"]) <= sandbox.ALLOWED | {"HOME", "TMPDIR", "HF_HUB_OFFLINE", "PYTHONUNBUFFERED"}
    assert not out["caller_visible"] and max(out["visible_pids"]) < 1000, out["visible_pids"]
    assert out["kill_caller"] == ["ProcessLookupError", 3] and out["killpg_caller"] == ["ProcessLookupError", 3]
    assert out["loopback"][0] != "ok" and out["external_route"][0] != "ok", (out["loopback"], out["external_route"])
    for name in ("write_outside", "write_tmp", "write_package"):
        assert out[name][0] != "ok", (name, out[name])
    assert out["remount_rw"][0] != "ok"
    assert out["write_cwd"][0] == "ok" and out["read_package"] == ["ok", True]
    n, err = out["forks"]
    assert err is not None and n < sandbox.MAX_TASKS, out["forks"]  # EAGAIN past the bound, before 700
    assert not Path(cfg["outside"]).exists()


# -- run_python -----------------------------------------------------------------------------------------------------

def test_run_python_hostile_probe_contained(hostile):
    r = run_python(PROBE.format(cfg=json.dumps(hostile)), {}, QUICK)
    assert r.ok and r.isolation == {"pid": True, "mount": True, "net": True}, r
    check_findings(r.output, hostile)


def test_kill_parent_and_own_group(hostile):
    """ppid is the sandbox's init (SIGKILL from inside is ignored); the caller's pid and group are not there;
    killing its own group ends only the candidate: a clear SIGKILL result, and we are still here."""
    code = textwrap.dedent(f"""
        import json, os, sys
        cfg = json.loads({json.dumps(hostile)!r})
        res = {{}}
        for name, fn in (("ppid", lambda: os.kill(os.getppid(), 9)), ("caller", lambda: os.kill(cfg["caller_pid"], 9)),
                         ("caller_group", lambda: os.killpg(cfg["caller_pgid"], 9))):
            try:
                fn()
                res[name] = "sent"
            except OSError as e:
                res[name] = e.errno
        sys.stderr.write("KILLS " + json.dumps(res) + "\\n")
        sys.stderr.flush()
        os.killpg(os.getpgid(0), 9)
        print("{{}}")
    """)
    r = run_python(code, {}, QUICK)
    kills = json.loads(r.stderr_tail.split("KILLS ", 1)[1].splitlines()[0])
    assert kills["caller"] == 3 and kills["caller_group"] == 3, kills  # ESRCH: not in the namespace
    assert not r.ok and r.signal == "SIGKILL" and r.kind in ("oom", "signal"), r
    os.kill(os.getpid(), 0)  # still alive


def _helper(code: str, env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    """A separate caller process whose exec environment holds the secrets (what /proc/<pid>/environ shows)."""
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


CALLER = """
import json, os, subprocess, sys
from specpilot.tools.sandbox import process as sandbox
mode = {mode!r}
if mode == "fallback":
    sandbox.namespaces = lambda: (False, "toggled off by the test")
cfg = json.loads({cfg!r})
cfg["caller_pid"], cfg["caller_pgid"] = os.getpid(), os.getpgid(0)
code = {probe!r}.format(cfg=json.dumps(cfg))
if mode == "unsandboxed":  # what candidates got before: a plain child
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(json.dumps({{"output": json.loads(p.stdout.strip().splitlines()[-1])}}))
    sys.exit(0)
r = sandbox.run_python(code, {{}}, sandbox.SandboxLimits(wall_s=20, memory_bytes=1 << 30))
left = [e for e in os.listdir(sandbox.temp_root()) if e.startswith(f"{{os.getpid()}}-")]
print(json.dumps({{"output": r.output, "kind": r.kind, "isolation": r.isolation, "left": left}}))
"""


def test_secret_parent_environ_unreadable(hostile):
    """The caller's exec environment holds the secrets; the candidate searches every /proc/*/environ it can see."""
    cfg = dict(hostile, forks=0)
    env = {**os.environ, **SECRETS}
    p = _helper(CALLER.format(mode="sandbox", cfg=json.dumps(cfg), probe=PROBE.replace(
        'attempt("kill_caller"', 'pass  # attempt("kill_caller"').replace(
        'attempt("killpg_caller"', 'pass  # attempt("killpg_caller"')), env)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["kind"] == "ok" and res["left"] == [], res
    assert res["output"]["environ_leaks"] == [] and res["output"]["own_env_leaks"] == []


@pytest.mark.parametrize("mode", ["unsandboxed", "fallback"])
def test_probes_have_teeth(hostile, mode):
    """The same probe without the sandbox finds the caller's secrets (in /proc/<caller>/environ and its own
    environment), reaches the loopback listener and writes outside: the tests above would fail without the defense.
    In the fallback (namespaces toggled off) the allow-list and the dropped capabilities still hold (a process
    without capabilities may not read a privileged process's environ), loopback does not. Kill, fork, daemon and
    shared-path write probes are left out here."""
    own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # not the fixture's listener: that one must stay unreached
    own.bind(("127.0.0.1", 0))
    own.listen(1)
    cfg = dict(hostile, forks=0, port=own.getsockname()[1])
    probe = PROBE.replace('attempt("kill_caller"', 'pass  # ').replace('attempt("killpg_caller"', 'pass  # ')
    probe = probe.replace('attempt("write_tmp"', 'pass  # ').replace('attempt("write_package"', 'pass  # ')
    probe = probe.replace('if os.fork() == 0:\n    try:\n        os.setsid()', 'if False:\n    try:\n        os.setsid()')
    assert 'if False:' in probe
    env = {**os.environ, **SECRETS}
    try:
        p = _helper(CALLER.format(mode=mode, cfg=json.dumps(cfg), probe=probe), env)
    finally:
        own.close()
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])["output"]
    assert out["caller_visible"] and out["loopback"][0] == "ok" and out["external_route"][0] == "ok"
    assert out["write_outside"][0] == "ok"
    if mode == "unsandboxed":
        assert sorted(out["environ_leaks"]) == sorted(SECRETS.values())  # from /proc/<caller>/environ
        assert sorted(out["own_env_leaks"]) == sorted(SECRETS)
    else:
        assert p.stderr.count(sandbox.WARNING) == 1, p.stderr  # the fallback's one warning line
        assert out["environ_leaks"] == [] and out["own_env_leaks"] == []


def test_killed_caller_leaves_nothing(hostile):
    """A caller killed with SIGKILL mid-run: its sandbox dies with it (PDEATHSIG, then the PID namespace), and its
    run directory is swept by the next sandbox start."""
    token = hostile["token"]
    code = (f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)  # {token}\n"
            f"time.sleep(30)  # {token}\nprint('{{}}')")
    caller = ("import sys\nfrom specpilot.tools.sandbox import process as s\n"
              f"s.run_python({code!r}, {{}}, s.SandboxLimits(wall_s=60))\n")
    p = subprocess.Popen([sys.executable, "-c", caller])
    try:
        deadline = time.monotonic() + 10
        while len(_alive_with(token)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_alive_with(token)) >= 2, "the sandboxed child never started"
        left = [e for e in os.listdir(sandbox.temp_root()) if e.startswith(f"{p.pid}-")]
        assert left, "expected the killed caller's run dir to exist until the sweep"
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 5
        while _alive_with(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive_with(token)
        sandbox._sweep.cache_clear()  # what the next process's first sandbox does
        assert not [e for e in os.listdir(sandbox.temp_root()) if e.startswith(f"{p.pid}-")]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# -- the gate's candidate launch path --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.mark.parametrize("mode", ["forkserver", "subprocess"])
def test_gate_candidate_hostile_patch_contained(hostile, tiny_target, tmp_path, monkeypatch, mode):
    """The same probe as a gate candidate's patch file, in the worker after the model is loaded."""
    from specpilot.tools.sandbox.candidate_client import Candidate, CandidateFailure

    if mode == "subprocess":
        monkeypatch.setenv("SPECPILOT_GATE_LAUNCH", "subprocess")
    else:
        monkeypatch.delenv("SPECPILOT_GATE_LAUNCH", raising=False)
    cfg = dict(hostile, to_stderr=True)
    patch = tmp_path / "hostile_patch.py"
    # the probe's setsid daemon outlives the worker unless something kills it: with the fork server, its release
    # (the server's sandbox lives on); in a sandbox of its own, the namespace's end. The fixture checks it is dead.
    tail_code = ("import os\nos.kill(os.getppid(), 9)  # the sandbox's init: ignored\n" if mode == "subprocess" else "")
    patch.write_text(PROBE.format(cfg=json.dumps(cfg)) + tail_code)
    recipe = json.dumps({"name": "t", "drafter": {"kind": "ngram"}, "k": 2})
    cand = Candidate(tiny_target, recipe, "fp32", "cpu", str(patch), timeout_s=60)
    try:
        try:
            tokens, _ = cand.run([[1, 2, 3]], 2)
        except CandidateFailure as e:
            raise AssertionError(f"{e.kind}: {e.message}\n{e.stderr_tail}") from None
        assert len(tokens) == 1  # the worker itself still answers: nothing the probe did broke the sandbox
        tail = cand.stderr_tail()
        assert cand.worker.isolation == {"pid": True, "mount": True, "net": True}
        server = getattr(cand.worker, "server", None)
    finally:
        cand.cleanup()
    if server is not None:
        assert server.proc.poll() is None  # the fork server survived the hostile worker
    assert "HOSTILE " in tail, tail
    out = json.loads(tail.split("HOSTILE ", 1)[1].splitlines()[0])
    check_findings(out, hostile, exact_env=False)


def test_releasing_one_forked_worker_leaves_the_others_running(tiny_target, monkeypatch):
    """The fork server kills what a released worker left behind, but never another worker it still holds: the grid
    gates several candidates at once on one fork server (on the H200 a misread session id made every release kill
    the other live workers: 49 of 60 grid recipes 'crashed: killed by SIGKILL', 2026-12-02)."""
    from specpilot.tools.sandbox.candidate_client import Candidate

    monkeypatch.delenv("SPECPILOT_GATE_LAUNCH", raising=False)
    recipe = json.dumps({"name": "t", "drafter": {"kind": "ngram"}, "k": 2})
    first, second = (Candidate(tiny_target, recipe, "fp32", "cpu", None, timeout_s=60) for _ in range(2))
    try:
        tokens, _ = first.run([[1, 2, 3]], 2)
        assert len(tokens[0]) == 2
        first.cleanup()  # released while the second worker is alive (it may still be loading its model)
        tokens, _ = second.run([[1, 2, 3]], 2)
        assert len(tokens[0]) == 2
        assert second.worker.exit_status() == 0  # its stdin closed, it ended on its own: nobody killed it
    finally:
        first.cleanup()
        second.cleanup()
