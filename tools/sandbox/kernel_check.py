"""The harness that checks a candidate kernel against its slot's contract (kernels/slots.py): the candidate's side,
which runs in the sandbox, and the verifier's side, which runs in the caller and never loads candidate code.

    python -m specpilot.tools.sandbox.kernel_check      (payload JSON on stdin; the result is the last line on stdout)

tools/agent_tools.py starts it through tools/sandbox/process.run_python. Modes:
- check (run_check, in the sandbox): load the candidate source (a file defining a function named after the slot),
  call it on inputs generated from the payload's seed, with the defenses that must run next to the kernel (poison
  left in memory, plain tensors, fresh memory, inputs untouched, nothing written after return, nobody replacing
  the harness's functions), and on CUDA time it. It returns the OUTPUTS (and the hashes of the inputs after each
  call); it computes no reference, knows no tolerance and gives no verdict.
- verify (in the caller): regenerate the same inputs from the seed, compute the contract's reference (fp64 / fp32),
  apply the contract's tolerance and decide. Nothing the candidate's process says can make a candidate pass: only
  outputs that are right for the verifier's own inputs do.
- compile: import a Triton source and, when it defines `_launch_example()`, launch it once; report the compiled
  kernels' registers, spills and shared memory.

Each defense, and the failure code it reports, is listed in docs/TOOLS.md.
"""
from __future__ import annotations

import base64
import builtins
import ctypes
import hashlib
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
import types
import zlib
from pathlib import Path

import torch
import torch.nn.functional

from ... import kernels
from ...engine.loader import DTYPES
from ...kernels import builtin, slots

TRACE_TAIL = 1500  # characters of a candidate's traceback kept in a reason
CALLS = 4  # checked calls per shape: two sets of fresh inputs, then each set's buffers refilled with new values
# How long the harness waits for work a candidate left running (threads, other streams) before it looks at an
# output again: kernels take microseconds to milliseconds, so this is far above any honest straggler.
SETTLE_S = 0.25
# Timed calls after warm-up calls; the rotated input sets add up to at least l2_multiple times the L2 cache, so
# each call reads its inputs from device memory as in the engine, not from a cache left warm by the previous call.
TIMING = {"warmup": 10, "runs": 100, "l2_multiple": 2}

# The harness's own handles, taken before any candidate code runs: it calls these, never the public names.
Tensor = torch.Tensor
perf_counter, sleep = time.perf_counter, time.sleep
isfinite, equal, empty = torch.isfinite, torch.equal, torch.empty
Event, cuda_synchronize = torch.cuda.Event, torch.cuda.synchronize
_getattr, _vars, _type, _isinstance = builtins.getattr, builtins.vars, builtins.type, builtins.isinstance
function_modes, dispatch_modes = torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack
gettrace, getprofile = sys.gettrace, sys.getprofile
_sha256, _compress = hashlib.sha256, zlib.compress

# Namespaces whose callables the harness, the references and the timer use (time.perf_counter, torch.allclose,
# torch.testing.assert_close, torch.equal, torch.isfinite, torch.cuda.Event and .synchronize among them): every
# callable in them is recorded by identity, and Python functions also by their code object.
GUARDED_NAMESPACES = (time, json, builtins, math, torch, torch.nn.functional, torch.Tensor, torch._C.TensorBase,
                      torch.testing, torch.cuda, torch.cuda.Event, sys.modules[__name__], slots, builtin, kernels,
                      hashlib, zlib, base64)
# Importing torch._dynamo (a candidate using torch.compile does) wraps torch.manual_seed; the harness seeds its own
# generators and never calls it.
UNGUARDED = {(torch, "manual_seed")}

