"""Mechanism memory: verified mechanisms and failures, retrieved by deployment similarity."""
