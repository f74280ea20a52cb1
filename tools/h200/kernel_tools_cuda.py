"""Issue #5 on the H200: the kernel tools' CUDA-only tests (tests/test_kernel_tools.py, skipped in CI), each called
as a plain function, since the device image has neither pytest nor jsonschema.
- pytest (pure Python) is carried in the ignored .gpu/pylibs, copied from the local install: the test module needs
  it for its decorators.
- jsonschema cannot be carried: it needs rpds-py, a compiled extension built for another Python. The test module
  imports it at the top but uses it only in its CPU tests of the tool specs, none of which run here. So, where it is
  missing, an empty module stands in for it, and any use of it would fail loudly with an AttributeError.
"""
import importlib.util
import sys
import time
import traceback
import types

if importlib.util.find_spec("jsonschema") is None:
    sys.modules["jsonschema"] = types.ModuleType("jsonschema")
sys.path.insert(0, "tests")
import test_kernel_tools as T  # noqa: E402

cases = [("test_cuda_honest_kernel_is_timed_over_inputs_larger_than_l2", T.test_cuda_honest_kernel_is_timed_over_inputs_larger_than_l2, ())]
cases += [(f"test_cuda_cheat_is_rejected[{n}]", T.test_cuda_cheat_is_rejected, (n,)) for n in T.CUDA_CHEATS]
cases += [("test_cuda_compile_reports_registers_and_shared_memory", T.test_cuda_compile_reports_registers_and_shared_memory, ())]
failed = 0
for name, fn, args in cases:
    t = time.perf_counter()
    try:
        fn(*args)
        print(f"PASS {name} ({time.perf_counter() - t:.1f} s)", flush=True)
    except Exception:
        failed += 1
        print(f"FAIL {name} ({time.perf_counter() - t:.1f} s)\n{traceback.format_exc()[-1500:]}", flush=True)
print(f"{len(cases) - failed} passed, {failed} failed")
