"""Sandboxed tools through which agents act: compile, benchmark, profile, token-force check."""
