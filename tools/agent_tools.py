"""The tools agents call: compile a Triton kernel, check and time a kernel against its slot's contract, benchmark a
recipe, run the token-forcing gate, profile a deployment (docs/TOOLS.md).

Each tool is a plain function returning a dataclass with `to_dict()`. `TOOLS` holds each one's name, description
and JSON schema; `tool_specs()` gives them in the OpenAI `tools=[...]` format and `call_tool(name, arguments)`
validates an agent's arguments against the schema and calls the tool, answering a structured error instead of
raising on bad input.

Candidate kernel code only ever runs in the sandbox child (tools/sandbox/process.py, the harness in
tools/sandbox/kernel_check.py); benchmark_kernel's verdict is computed here, from the outputs the child returns
(kernel_check.verify: this process never loads candidate code).
benchmark_recipe and profile run a recipe as `specpilot bench` and `specpilot profile` do: a recipe that names kernel
source files is measured whole in a sandboxed child (tools/bench/run.py, tools/profile/profiler.py: this process
reads back only JSON); the gate runs its candidate in its own sandboxed process.
"""
from __future__ import annotations

import ast
import contextlib
import json
import secrets
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..engine.errors import SpecPilotError
from ..kernels import SLOTS
from .sandbox.process import SandboxLimits, SandboxResult, run_python

HARNESS = ["specpilot.tools.sandbox.kernel_check"]
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bf16", "fp16", "fp32")
KERNEL_TIMEOUT_S = 600  # wall-clock limit of a kernel tool's sandboxed child: the default and the most allowed


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | None, device: str) -> str:
    """The engine's defaults: bf16 on CUDA, fp32 on CPU."""
    if dtype not in (None, "auto"):
        return dtype
    return "bf16" if device.startswith("cuda") else "fp32"


def sandbox_for(device: str, timeout_s: float) -> tuple[SandboxLimits, dict]:
    """Limits and extra environment of a kernel tool's child: the GPU lock on CUDA; on CPU, Triton's interpreter
    (set before the candidate can import triton)."""
    cuda = device.startswith("cuda")
    return SandboxLimits(wall_s=timeout_s, gpu=cuda), ({} if cuda else {"TRITON_INTERPRET": "1"})


def sandbox_failure(r: SandboxResult, nonce: str | None = None) -> tuple[str, str] | None:
    """(failure code, reason) when the child gave no answer, else None. With a nonce (compile_triton), an answer
    without it was not written by the harness."""
    if r.kind == "timeout":
        return "timeout", f"the child did not finish within its {r.seconds:.0f} s budget (a hang or a very slow " \
                          f"kernel)\n{r.stderr_tail}"
    if r.kind == "oom":
        return "oom", f"the child ran out of memory\n{r.stderr_tail}"
    if r.kind in ("crash", "signal"):
        return "crash", f"the child died from {r.signal}\n{r.stderr_tail}"
    if r.kind != "ok" or not isinstance(r.output, dict):
        return "no_result", (f"the child ended without a result ({r.kind}, exit status {r.returncode}): did the "
                             f"candidate end the process?\n{r.stderr_tail}")
    if nonce is not None and r.output.get("nonce") != nonce:
        return "forged_result", "the result line does not carry this run's nonce: written by the candidate, not " \
                                "the harness"
    return None