# Every byte of poisoned memory: a NaN in fp16, -1.7e38 in bf16 and fp32, a negative integer in int64. No correct
# kernel writes that element (outputs are of order one, token ids and counts are not negative), so finding it in an
# output means the kernel returned memory it never wrote.
POISON_BYTE = 0xFE
M_PERTURB = -6  # glibc's mallopt parameter (malloc.h): fill allocations with ~byte and freed memory with byte
BITS_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Rejected(Exception):
    """The candidate fails the contract: `code` names the defense that caught it (docs/TOOLS.md), `reason` says how."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


# -- guards -------------------------------------------------------------------------------------------------------

class Guard:
    """Identities of every callable in GUARDED_NAMESPACES and of the contract under test, taken at construction."""

    def __init__(self, contract: slots.SlotContract):
        self.entries = []
        for ns in GUARDED_NAMESPACES:
            label = _getattr(ns, "__name__", repr(ns))
            for name, obj in list(_vars(ns).items()):
                if callable(obj) and (ns, name) not in UNGUARDED:
                    self.entries.append((ns, name, obj, _getattr(obj, "__code__", None), f"{label}.{name}"))
        for name in contract.__dataclass_fields__:
            obj = _getattr(contract, name)
            self.entries.append((contract, name, obj, _getattr(obj, "__code__", None), f"contract.{name}"))

    def tampered(self) -> list[str]:
        changed = []
        for ns, name, obj, code, label in self.entries:
            # modules and classes by their namespace (no descriptor runs), the contract by attribute
            namespace = _isinstance(ns, (types.ModuleType, type))
            now = _vars(ns).get(name) if namespace else _getattr(ns, name, None)
            if now is not obj or (code is not None and _getattr(obj, "__code__", None) is not code):
                changed.append(label)
        if function_modes() or dispatch_modes():
            changed.append("the torch function/dispatch mode stack (a mode intercepts every torch call)")
        if gettrace() is not None or getprofile() is not None:
            changed.append("sys.settrace/sys.setprofile (a hook sees and can alter the harness's frames)")
        return changed


def check_guards(tampered, when: str) -> None:
    changed = tampered()
    if changed:
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise Rejected("tampered", f"{when}, the candidate had replaced {shown}")


# -- memory -------------------------------------------------------------------------------------------------------

def poison_value(dtype: torch.dtype) -> int:
    """The poisoned element of `dtype` as the signed integer of its bits."""
    return int.from_bytes(bytes([POISON_BYTE]) * dtype.itemsize, "little", signed=True)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS_VIEW[t.element_size()])


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    t = empty(shape, dtype=dtype, device=device)
    as_bits(t).fill_(poison_value(dtype))
    return t


def holds_poison(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool((as_bits(t) == poison_value(t.dtype)).any())


def poison_fresh_cpu_memory() -> bool:
    """Have glibc fill every allocation with POISON_BYTE (M_PERTURB; freed memory gets the complement), so that CPU
    memory a kernel never writes holds the poison whichever block the allocator picks. False where not glibc."""
    try:
        return ctypes.CDLL(None).mallopt(M_PERTURB, POISON_BYTE ^ 0xFF) == 1
    except (OSError, AttributeError):
        return False


def leave_poison(expected: list[tuple[torch.Size, torch.dtype]], device) -> None:
    """Allocate poisoned buffers of the outputs' sizes and free them: the CUDA caching allocator hands that block to
    the candidate's next allocation of the size, so an output it never writes shows the poison, not stale data."""
    for shape, dtype in expected:
        poisoned(shape, dtype, device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN equals the same NaN, -0.0 differs from 0.0): has anything written this memory?"""
    return equal(as_bits(a), as_bits(b))


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def sync_current_stream(device: torch.device) -> None:
    """What a caller of the slot waits for: the current stream only (work left on other streams is not waited on)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def settle(device: torch.device, settle_s: float) -> None:
    """Let work a candidate left running (other streams, threads) finish: every stream, then a pause for threads."""
    if device.type == "cuda":
        cuda_synchronize(device)
    sleep(settle_s)


# -- one checked call ---------------------------------------------------------------------------------------------

def as_outputs(out) -> list:
    return list(out) if _type(out) is tuple else [out]


def expected_outputs(contract: slots.SlotContract, inputs: tuple) -> list[tuple[torch.Size, torch.dtype]]:
    return [(torch.Size(shape), dtype) for shape, dtype in contract.outputs(*inputs)]


def check_types(out, expected, device: torch.device, where: str) -> list[torch.Tensor]:
    """Plain tensors of the right shape, dtype and device: a subclass or lazy object could compute when read."""
    if len(expected) > 1 and (_type(out) is not tuple or len(out) != len(expected)):
        raise Rejected("bad_type", f"{where}: returned {_type(out).__name__}, not a tuple of {len(expected)} "
                                   f"plain tensors")
    outs = list(out) if len(expected) > 1 else [out]
    for i, (o, (shape, dtype)) in enumerate(zip(outs, expected)):
        name = f"output {i}" if len(expected) > 1 else "the output"
        if _type(o) is not Tensor:
            raise Rejected("bad_type", f"{where}: {name} is a {_type(o).__module__}.{_type(o).__qualname__}, not a "
                                       f"plain torch.Tensor (a subclass or lazy object can defer work to when it "
                                       f"is read)")
        if o.layout != torch.strided or o.requires_grad:
            raise Rejected("bad_type", f"{where}: {name} is not a plain strided tensor without autograd history")
        if o.shape != shape or o.dtype != dtype or o.device != device:
            raise Rejected("bad_shape", f"{where}: {name} is {tuple(o.shape)} {o.dtype} on {o.device}, expected "
                                        f"{tuple(shape)} {dtype} on {device}")
    return outs


def check_fresh_memory(outs: list[torch.Tensor], held: list, where: str) -> None:
    """Every call's output lives in its own memory: the engine keeps several outputs of a slot alive at once (the
    q and k norms of a layer), so returning an earlier output again, rewritten or not, corrupts it."""
    for o in outs:
        lo, hi = storage_span(o)
        for earlier in held:
            for e in earlier["outputs"]:
                elo, ehi = storage_span(e)
                if lo < ehi and elo < hi:
                    raise Rejected("reused_output", f"{where}: returned memory of the output of "
                                                    f"{earlier['where']} (the same output object or buffer for "
                                                    f"different inputs: a cached or skipped call)")


