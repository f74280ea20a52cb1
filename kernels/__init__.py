"""Kernel slots: named points where the engine calls a kernel, and their implementations."""