def triton_kernel_defined(source: str, entry: str) -> str | None:
    """Why `source` defines no top-level function `entry` decorated with a Triton jit (read from the source's
    syntax in this process, never run here), or None. A source that does not parse is left to the child, which
    reports the SyntaxError with its message."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry:
            names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            if any(n == "jit" or n.endswith(".jit") for n in names):
                return None
            return f"{entry}() is not decorated with @triton.jit (decorators: {names or 'none'})"
    return f"the source defines no top-level @triton.jit function named {entry!r}"


# -- compile_triton -----------------------------------------------------------------------------------------------

@dataclass
class CompileResult:
    ok: bool
    entry: str
    device: str
    interpreted: bool  # True on CPU: TRITON_INTERPRET=1, nothing is compiled
    stage: str | None  # where it failed: import (syntax, names), compile (GPU), interpret (a launch on CPU), sandbox
    messages: list[str]  # the error's last line, then its traceback tail
    launched: bool  # _launch_example() ran
    resources: list[dict] | None  # per compiled specialization: n_regs, n_spills, shared_bytes, num_warps, num_stages
    resources_reason: str | None  # why resources is None
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def compile_triton(source: str, entry: str, device: str = "auto", timeout_s: float = KERNEL_TIMEOUT_S
                   ) -> CompileResult:
    """Import `source` in the sandbox and find the @triton.jit function `entry`. When the source defines
    `_launch_example()` (a function launching the kernel once on small inputs) it is called: on CUDA that compiles
    the kernel for those arguments and the compiled kernels' registers, spills and shared memory are reported; on
    CPU the launch runs in Triton's interpreter, which checks the kernel's logic but compiles nothing."""
    device = resolve_device(device)
    limits, env = sandbox_for(device, timeout_s)
    nonce = secrets.token_hex(16)
    r = run_python(HARNESS, {"mode": "compile", "source": source, "entry": entry, "nonce": nonce}, limits, env)
    failure = sandbox_failure(r, nonce)
    if failure:
        return CompileResult(False, entry, device, not device.startswith("cuda"), "sandbox", [failure[1]], False,
                             None, "the child gave no result", r.seconds)
    o = r.output
    result = CompileResult(bool(o.get("ok")), entry, device, bool(o.get("interpreted")), o.get("stage"),
                           list(o.get("messages", [])), bool(o.get("launched")), o.get("resources"),
                           o.get("resources_reason"), r.seconds)
    if result.ok and result.launched and result.interpreted:  # the interpreter ran it: now the GPU's compiler
        cross_compile(source, entry, limits, result)
    no_kernel = triton_kernel_defined(source, entry)
    if no_kernel and result.ok:  # whatever the child said: ok needs a kernel, read from the source here
        result.ok, result.stage, result.messages = False, "import", [no_kernel]
    return result


def cross_compile(source: str, entry: str, limits: SandboxLimits, result: CompileResult) -> None:
    """On a machine without a GPU: a second child, without the interpreter, compiles the example's launches for the
    H200's architecture (sm_90; kernels/cross_compile.py). Its compiler errors fail the result (stage `compile`);
    else `resources` are the binaries' (registers, spill bytes, shared memory)."""
    from specpilot.kernels.cross_compile import HOPPER

    nonce = secrets.token_hex(16)
    r = run_python(HARNESS, {"mode": "compile", "source": source, "entry": entry, "nonce": nonce,
                             "cross_arch": HOPPER}, limits, {"TRITON_INTERPRET": "0"})
    result.seconds += r.seconds
    failure = sandbox_failure(r, nonce)
    if failure:
        result.resources_reason = f"not compiled for sm_{HOPPER}: {failure[1].splitlines()[0]}"
        return
    o = r.output
    if not o.get("ok"):
        result.ok, result.stage, result.messages = False, o.get("stage") or "compile", list(o.get("messages", []))
        return
    result.resources, result.resources_reason = o.get("resources"), (
        f"compiled for sm_{HOPPER} without a GPU (the interpreter ran the launch): registers and spill bytes of "
        f"the binary")


# -- benchmark_kernel ---------------------------------------------------------------------------------------------

@dataclass
class KernelBenchResult:
    slot: str
    dtype: str
    device: str
    passed: bool
    failure: str | None  # the code of the defense that rejected it (docs/TOOLS.md), None when passed
    reason: str | None
    shapes: list[dict] = field(default_factory=list)  # per shape: max_abs_err, worst_ratio (<= 1), atol, rtol
    timing: list[dict] | None = None  # per shape: median_us, builtin_median_us, speedup_vs_builtin, ...
    timing_reason: str | None = None  # why timing is None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def benchmark_kernel(slot: str, source: str, device: str = "auto", dtype: str = "auto",
                     shapes: list[dict] | None = None, timing: bool = True, timeout_s: float = KERNEL_TIMEOUT_S
                     ) -> KernelBenchResult:
    """Check `source` (defining a function named after `slot`) against the slot's contract in the sandbox: several
    calls per shape on fresh and refilled inputs, every defense of docs/TOOLS.md, the error per shape; on CUDA also
    its median time against the built-in's. `shapes` replaces the contract's shapes (same keys)."""
    from .sandbox import kernel_check

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    limits, env = sandbox_for(device, timeout_s)
    # the verifier's own copies: nothing the child does can change what it checks against
    shapes = json.loads(json.dumps(shapes)) if shapes else None
    payload = {"mode": "check", "slot": slot, "source": source, "dtype": dtype, "device": device, "shapes": shapes,
               "timing": timing, "seed": secrets.randbelow(1 << 31), "calls": kernel_check.CALLS}
    r = run_python(HARNESS, payload, limits, env)  # its result carries every checked output: megabytes
    failure = sandbox_failure(r)
    if failure:
        return KernelBenchResult(slot, dtype, device, False, *failure, seconds=r.seconds)
    child = r.output
    o = kernel_check.verify(payload, child)
    return KernelBenchResult(slot, dtype, device, bool(o["passed"]), o["failure"], o["reason"], list(o["shapes"]),
                             o["timing"], o["timing_reason"], r.seconds)


