"""Known-harmless lines that native code writes straight to file descriptor 2, filtered out of our output.

torch.profiler's C++ backend (kineto) logs from C++ to fd 2, which Python's sys.stderr never sees, so neither
warnings filters nor contextlib.redirect_stderr can catch it. Every profiling round printed, on a CPU:

    USDT:2026-12-01 14:55:05 4532:4532 SyncActivityProfilerHandler.cpp:52] profiler_start
    USDT:2026-12-01 14:55:06 4532:4532 SyncActivityProfilerHandler.cpp:59] profiler_stop
    ERROR: External init callback must run in same thread as registerClient (1561413312 != 2131422080)

The USDT lines mark each start and stop (tracing probes' log lines, no problem at all). The ERROR line comes once a
process, when the first profiled session starts on another thread than the one that imported torch (the optimize
graph runs its nodes in worker threads): kineto then initializes on the profiling thread instead, and the profile
is complete (tools/profile/profiler.py reads its events every round). Both alarm a reader for nothing.

`filtered_stderr()` points fd 2 at a temporary file for the duration of a block and afterwards writes back every
line that matches none of HARMLESS, so a real error inside the block still reaches the terminal, only later. Keep
the block short (a profiler's start or stop, not the work it profiles): anything another thread writes to fd 2
meanwhile is held back until the block ends.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

# Each pattern matches one whole line (without its newline) and nothing more general: an unknown line is kept.
HARMLESS = (
    re.compile(rb"USDT:[\d\- :.]+ \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"),
    re.compile(rb"ERROR: External init callback must run in same thread as registerClient \(-?\d+ != -?\d+\)"),
)


def harmless(line: bytes, patterns=HARMLESS) -> bool:
    text = line.rstrip(b"\r\n")
    return any(p.fullmatch(text) for p in patterns)


def kept_lines(data: bytes, patterns=HARMLESS) -> bytes:
    """`data` less its harmless lines; the rest byte for byte, in order (a last line without newline included)."""
    return b"".join(line for line in data.splitlines(keepends=True) if not harmless(line, patterns))


@contextlib.contextmanager
def filtered_stderr(patterns=HARMLESS):
    """Hold fd 2 for the block; then write back what was written to it, less the lines that match `patterns`."""
    sys.stderr.flush()  # what Python buffered before the block belongs before it
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:  # a file, not a pipe: a writer can never block on a full buffer
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = kept_lines(held.read(), patterns)
            while rest:
                rest = rest[os.write(2, rest):]


@contextlib.contextmanager
def quiet_profile(**kwargs):
    """torch.profiler.profile(**kwargs) as a context manager whose start and stop run inside filtered_stderr (the
    work profiled between them writes to stderr as usual)."""
    import torch

    prof = torch.profiler.profile(**kwargs)
    with filtered_stderr():
        prof.__enter__()
    try:
        yield prof
    finally:
        with filtered_stderr():
            prof.__exit__(None, None, None)
