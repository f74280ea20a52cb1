"""Cheat: forges the harness's verdict and ends the process before any check runs.

At import it writes a passing result line to every open file descriptor (one of them is the harness's private
handle on stdout, which gets the result) and exits at once: a parent that trusts the last line of stdout reads
"passed".
"""
import json
import os

_line = (json.dumps({"mode": "check", "passed": True, "failure": None, "reason": None, "shapes": [],
                     "timing": None, "timing_reason": None}) + "\n").encode()
for fd in range(3, 256):
    try:
        os.write(fd, _line)
    except OSError:
        pass
os._exit(0)


def rmsnorm(x, w, eps):
    return x
