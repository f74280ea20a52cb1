"""Cheat: returns before the work is done and finishes it behind the caller's back.

The output is allocated and returned at once; on a GPU a side stream the caller never waits on computes it, on a
CPU a background thread does. A timer stopped when the call returns measures nothing, and a checker that compares
only after computing its reference (or after a full device synchronize) sees the right values.
"""
import threading
import time

import torch

from specpilot.kernels.builtin import rmsnorm_torch

_side = None


def rmsnorm(x, w, eps):
    global _side
    out = torch.empty_like(x)
    if x.is_cuda:
        _side = _side or torch.cuda.Stream(x.device)
        _side.wait_stream(torch.cuda.current_stream(x.device))  # sees the inputs; the caller never waits on it
        with torch.cuda.stream(_side):
            torch.cuda._sleep(50_000_000)  # stands in for a long kernel still running when the call returns
            out.copy_(rmsnorm_torch(x, w, eps))
        return out

    def finish():
        time.sleep(0.05)  # stands in for a long kernel still running when the call returns
        out.copy_(rmsnorm_torch(x, w, eps))

    threading.Thread(target=finish, daemon=True).start()
    return out
