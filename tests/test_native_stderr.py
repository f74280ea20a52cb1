"""torch.profiler's harmless native log lines are filtered out of our commands' stderr, and nothing else is: a line
that is not on the documented list, written to file descriptor 2 inside the filtered block, still comes through."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from specpilot.tools.profile.native_stderr import filtered_stderr, harmless, kept_lines

USDT_START = b"USDT:2026-12-01 14:55:05 4532:4532 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
USDT_STOP = b"USDT:2026-12-01 14:55:06 4532:4533 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"
INIT = b"ERROR: External init callback must run in same thread as registerClient (1561413312 != 2131422080)\n"


def test_noise_is_dropped_and_a_real_error_survives(capfd):
    print("before", file=sys.stderr)
    with filtered_stderr():
        os.write(2, USDT_START)
        os.write(2, b"ERROR: something real went wrong\n")
        os.write(2, INIT)
        os.write(2, USDT_STOP)
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert err == "before\nERROR: something real went wrong\nafter\n"


def test_patterns_are_narrow():
    assert harmless(USDT_START) and harmless(USDT_STOP) and harmless(INIT)
    assert harmless(b"ERROR: External init callback must run in same thread as registerClient (-17185 != -11467)\n")
    for line in (b"ERROR: External init callback failed\n", b"USDT: profiler_start and then a crash\n",
                 USDT_START.rstrip(b"\n") + b" extra\n", b"Warning: " + INIT):
        assert not harmless(line), line
    assert kept_lines(USDT_START + b"kept\n" + b"no newline at the end") == b"kept\nno newline at the end"


SCRIPT = textwrap.dedent("""
    import os, sys, threading, torch
    from specpilot.tools.profile.native_stderr import quiet_profile

    def run():  # the first profiled session on another thread than torch's import: kineto's ERROR line
        context = quiet_profile if sys.argv[1] == "quiet" else torch.profiler.profile
        with context(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.ones(4).add_(1)
        assert len(prof.events()) > 0
        os.write(2, b"our own line\\n")

    t = threading.Thread(target=run)
    t.start()
    t.join()
    run()
""")


def test_the_profiler_is_quiet_in_a_fresh_process():
    def stderr(mode: str) -> str:
        done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr

    loud, quiet = stderr("loud"), stderr("quiet")
    assert "profiler_start" in loud and "External init callback" in loud  # what the issue saw, reproduced
    assert quiet == "our own line\nour own line\n"
