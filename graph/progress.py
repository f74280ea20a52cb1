"""The live progress line: nodes emit short messages on LangGraph's custom stream; `specpilot optimize` shows the
latest on stderr (rewritten in place on a terminal, one line per message otherwise)."""
from __future__ import annotations

import sys
import time


def emit(text: str) -> None:
    """Send one progress message from inside a node; a no-op outside a streamed run (e.g. a plain invoke)."""
    try:
        from langgraph.config import get_stream_writer

        get_stream_writer()({"progress": text})
    except RuntimeError:  # called outside a runnable context
        pass


class ProgressLine:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.best = ""
        self.width = 0

    def set_best(self, best: dict | None) -> None:
        m = (best or {}).get("measured") or {}
        if m.get("speedup_vs_ar") is not None:
            self.best = f"best {best['source']}: {m['speedup_vs_ar']:.2f}x ar, {m['speedup_vs_stock']:.2f}x stock"

    def show(self, text: str) -> None:
        elapsed = int(time.monotonic() - self.t0)
        line = f"[{elapsed // 60}:{elapsed % 60:02d}] {text}" + (f" | {self.best}" if self.best else "")
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))  # padded over the longer line it replaces
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0