def check_inputs_untouched(inputs: tuple, pristine: tuple, names: list[str], where: str) -> None:
    for name, now, before in zip(names, inputs, pristine):
        if isinstance(now, Tensor) and not same_bits(now, before):
            raise Rejected("wrote_input", f"{where}: the candidate modified its input {name} (a checker computing "
                                          f"the reference afterwards would compare against altered inputs)")


def compare(outs: list[torch.Tensor], refs: list[torch.Tensor], tol: tuple[float, float]) -> dict:
    """Elements outside atol + rtol |ref| (integer outputs: atol = rtol = 0, so any difference), max |out - ref|,
    and for float outputs the worst ratio of error to that allowance (<= 1 everywhere passes)."""
    atol, rtol = tol
    report = {"ok": True, "mismatches": 0, "max_abs_err": 0.0, "worst_ratio": 0.0, "atol": atol, "rtol": rtol}
    for o, r in zip(outs, refs):
        if o.numel() == 0:
            continue
        err = (o.double() - r.double()).abs()
        allowed = atol + rtol * r.double().abs()
        report["mismatches"] += int((~(err <= allowed)).sum())  # NaN counts as a mismatch
        report["max_abs_err"] = max(report["max_abs_err"], float(err.max()))
        if o.dtype.is_floating_point:
            report["worst_ratio"] = max(report["worst_ratio"], float((err / allowed).max()))
    report["ok"] = report["mismatches"] == 0
    return report


def wrong_values(where: str, result: dict, refilled: bool = False) -> tuple[str, str]:
    err = (f"{result['mismatches']} elements outside atol {result['atol']:.3g} + rtol {result['rtol']:.3g} |ref|, "
           f"max |error| {result['max_abs_err']:.3g}")
    if refilled:
        return "wrong_after_refill", (f"{where}: wrong values after the same input buffers were refilled with new "
                                      f"values, right on fresh buffers (a result cached by input address or "
                                      f"shape?): {err}")
    return "wrong_values", f"{where}: wrong values: {err}"


# -- the candidate's side: run it near the kernel, return its outputs ---------------------------------------------

def tensor_sha(t: torch.Tensor) -> str:
    """sha256 of a tensor's values (its elements in order, bit for bit), whatever its strides or device."""
    return _sha256(as_bits(t.detach().contiguous()).cpu().numpy().tobytes()).hexdigest()


def input_shas(inputs: tuple) -> list[str | None]:
    return [tensor_sha(t) if isinstance(t, Tensor) else None for t in inputs]


def checked_call(fn, contract: slots.SlotContract, inputs: tuple, device: torch.device, where: str, held: list,
                 tampered, record: dict) -> dict:
    """Call the candidate once, with the checks that must run next to the kernel (poison left in memory, plain
    tensors of the contract's shape, fresh memory, inputs untouched), and return `record` with the output as the
    caller saw it when the call returned and the hashes of the inputs after the call. No reference is computed
    here: the verifier, in another process, decides."""
    names = list(inspect.signature(contract.builtin).parameters)
    expected = expected_outputs(contract, inputs)
    pristine = tuple(t.clone() if isinstance(t, Tensor) else t for t in inputs)
    sync_current_stream(device)
    leave_poison(expected, device)
    try:
        out = fn(*inputs)
    except BaseException as e:  # SystemExit included: a kernel must return
        tail = "".join(traceback.format_exception(e))[-TRACE_TAIL:]
        raise Rejected("raised", f"{where}: the candidate raised {_type(e).__name__}: {e}\n{tail}") from None
    sync_current_stream(device)
    check_guards(tampered, f"after {where}")
    outs = check_types(out, expected, device, where)
    snapshot = [o.clone() for o in outs]  # what the caller sees when the call returns
    check_fresh_memory(outs, held, where)
    check_inputs_untouched(inputs, pristine, names, where)
    held.append({"outputs": outs, "snapshot": snapshot, "where": where})
    return {**record, "where": where, "snapshot": snapshot, "outs": outs, "input_sha": input_shas(inputs)}


def check_unchanged_after_return(outs: list[torch.Tensor], snapshot: list[torch.Tensor], where: str) -> None:
    if not all(same_bits(o, s) for o, s in zip(outs, snapshot)):
        raise Rejected("deferred", f"{where}: the output changed after the call returned (work left running on "
                                   f"another stream or thread: the call's time does not include it)")


def call_plan(calls: int) -> list[tuple[int, bool, str]]:
    """(input set, refill in place first, description) per call: two sets of fresh inputs in turn, then the same
    buffers again holding new values (a kernel that caches by pointer or shape returns the old answer). Call i
    gets the i-th draw of the shape's input generator."""
    plan = []
    for i in range(calls):
        refill = i >= 2
        what = (f"set {i % 2 + 1}'s input buffers refilled in place with new values" if refill
                else "fresh inputs")
        plan.append((i % 2, refill, what))
    return plan


