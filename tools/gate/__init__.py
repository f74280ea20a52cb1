"""`specpilot check`, the token-forcing gate (docs/GATE.md): the stock system's reference tokens and tie margins
(reference.py), the comparison with a candidate decoding in its own sandboxed process (check.py) and the verdict's
report (report.py). Imports engine/, kernels/ and tools/sandbox/.
"""
