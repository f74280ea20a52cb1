"""`specpilot bench`: every system side by side in one process on the same prompts (run.py; on CUDA that process is
a worker, worker.py, restarted without a system that kills it or its CUDA context), the engine's and HF
transformers' systems (systems.py, hf_baselines.py), the metrics, the results schema (schema.json) and the report.
engine_bench.py is the bench of engine variants the H200 experiments use; optimize_summary.py puts an optimize run
next to a bench of its recipe. Imports engine/ only (and tools/argtypes.py).
"""