def refill(inputs: tuple, fresh: tuple) -> None:
    """New values into the same memory. Through the storage where the layouts agree: an input may be a view that
    cannot be written element by element (the decode step's mask is expanded, with a stride of 0)."""
    for t, f in zip(inputs, fresh):
        if not isinstance(t, Tensor):
            continue
        same_layout = (t.stride() == f.stride() and t.storage_offset() == f.storage_offset()
                       and t.untyped_storage().nbytes() == f.untyped_storage().nbytes())
        if same_layout:
            t.untyped_storage().copy_(f.untyped_storage())
        else:
            t.copy_(f)


def check_seed(seed: int, n: int) -> int:
    """The seed of shape n's checked calls (the verifier regenerates the same inputs from it)."""
    return seed + n


def timing_seed(seed: int, n: int) -> int:
    return seed + 1000 + n


def check_shapes(fn, contract, shapes, dtype, device, calls, seed, tampered, held) -> list[dict]:
    records = []
    for n, shape in enumerate(shapes):
        gen = torch.Generator().manual_seed(check_seed(seed, n))
        sets = [contract.make_inputs(shape, dtype, device, gen) for _ in range(2)]
        for i, (s, refill_first, what) in enumerate(call_plan(calls)):
            if refill_first:
                refill(sets[s], contract.make_inputs(shape, dtype, device, gen))
            where = f"call {i + 1} of {calls} on shape {shape} ({what})"
            records.append(checked_call(fn, contract, sets[s], device, where, held, tampered,
                                        {"shape": n, "seed": check_seed(seed, n), "draw": i,
                                         "refilled": refill_first}))
    return records


def recheck_held(held: list, device: torch.device, settle_s: float) -> None:
    """Every output again, after everything settled: one that changed was still being written when checked."""
    settle(device, settle_s)
    for h in held:
        check_unchanged_after_return(h["outputs"], h["snapshot"], h["where"])


# -- timing (CUDA only) -------------------------------------------------------------------------------------------

def timing_refusal(device: torch.device) -> str | None:
    if device.type != "cuda":
        return (f"timing needs a CUDA device; this check ran on {device.type}, where a Triton kernel runs in the "
                f"interpreter and a time says nothing about the GPU kernel")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "timing refused under TRITON_INTERPRET=1: the interpreter's times say nothing about the GPU kernel"
    return None


def input_bytes(inputs: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, Tensor))


def timed_loop(fn, sets: list[tuple], warmup: int, runs: int, keep: set[int], device: torch.device,
               scratch: torch.Tensor | None):
    """Per-call times from CUDA events around each call on the current stream, each call on the next input set
    (with `scratch` written before each timed call, outside the events, when the sets alone do not exceed the L2
    cache), and the outputs of the calls in `keep`."""
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    cuda_synchronize(device)
    starts = [Event(enable_timing=True) for _ in range(runs)]
    ends = [Event(enable_timing=True) for _ in range(runs)]
    kept = {}
    for i in range(runs):
        args = sets[(warmup + i) % len(sets)]
        if scratch is not None:
            scratch.zero_()
        starts[i].record()
        out = fn(*args)
        ends[i].record()
        if i in keep:
            kept[i] = out
    cuda_synchronize(device)
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)], kept


def wall_per_call(fn, sets: list[tuple], runs: int, device: torch.device) -> float:
    """Microseconds per call of `runs` back-to-back calls, every stream synchronized at the end: work a kernel
    leaves on another stream counts here, where the current stream's events miss it."""
    cuda_synchronize(device)
    t0 = perf_counter()
    for i in range(runs):
        fn(*sets[i % len(sets)])
    cuda_synchronize(device)
    return (perf_counter() - t0) / runs * 1e6


def timed_record(contract, out, inputs: tuple, pristine: tuple, device, where: str, timed_held: list,
                 record: dict) -> dict:
    expected = expected_outputs(contract, inputs)
    outs = check_types(out, expected, device, where)
    check_fresh_memory(outs, timed_held, where)
    check_inputs_untouched(inputs, pristine, list(inspect.signature(contract.builtin).parameters), where)
    timed_held.append({"outputs": outs, "where": where})
    return {**record, "where": where, "snapshot": [o.clone() for o in outs], "outs": outs,
            "input_sha": input_shas(inputs)}