# -- wrappers over the measuring tools ----------------------------------------------------------------------------

@dataclass
class RecipeBenchResult:
    ok: bool
    error: str | None
    out_dir: str | None  # results.json, report.md and plots (docs/BENCH.md)
    runs: list[dict] = field(default_factory=list)  # per system, workload, batch size: the headline numbers
    errors: list[dict] = field(default_factory=list)  # systems that failed in a cell

    def to_dict(self) -> dict:
        return asdict(self)


RUN_FIELDS = ("system", "workload", "batch_size", "tokens_per_s", "speedup_vs_ar", "mean_accepted",
              "identical_to_ar", "p50_token_ms", "ttft_ms", "peak_memory_bytes")


def _out_dir(out_dir: str | None, prefix: str) -> Path:
    return Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix=prefix))


def benchmark_recipe(recipe: str, target: str = "smollm2-135m", workload: str = "code",
                     batch_sizes: list[int] | tuple[int, ...] = (1,),
                     max_new_tokens: int = 128, limit: int | None = None, repeats: int = 1, baselines: str = "none",
                     device: str = "auto", dtype: str = "auto", out_dir: str | None = None) -> RecipeBenchResult:
    """`specpilot bench` (tools/bench/run.run_bench) for one recipe next to `ar` and `stock`."""
    from .bench.run import parse_args, run_bench
    from .sandbox import process as sp

    out = _out_dir(out_dir, "specpilot-bench-")
    # --flag=value: a value starting with "-" stays a value
    argv = ["bench", f"--target={target}", f"--recipe={recipe}", f"--workload={workload}",
            f"--batch-sizes={','.join(str(b) for b in batch_sizes)}", f"--max-new-tokens={max_new_tokens}",
            f"--repeats={repeats}", f"--baselines={baselines}", f"--out={out}"]
    argv += [f"--limit={limit}"] if limit is not None else []
    argv += [f"--device={device}"] if device != "auto" else []
    argv += [f"--dtype={dtype}"] if dtype != "auto" else []
    try:
        args = parse_args(argv[1:])
    except SpecPilotError as e:
        return RecipeBenchResult(False, str(e), str(out))
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its summary table: the result is what the caller reads
            run_bench(args, sandbox=sp)
        results = json.loads((out / "results.json").read_text())
    except Exception as e:  # a bad target, recipe or workload; anything the run raised
        return RecipeBenchResult(False, f"{type(e).__name__}: {e}", str(out))
    runs = [{k: run.get(k) for k in RUN_FIELDS} for run in results["runs"]]
    return RecipeBenchResult(True, None, str(out), runs, results["errors"])


@dataclass
class TokenForceResult:
    ok: bool  # the check ran (a verdict exists)
    error: str | None  # why it could not run
    passed: bool = False
    reason: str | None = None  # the first failure, one line
    tokens_checked: int = 0
    exact_matches: int = 0
    ties_forced: int = 0
    epsilon: float | None = None
    failure: dict | None = None
    report: str | None = None  # path of report.json (docs/GATE.md)

    def to_dict(self) -> dict:
        return asdict(self)


def token_force_check(recipe: str, target: str = "smollm2-135m", workload: str = "code", limit: int | None = 8,
                      max_new_tokens: int = 64, device: str = "auto", dtype: str = "auto", patch: str | None = None,
                      batch_size: int | None = None, timeout_s: float = 600.0, out_dir: str | None = None
                      ) -> TokenForceResult:
    """`specpilot check` (tools/gate/check.check): are the recipe's greedy tokens the stock system's, on salted prompts,
    forcing the reference token only at numerical ties?"""
    from .gate.check import check

    device = resolve_device(device)
    out = _out_dir(out_dir, "specpilot-check-")
    try:
        rep = check(target, recipe, workload, limit, max_new_tokens, device, resolve_dtype(dtype, device), out,
                    patch=patch, batch_size=batch_size, timeout_s=timeout_s)
    except Exception as e:  # SpecPilotError for bad input; the gate's own failures
        return TokenForceResult(False, f"{type(e).__name__}: {e}")
    return TokenForceResult(True, None, rep.passed, rep.reason, rep.tokens_checked, rep.exact_matches, len(rep.ties),
                            rep.epsilon, rep.failure, str(out / "report.json"))


