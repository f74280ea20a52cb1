"""Where candidate code runs (docs/SANDBOX.md): the sandboxed child process (process.py), the gate's candidate
worker and the fork server that starts it (candidate_*.py), and the kernel check that runs a candidate kernel
against its slot's contract inside the sandbox (kernel_check.py). Imports engine/ and kernels/ only.
"""