def time_shape(fn, contract, shape, n, dtype, device, seed, opts, tampered, held) -> tuple[dict, list[dict]]:
    """Median time of the candidate and of the built-in, each call on its own input set and no set still in the
    L2 cache from its last use (the sets together exceed L2 `l2_multiple` times, or L2 is overwritten before each
    call); the outputs of calls at the start, middle and end of the loop, and of one more call after the loop, go
    to the verifier with the rest. Input set j is draw j of the generator seeded with `seed`; the call after the
    loop gets draw `input_sets`."""
    gen = torch.Generator().manual_seed(seed)
    first = contract.make_inputs(shape, dtype, device, gen)
    warmup, runs = opts["warmup"], opts["runs"]
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    flush_bytes = math.ceil(opts["l2_multiple"] * l2)
    n_sets = min(warmup + runs, max(2, math.ceil(flush_bytes / max(1, input_bytes(first)))))
    sets = [first] + [contract.make_inputs(shape, dtype, device, gen) for _ in range(n_sets - 1)]
    scratch = empty(flush_bytes, dtype=torch.uint8, device=device) if n_sets * input_bytes(first) < flush_bytes \
        else None
    rng = random.Random(seed)
    keep = {0, runs // 2, runs // 2 + 1, runs - 1, rng.randrange(runs)}  # consecutive pair: every-other-call skips
    set_of = {i: (warmup + i) % n_sets for i in keep}
    pristine = {k: tuple(t.clone() if isinstance(t, Tensor) else t for t in sets[k]) for k in set_of.values()}
    try:
        times, kept = timed_loop(fn, sets, warmup, runs, keep, device, scratch)
        wall_us = wall_per_call(fn, sets, runs, device)
    except BaseException as e:
        raise Rejected("raised", f"timing loop on shape {shape}: the candidate raised {_type(e).__name__}: {e}")
    check_guards(tampered, f"after the timing loop on shape {shape}")
    timed_held: list = []
    records = [timed_record(contract, kept[i], sets[set_of[i]], pristine[set_of[i]], device,
                            f"timed call {i + 1} of {runs} on shape {shape}", timed_held,
                            {"shape": n, "seed": seed, "draw": set_of[i], "refilled": False, "timed": True})
               for i in sorted(kept)]
    refill(sets[0], contract.make_inputs(shape, dtype, device, gen))
    records.append(checked_call(fn, contract, sets[0], device, f"the call after the timing loop on shape {shape}",
                                held, tampered, {"shape": n, "seed": seed, "draw": n_sets, "refilled": True,
                                                 "timed": True}))
    base_times, _ = timed_loop(contract.builtin, sets, warmup, runs, set(), device, scratch)
    median, base_median = statistics.median(times), statistics.median(base_times)
    return ({"shape": shape, "median_us": median, "min_us": min(times), "runs": runs, "warmup": warmup,
             "wall_us_per_call": wall_us, "input_sets": n_sets, "bytes_rotated": n_sets * input_bytes(first),
             "l2_bytes": l2, "l2_overwritten_between_calls": scratch is not None,
             "builtin_median_us": base_median, "speedup_vs_builtin": base_median / median}, records)


# -- encoding outputs for the verifier ----------------------------------------------------------------------------

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


def encode_tensor(t: torch.Tensor) -> dict:
    raw = as_bits(t.detach().contiguous()).cpu().numpy().tobytes()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(_compress(raw, 1)).decode("ascii")}


def decode_tensor(d: dict) -> torch.Tensor:
    """The inverse of encode_tensor, without pickle (a candidate may have written this): raises ValueError on
    anything malformed."""
    dtype = WIRE_DTYPES.get(d.get("dtype")) if isinstance(d, dict) else None
    shape = d.get("shape") if dtype is not None else None
    if dtype is None or not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError("malformed tensor")
    numel = math.prod(shape)
    raw = zlib.decompressobj().decompress(base64.b64decode(d["data"], validate=True), numel * dtype.itemsize + 1)
    if len(raw) != numel * dtype.itemsize:
        raise ValueError("tensor data of the wrong size")
    bits = BITS_VIEW[dtype.itemsize]
    flat = torch.frombuffer(bytearray(raw), dtype=bits) if raw else torch.empty(0, dtype=bits)
    return flat.view(dtype).reshape(shape)


def encode_records(records: list[dict]) -> list[dict]:
    """The outputs as the caller saw them at return, and the hashes of the live outputs now (after everything
    settled: the verifier compares them with the snapshot's)."""
    return [{k: v for k, v in r.items() if k not in ("snapshot", "outs")}
            | {"outputs": [encode_tensor(s) for s in r["snapshot"]], "final_sha": [tensor_sha(o) for o in r["outs"]]}
            for r in records]


# -- entry points (the candidate's process) -----------------------------------------------------------------------

def write_candidate(source: str, name: str) -> Path:
    """A real file: Triton reads a @triton.jit function's source back from it."""
    path = Path.cwd() / name
    path.write_text(source)
    return path


