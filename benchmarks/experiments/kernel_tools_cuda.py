"""The kernel tools' CUDA-only tests as plain calls: honest timing, cheats rejected, compile reports.

What it checks (tests/test_kernel_tools.py, each test called as a function, since the device image lacks
jsonschema): an honest rmsnorm is timed over rotated inputs larger than L2; every GPU cheat of
tests/cheating_kernels (work deferred to a side stream, stale `torch.empty` memory, skipped timed calls, a patched
`torch.cuda.Event`, ...) is rejected with its reason; `compile_triton` reports a compiled kernel's registers, spills
and shared memory. The test module imports jsonschema only for its CPU tests: where it is missing, an empty module
stands in for it (any use would fail loudly).

Backs docs/BENCHMARKS.md's line that the kernel tools hold on CUDA (docs/SANDBOX.md): the sixth lease's call F
(then kernel_tools_cuda.py), docs/benchmarks/2026-11-29-sixth-lease.md.

Device minutes: about 1.
"""
from __future__ import annotations

import importlib.util
import sys
import time
import traceback
import types

import harness

MINUTES = 1
CUDA_ONLY = True


def run(out_dir, args):
    if importlib.util.find_spec("jsonschema") is None:
        sys.modules["jsonschema"] = types.ModuleType("jsonschema")
    sys.path.insert(0, str(harness.ROOT / "tests"))
    import test_kernel_tools as T

    cases = [("test_cuda_honest_kernel_is_timed_over_inputs_larger_than_l2",
              T.test_cuda_honest_kernel_is_timed_over_inputs_larger_than_l2, ())]
    cases += [(f"test_cuda_cheat_is_rejected[{n}]", T.test_cuda_cheat_is_rejected, (n,)) for n in T.CUDA_CHEATS]
    cases += [("test_cuda_compile_reports_registers_and_shared_memory",
               T.test_cuda_compile_reports_registers_and_shared_memory, ())]
    if args.smoke:
        cases = cases[:1]
    results = []
    for name, fn, fn_args in cases:
        t = time.perf_counter()
        try:
            fn(*fn_args)
            results.append({"test": name, "passed": True, "seconds": round(time.perf_counter() - t, 1)})
        except Exception:
            results.append({"test": name, "passed": False, "seconds": round(time.perf_counter() - t, 1),
                            "error": traceback.format_exc()[-1500:]})
        print(f"{'PASS' if results[-1]['passed'] else 'FAIL'} {name} ({results[-1]['seconds']} s)", flush=True)
    failed = sum(not r["passed"] for r in results)
    table = harness.md_table(["test", "result", "s"], [[r["test"], "pass" if r["passed"] else "**FAIL**",
                                                        r["seconds"]] for r in results])
    return {"ok": not failed, "tests": results}, table + f"\n\n{len(results) - failed} passed, {failed} failed."