@dataclass
class ProfileResult:
    ok: bool
    error: str | None
    step_ms: float | None = None  # the engine's own loop, per step
    tokens_per_s: float | None = None
    tau: float | None = None
    phases_ms: dict | None = None  # draft, verify, bookkeeping, host_sync, idle of the eager step
    gaps: list[dict] = field(default_factory=list)  # ranked by end-to-end gain, each with its agent
    out_dir: str | None = None  # profile.json (docs/COSTMODEL.md)

    def to_dict(self) -> dict:
        return asdict(self)


def profile(recipe: str = "stock", target: str = "smollm2-135m", workload: str = "code", limit: int | None = None,
            max_new_tokens: int = 64, batch_size: int = 1, device: str = "auto", dtype: str = "auto",
            repeats: int = 2, out_dir: str | None = None) -> ProfileResult:
    """`specpilot profile` (tools/profile/profiler.profile): step phases and top kernels against the cost model's floors,
    as gaps ranked by the end-to-end gain closing each would bring."""
    from .profile.phase_timer import PHASES
    from .profile.profiler import profile as run_profile
    from .sandbox import process as sp

    device = resolve_device(device)
    out = _out_dir(out_dir, "specpilot-profile-")
    try:
        p = run_profile(target, recipe, workload, limit, max_new_tokens, batch_size, device,
                        None if dtype == "auto" else dtype, out, repeats=repeats, sandbox=sp)
    except Exception as e:
        return ProfileResult(False, f"{type(e).__name__}: {e}", out_dir=str(out))
    gaps = [{"component": g["component"], "measured_ms": g["measured_s"] * 1e3, "floor_ms": g["floor_s"] * 1e3,
             "gain": g["gain"], "agent": g["agent"], "reason": g["reason"]} for g in p.gaps]
    return ProfileResult(True, None, p.step["loop_s"] * 1e3, p.step["tokens_per_s"], p.acceptance["tau"],
                         {ph: p.phases[ph] * 1e3 for ph in PHASES}, gaps, str(out))


# -- the registry -------------------------------------------------------------------------------------------------

_DEVICE = {"type": "string", "enum": list(DEVICES), "default": "auto",
           "description": "cuda, cpu, or auto (cuda when available)"}
_DTYPE = {"type": "string", "enum": list(DTYPES), "default": "auto", "description": "auto: bf16 on cuda, fp32 on cpu"}
_RECIPE = {"type": "string", "minLength": 1, "description": "ar, stock, or the path of a recipe JSON file"}
_TARGET = {"type": "string", "minLength": 1, "default": "smollm2-135m",
           "description": "model alias, GGUF file, model directory or cached hub id"}
_WORKLOAD = {"type": "string", "minLength": 1, "default": "code",
             "description": "code, chat, math, summarize, rag, or FILE.jsonl[:category]"}
_POSITIVE = {"type": "integer", "minimum": 1}
_TIMEOUT = {"type": "number", "exclusiveMinimum": 0, "maximum": KERNEL_TIMEOUT_S, "default": KERNEL_TIMEOUT_S,
            "description": "seconds before the sandboxed child is killed"}