def run_check(payload: dict) -> dict:
    """Load the candidate, call it on the inputs regenerated from the payload's seed, return its outputs. `passed`
    is never set here: a result from this process is what the candidate's process said; verify() decides."""
    t0 = perf_counter()
    slot, dtype_name, device_name = payload["slot"], payload.get("dtype", "fp32"), payload.get("device", "cpu")
    result = {"mode": "check", "slot": slot, "dtype": dtype_name, "device": device_name, "failure": None,
              "reason": None, "records": [], "timing": None, "timing_reason": None}
    contract = slots.CONTRACTS.get(slot)
    dtype = DTYPES.get(dtype_name)
    if contract is None or dtype not in (contract.dtypes if contract else ()):
        result.update(failure="bad_request", reason=f"unknown slot {slot!r} or dtype {dtype_name!r} for it")
        return result
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        result.update(failure="bad_request", reason="device cuda asked for, but no CUDA device is available")
        return result
    if device.type == "cuda" and device.index is None:  # tensors report cuda:N; outputs are compared with this
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the candidate can import triton
        result["cpu_memory_poisoned"] = poison_fresh_cpu_memory()
    shapes = payload.get("shapes") or contract.shapes
    seed, calls, settle_s = payload.get("seed", 0), payload.get("calls", CALLS), payload.get("settle_s", SETTLE_S)
    tampered = Guard(contract).tampered  # a bound method: replacing Guard.tampered later does not reach it
    held: list = []
    records: list = []
    try:
        try:
            path = write_candidate(payload["source"], f"candidate_{slot}.py")
            fn = kernels.load_candidate(slot, path)
        except BaseException as e:  # a SyntaxError, an ImportError, a missing function, an exit
            tail = "".join(traceback.format_exception(e))[-TRACE_TAIL:]
            raise Rejected("load_error", f"loading the candidate failed: {_type(e).__name__}: {e}\n{tail}") from None
        check_guards(tampered, "after loading")
        records += check_shapes(fn, contract, shapes, dtype, device, calls, seed, tampered, held)
        recheck_held(held, device, settle_s)
        check_guards(tampered, "at the end of the correctness checks")
        refusal = timing_refusal(device) if payload.get("timing", True) else "timing not asked for"
        result["timing_reason"] = refusal
        if refusal is None:
            opts = {**TIMING, **payload.get("timing_options", {})}
            timing = []
            for n, shape in enumerate(shapes):
                t, recs = time_shape(fn, contract, shape, n, dtype, device, timing_seed(seed, n), opts, tampered,
                                     held)
                timing.append(t)
                records += recs
            result["timing"] = timing
            recheck_held(held, device, settle_s)
            check_guards(tampered, "after timing")
        settle(device, 0.0)
        result["records"] = encode_records(records)
    except Rejected as r:
        result.update(failure=r.code, reason=r.reason)
    result["seconds"] = perf_counter() - t0
    return result


# -- the verifier's side: never loads candidate code --------------------------------------------------------------

def regenerate(contract: slots.SlotContract, shape: dict, dtype: torch.dtype, seed: int, draws: set[int]
               ) -> dict[int, tuple]:
    """The inputs of the given draws of the generator seeded with `seed`, made on the CPU: make_inputs draws its
    values on the generator's device (the CPU) and then casts them, so they are the candidate's, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    cpu = torch.device("cpu")
    return {d: inputs for d in range(max(draws) + 1)
            for inputs in [contract.make_inputs(shape, dtype, cpu, gen)] if d in draws}


def expected_records(payload: dict, shapes: list[dict], child: dict) -> list[tuple[int, int, int, bool]]:
    """(shape, seed, draw, timed) of every output the verifier insists on: every checked call of every shape, and
    on a timed run the call after each shape's timing loop."""
    seed, calls = payload["seed"], payload.get("calls", CALLS)
    want = [(n, check_seed(seed, n), i, False) for n in range(len(shapes)) for i in range(calls)]
    if child.get("timing") is not None:
        timing = child["timing"]
        if not isinstance(timing, list) or len(timing) != len(shapes):
            raise Rejected("no_result", "the candidate's process returned timing for other shapes than asked")
        for n, t in enumerate(timing):
            sets = t.get("input_sets") if isinstance(t, dict) else None
            if type(sets) is not int or not 1 <= sets <= 10_000:
                raise Rejected("no_result", "the candidate's process returned a malformed timing entry")
            want.append((n, timing_seed(seed, n), sets, True))
    return want


