"""The sandboxed tools through which agents act, and the measurements they rest on. One subpackage a concern:

- `bench/`: `specpilot bench` (systems side by side in one process) and its HF baselines, metrics and report;
- `gate/`: `specpilot check`, the token-forcing gate (the stock system's reference, the verdict, the report);
- `grid/`: `specpilot grid`, the yardstick: a declared space of recipes expanded, gated and benched side by side;
- `profile/`: the cost model, device calibration, the profiler and the step/kernel statistics it reads;
- `sandbox/`: where candidate code runs (the sandboxed process, the gate's candidate worker, the kernel check);
- `train/`: `specpilot train-drafter`, an EAGLE-3 head trained from the target alone (docs/TRAINING.md);
- `agent_tools.py`: the tools the agents call (compile, benchmark a kernel or a recipe, token-force check, profile),
  each a plain function over the subpackages above with its JSON schema;
- `argtypes.py`: command-line value checks shared by every command.

Imports go down only: tools may import engine/ and kernels/, never graph/, memory/, prompts/ or the CLI; inside
tools, gate/ uses sandbox/, grid/ uses bench/ and gate/, and agent_tools.py uses bench/, gate/, profile/ and sandbox/, and no subpackage imports agent_tools.py.
"""
