"""The guard every kernel benchmark starts with: speed is timed from compiled kernels on a CUDA GPU, never on the CPU
and never under Triton's interpreter (TRITON_INTERPRET=1), whose timings mean nothing."""
from __future__ import annotations

import torch


def require_gpu_compiled(kernel) -> None:
    """Raise RuntimeError unless a CUDA GPU is present and `kernel` (a @triton.jit function) is compiled, not
    interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    if not torch.cuda.is_available() or isinstance(kernel, InterpretedFunction):
        raise RuntimeError("benchmark() times compiled kernels on a CUDA GPU; this process has no GPU or runs "
                           "Triton's interpreter (TRITON_INTERPRET=1)")