def verify_record(contract, rec: dict, inputs: tuple, dtype: torch.dtype, tol: tuple[float, float]) -> dict:
    where = str(rec.get("where"))[:300]
    expected = expected_outputs(contract, inputs)
    try:
        outs = [decode_tensor(o) for o in rec["outputs"]]
    except (ValueError, KeyError, TypeError, zlib.error, base64.binascii.Error) as e:
        raise Rejected("no_result", f"{where}: the candidate's process returned an unreadable output ({e})") from None
    if len(outs) != len(expected) or any(o.shape != s or o.dtype != d for o, (s, d) in zip(outs, expected)):
        got = [(tuple(o.shape), str(o.dtype)) for o in outs]
        raise Rejected("bad_shape", f"{where}: outputs {got}, expected {[(tuple(s), str(d)) for s, d in expected]}")
    if rec.get("final_sha") != [tensor_sha(o) for o in outs]:
        raise Rejected("deferred", f"{where}: the output changed after the call returned (work left running on "
                                   f"another stream or thread: the call's time does not include it)")
    names = list(inspect.signature(contract.builtin).parameters)
    mine = input_shas(inputs)
    for name, theirs, ours in zip(names, rec.get("input_sha") or [None] * len(mine), mine):
        if ours is not None and theirs != ours:
            raise Rejected("wrote_input", f"{where}: the candidate modified its input {name}, or was not given the "
                                          f"verifier's inputs (their hash after the call differs from the "
                                          f"verifier's)")
    if any(holds_poison(o) for o in outs):
        raise Rejected("uninitialized", f"{where}: the output holds the poison the harness puts in memory before "
                                        f"each call: the kernel returned memory it never wrote (torch.empty "
                                        f"hoping to find a freed reference result there?)")
    if not all(bool(torch.isfinite(o).all()) for o in outs if o.dtype.is_floating_point):
        raise Rejected("nonfinite", f"{where}: the output contains NaN or Inf")
    result = compare(outs, [r.cpu() for r in as_outputs(contract.reference(*inputs))], tol)
    if not result["ok"]:
        raise Rejected(*wrong_values(where, result, bool(rec.get("refilled")) and not rec.get("timed")))
    return result


def verify(payload: dict, child: dict) -> dict:
    """The verdict on what the candidate's process returned, computed here from inputs regenerated from the seed,
    the contract's reference (fp64 / fp32) and tolerance: every checked call must be there and right. What the
    candidate's process says about itself counts only against it (a failure it reports stands)."""
    slot, dtype_name = payload["slot"], payload.get("dtype", "fp32")
    result = {"mode": "check", "slot": slot, "dtype": dtype_name, "device": payload.get("device", "cpu"),
              "passed": False, "failure": None, "reason": None, "shapes": [], "timing": None, "timing_reason": None}
    contract, dtype = slots.CONTRACTS.get(slot), DTYPES.get(dtype_name)
    if contract is None or dtype not in contract.dtypes:
        result.update(failure="bad_request", reason=f"unknown slot {slot!r} or dtype {dtype_name!r} for it")
        return result
    if not isinstance(child, dict) or not isinstance(child.get("records", []), list):
        result.update(failure="no_result", reason="the candidate's process returned no readable result")
        return result
    if child.get("failure") is not None:
        result.update(failure=str(child["failure"])[:40], reason=str(child.get("reason"))[:4 * TRACE_TAIL])
        return result
    shapes = payload.get("shapes") or [dict(s) for s in contract.shapes]
    tol = contract.tolerance(dtype)
    try:
        want = expected_records(payload, shapes, child)
        by_key = {}
        for rec in child.get("records", []):
            key = (rec.get("shape"), rec.get("seed"), rec.get("draw"), bool(rec.get("timed"))) \
                if isinstance(rec, dict) else None
            if key and all(type(v) is int for v in key[:3]):
                by_key.setdefault(key, rec)
        missing = [k for k in want if k not in by_key]
        if missing:
            raise Rejected("no_result", f"the candidate's process returned no output for {len(missing)} of the "
                                        f"{len(want)} checked calls (the verdict is the verifier's, computed from "
                                        f"outputs; a process that reports a pass without them fails)")
        # the kept outputs of the timing loop too, where present
        extra = [k for k in by_key if k[3] and k not in want and 0 <= k[0] < len(shapes)
                 and k[1] == timing_seed(payload["seed"], k[0]) and 0 <= k[2] < 10_000]
        per_shape: dict[int, dict] = {}
        for n, shape in enumerate(shapes):
            keys = [k for k in want + extra if k[0] == n]
            for seed in sorted({k[1] for k in keys}):
                draws = {k[2] for k in keys if k[1] == seed}
                inputs = regenerate(contract, shape, dtype, seed, draws)
                for k in sorted((k for k in keys if k[1] == seed), key=lambda k: k[2]):
                    r = verify_record(contract, by_key[k], inputs[k[2]], dtype, tol)
                    worst = per_shape.get(n)
                    if not k[3] and (worst is None or r["worst_ratio"] > worst["worst_ratio"]):
                        per_shape[n] = r
                del inputs
            per_shape.setdefault(n, compare([], [], tol))
        calls = payload.get("calls", CALLS)
        result["shapes"] = [{"shape": shape, "calls": calls, **per_shape[n]} for n, shape in enumerate(shapes)]
        result.update(passed=True, timing=child.get("timing"), timing_reason=child.get("timing_reason"))
    except Rejected as r:
        result.update(failure=r.code, reason=r.reason)
    return result



def is_triton_kernel(obj) -> bool:
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        InterpretedFunction = JITFunction
    return isinstance(obj, (JITFunction, InterpretedFunction))


