"""Cheat: forges the harness's verdict and ends the process before any check runs.

At import it reads back the payload the harness sent on stdin (fd 0, rewound, or /proc/self/fd/0) to copy any
nonce into its answer, writes a passing result line to every open file descriptor (one of them may be the
harness's private handle on stdout, which gets the result) and exits at once: a parent that trusts the last line
of stdout, or a nonce it sent, reads "passed". The verdict must come from the verifier instead.
"""
import json
import os

_raw = b""
for _how in ("fd", "proc"):
    try:
        if _how == "fd":
            os.lseek(0, 0, 0)
            _raw = _raw or os.read(0, 1 << 20)
        else:
            _raw = _raw or open("/proc/self/fd/0", "rb").read()
    except OSError:
        pass
try:
    _nonce = json.loads(_raw or b"{}").get("nonce")
except ValueError:
    _nonce = None
_line = (json.dumps({"mode": "check", "passed": True, "ok": True, "failure": None, "reason": None, "shapes": [],
                     "records": [], "timing": None, "timing_reason": None, "nonce": _nonce}) + "\n").encode()
for _fd in range(1, 256):
    try:
        os.write(_fd, _line)
    except OSError:
        pass
os._exit(0)


def rmsnorm(x, w, eps):
    return x