def _params(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema (draft 2020-12) of the keyword arguments
    function: Callable


TOOLS: dict[str, Tool] = {t.name: t for t in (
    Tool("compile_triton",
         "Import a Triton kernel source in the sandbox and find its @triton.jit function `entry`. If the source "
         "defines _launch_example() (launching the kernel once on small inputs), it is run: on CUDA this compiles "
         "the kernel and reports registers, spills and shared memory per compiled kernel; on CPU it runs in "
         "Triton's interpreter. Returns ok, the failing stage and the error text.",
         _params({"source": {"type": "string", "minLength": 1, "description": "the Python source"},
                  "entry": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                            "description": "name of the @triton.jit function"},
                  "device": _DEVICE, "timeout_s": _TIMEOUT}, ["source", "entry"]),
         compile_triton),
    Tool("benchmark_kernel",
         "Check a kernel implementation against its slot's contract (kernels/slots.py) in the sandbox and, on CUDA, "
         "time it (median over rotated inputs larger than L2) against the built-in. The source defines a function "
         "named after the slot: linear(x, w, b), rmsnorm(x, w, eps), attention(q, k, v, mask) or "
         "accept(drafts, valid, logits). Rejections name the check that failed: wrong values, NaN, modified "
         "inputs, reused or unwritten outputs, deferred work, patched functions, non-plain tensors.",
         _params({"slot": {"type": "string", "enum": list(SLOTS)},
                  "source": {"type": "string", "minLength": 1, "description": "the Python source"},
                  "device": _DEVICE, "dtype": _DTYPE,
                  "shapes": {"type": "array", "minItems": 1, "items": {"type": "object"},
                             "description": "replaces the contract's shapes (same keys as the contract's)"},
                  "timing": {"type": "boolean", "default": True, "description": "time it (CUDA only)"},
                  "timeout_s": _TIMEOUT}, ["slot", "source"]),
         benchmark_kernel),
    Tool("benchmark_recipe",
         "Measure a recipe next to the same engine's ar and stock on a workload (specpilot bench): tokens/s, "
         "speedup over ar, mean accepted length, identity with ar, latency.",
         _params({"recipe": _RECIPE, "target": _TARGET, "workload": _WORKLOAD,
                  "batch_sizes": {"type": "array", "items": _POSITIVE, "minItems": 1, "default": [1]},
                  "max_new_tokens": {**_POSITIVE, "default": 128}, "limit": _POSITIVE,
                  "repeats": {**_POSITIVE, "default": 1},
                  "baselines": {"type": "string", "enum": ["none", "hf"], "default": "none"},
                  "device": _DEVICE, "dtype": _DTYPE, "out_dir": {"type": "string", "minLength": 1}}, ["recipe"]),
         benchmark_recipe),
    Tool("token_force_check",
         "The token-forcing gate (specpilot check): passes only if the recipe's greedy tokens are the stock "
         "system's on freshly salted prompts, forcing the reference token only at numerical ties.",
         _params({"recipe": _RECIPE, "target": _TARGET, "workload": _WORKLOAD, "limit": {**_POSITIVE, "default": 8},
                  "max_new_tokens": {**_POSITIVE, "default": 64}, "device": _DEVICE, "dtype": _DTYPE,
                  "patch": {"type": "string", "minLength": 1,
                            "description": "Python file the candidate process runs before decoding"},
                  "batch_size": _POSITIVE, "timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 600},
                  "out_dir": {"type": "string", "minLength": 1}}, ["recipe"]),
         token_force_check),
    Tool("profile",
         "Profile a recipe (specpilot profile): step time, phases (draft, verify, bookkeeping, host sync, idle) and "
         "the gaps to the cost model's floors, ranked by end-to-end gain, each with the agent that owns it.",
         _params({"recipe": {**_RECIPE, "default": "stock"}, "target": _TARGET, "workload": _WORKLOAD,
                  "limit": _POSITIVE, "max_new_tokens": {**_POSITIVE, "default": 64},
                  "batch_size": {**_POSITIVE, "default": 1}, "device": _DEVICE, "dtype": _DTYPE,
                  "repeats": {**_POSITIVE, "default": 2}, "out_dir": {"type": "string", "minLength": 1}}, []),
         profile),
)}


def tool_specs() -> list[dict]:
    """The tools in the OpenAI chat-completions format: tools=[{"type": "function", "function": {...}}]."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in TOOLS.values()]


def _error(kind: str, message: str, tool: str | None) -> dict:
    return {"error": {"type": kind, "tool": tool, "message": message}}


def call_tool(name: str, arguments: str | dict | None = None) -> dict:
    """Run tool `name` on an agent's arguments (a JSON string or a dict): the result's dict, or
    {"error": {"type", "tool", "message"}} for an unknown tool, arguments that are not JSON or break the schema,
    or a tool that raised. Never raises for anything the agent sends."""
    tool = TOOLS.get(name)
    if tool is None:
        return _error("unknown_tool", f"no tool named {name!r} (tools: {', '.join(TOOLS)})", name)
    if arguments is None or arguments == "":
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return _error("bad_arguments", f"arguments are not valid JSON: {e}", name)
    import jsonschema  # only for validation: the tools themselves run without it

    validator = jsonschema.Draft202012Validator(tool.parameters)
    problems = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
    if problems:
        lines = [f"{'/'.join(map(str, p.absolute_path)) or '(arguments)'}: {p.message}" for p in problems]
        return _error("bad_arguments", "arguments do not match the schema: " + "; ".join(lines), name)
    try:
        return tool.function(**arguments).to_dict()
    except Exception as e:  # a tool bug must reach the agent as an answer, not end its loop
        return _error("tool_failed", f"{type(e).__name__}: {e}", name)