def compiled_kernels(fn) -> list[dict]:
    """Registers, spills and shared memory of every specialization `fn` was compiled to in this process."""
    found = []
    for device_cache in _getattr(fn, "device_caches", {}).values():
        for kernel in device_cache[0].values():
            kernel._init_handles()  # n_regs and n_spills are read when the binary is loaded
            meta = kernel.metadata
            found.append({"name": kernel.name, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                          "shared_bytes": meta.shared, "num_warps": meta.num_warps, "num_stages": meta.num_stages})
    return found


def run_compile(payload: dict) -> dict:
    t0 = perf_counter()
    entry = payload["entry"]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    result = {"mode": "compile", "entry": entry, "ok": False, "stage": None, "messages": [], "launched": False,
              "interpreted": interpreted, "resources": None, "resources_reason": None}

    def failed(stage: str, e: BaseException) -> dict:
        head = "".join(traceback.format_exception_only(e)).strip()
        tail = "".join(traceback.format_exception(e))[-TRACE_TAIL:]
        result.update(stage=stage, messages=[head, tail], seconds=perf_counter() - t0)
        return result

    try:
        import importlib.util

        path = write_candidate(payload["source"], "candidate_triton.py")
        spec = importlib.util.spec_from_file_location("specpilot_candidate_triton", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # Triton resolves globals of the kernel through its module
        spec.loader.exec_module(module)
    except BaseException as e:
        return failed("import", e)
    fn = _getattr(module, entry, None)
    if fn is None or not is_triton_kernel(fn):
        result.update(stage="import", messages=[f"the source defines no @triton.jit function named {entry!r}"],
                      seconds=perf_counter() - t0)
        return result
    launch = _getattr(module, "_launch_example", None)
    if payload.get("cross_arch"):  # no GPU, no interpreter: the example's launches recorded, compiled for the arch
        return run_cross_compile(module, entry, fn, launch, payload["cross_arch"], result, failed, t0)
    if launch is not None:
        try:
            launch()
            if torch.cuda.is_available() and not interpreted:
                torch.cuda.synchronize()
        except BaseException as e:  # a CompilationError on the GPU; any error of the kernel in the interpreter
            return failed("interpret" if interpreted else "compile", e)
        result["launched"] = True
    if interpreted:
        result["resources_reason"] = "the interpreter compiles nothing: no registers, spills or shared memory"
    elif not result["launched"]:
        result["resources_reason"] = ("define _launch_example() launching the kernel once: Triton compiles a kernel "
                                      "for the argument types and constants of a launch")
    else:
        result["resources"] = compiled_kernels(fn)
    result.update(ok=True, seconds=perf_counter() - t0)
    return result


def run_cross_compile(module, entry: str, fn, launch, arch: int, result: dict, failed, t0: float) -> dict:
    """`_launch_example()` with the kernel's launches recorded instead of run (its tensors may live on the CPU),
    then each compiled for CUDA `arch` by the compiler in Triton's wheel: its errors, and per launch the binary's
    registers, spill bytes and shared memory (kernels/cross_compile.py)."""
    from specpilot.kernels.cross_compile import compile_launch, record

    if launch is None:
        result.update(resources_reason="define _launch_example() launching the kernel once: a launch fixes the "
                                       "argument types and constants to compile for", seconds=perf_counter() - t0)
        return result
    try:
        with record(module, [entry]) as calls:
            launch()
    except BaseException as e:
        return failed("import", e)
    result["launched"] = bool(calls)
    resources = []
    for kernel, args, kwargs in calls:
        try:
            usage = compile_launch(kernel, args, kwargs, arch)
        except BaseException as e:  # the compiler's error: what a GPU would have said
            return failed("compile", e)
        resources.append({"name": usage["kernel"], "n_regs": usage["registers"],
                          "n_spills": usage["stack_bytes"] + usage["local_bytes"],
                          "shared_bytes": usage["shared_bytes"],
                          "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages"),
                          "target": f"sm_{arch}"})
    result.update(ok=True, resources=resources, seconds=perf_counter() - t0)
    return result


def claim_stdout():
    """A private handle on the real stdout for the result; anything the candidate prints goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def release_stdin() -> None:
    """The payload is read once; fd 0 then points at /dev/null, so the candidate cannot read it again."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)


def write_result(out, result: dict) -> None:
    """The result as the last line on stdout (megabytes with the outputs: the caller reads all of it)."""
    out.write(json.dumps(result, default=str) + "\n")
    out.flush()


def main() -> int:
    out = claim_stdout()
    payload = json.load(sys.stdin)
    release_stdin()
    compile_mode = payload.get("mode") == "compile"
    nonce = payload.pop("nonce", None)  # compile mode only: a check's verdict is the verifier's, not read from here
    try:
        result = run_compile(payload) if compile_mode else run_check(payload)
    except Exception as e:  # the harness itself failed: say so rather than leave no answer
        result = {"mode": payload.get("mode", "check"), "passed": False, "ok": False, "failure": "harness_error",
                  "reason": f"the harness failed: {''.join(traceback.format_exception(e))[-TRACE_TAIL:]}"}
    if compile_mode:
        result["nonce"] = nonce
    write_result(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
