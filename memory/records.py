"""What the memory stores about a deployment and an outcome, and how records are compared.

The deployment descriptor (`Outcome.deployment`) is a plain dict built by `describe_deployment` (or from a profiler
Profile dict by `deployment_from_profile`):

    target, architecture, params, layers, hidden, intermediate, heads, kv_heads, vocab,
    dtype (fp32|bf16|fp16|…), weight_format (native|lossless12), drafter (none|ngram|layerskip|model),
    device (device class: cpu|cuda|…), device_name,
    ceilings {copy_bytes_per_s, matmul_flops_per_s, launch_s, graph_node_s, gemm_node_s}  (tools/profile/calibrate.py),
    batch_size, workload_mix {workload: fraction}   (fractions sum to 1; {} when unknown)

The deployment embedding (`deployment_vector`, version EMBEDDING_VERSION) turns a descriptor into numbers such that
similar hardware, model scale and batch size lie close in Euclidean distance. Each continuous feature is a log of a
size or rate, mapped affinely so that the span of deployments SpecPilot targets (CPUs to H200s, 10M- to 1T-parameter
models, batch 1 to 256) covers 0..1; values outside the span extrapolate (no clipping, so order is kept):

    feature             value                 log    span mapped to 0..1
    params              parameter count       log10  1e7 .. 1e12
    layers              transformer layers    log2   1 .. 128
    hidden              hidden size           log2   64 .. 16384
    copy_bandwidth      copy bytes/s          log10  1e9 .. 1e13   (a CPU's ~1e10 .. an H200's ~4e12)
    matmul_rate         matmul FLOP/s         log10  1e10 .. 1e16
    launch              launch_s (s/kernel)   log10  1e-7 .. 1e-3
    graph_node          graph_node_s (s/node) log10  1e-7 .. 1e-3
    batch               batch_size            log2   1 .. 256

Categorical features are one-hot, scaled by 1/sqrt(2) so that changing the class moves a deployment by exactly 1,
the same as crossing a continuous feature's whole span; a value outside the listed classes sets the group's "other":

    dtype               fp32, bf16, fp16, other
    weight_format       native, lossless12, other
    device_class        cpu, cuda, other
    drafter             none, ngram, layerskip, model, other

The workload mix is the fraction of each of code, chat, math, summarize, rag, other, scaled by 1/sqrt(2) (two
disjoint mixes are 1 apart; an unknown mix is all zeros). The spans are normalisation constants, chosen to cover the
targeted range, not measurements. Some distances they give: batch 1 vs 32 is 0.63; SmolLM2-135M vs Llama-3-8B about
0.5; an H100 vs an H200 0.03; a CPU vs a GPU at least 1 (device class) plus their ceilings' difference.

Scores (docs/MEMORY.md): similarity = exp(-d^2) of the deployment distance d (or the text cosine, clipped at 0), and

    score = similarity x speedup_vs_ar     when the outcome worked (no failure, gate not failed)
    score = similarity - 1                 when it failed: in (-1, 0], after every success, closest failure first

An outcome that worked but has no measured speedup_vs_ar counts as no gain (speedup 1).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import shutil
import subprocess
from dataclasses import asdict, fields

from ..engine.workloads import BUILTIN as WORKLOADS
from ..tools.profile.costmodel import DRAFTER_KINDS, DeviceCeilings, ModelShape
from .outcome import Outcome

EMBEDDING_VERSION = 1
VERSION_KEYS = ("specpilot", "torch", "triton", "transformers", "driver")
DTYPES = ("fp32", "bf16", "fp16")
WEIGHT_FORMATS = ("native", "lossless12")  # engine/recipe.py WEIGHT_FORMATS (not imported: it pulls in torch)
DEVICE_CLASSES = ("cpu", "cuda")
CEILING_KEYS = ("copy_bytes_per_s", "matmul_flops_per_s", "launch_s", "graph_node_s", "gemm_node_s")

# (feature, descriptor path, log base, low, high): f = (log(value) - log(low)) / (log(high) - log(low))
CONTINUOUS_FEATURES = (
    ("params", ("params",), 10, 1e7, 1e12),
    ("layers", ("layers",), 2, 1, 128),
    ("hidden", ("hidden",), 2, 64, 16384),
    ("copy_bandwidth", ("ceilings", "copy_bytes_per_s"), 10, 1e9, 1e13),
    ("matmul_rate", ("ceilings", "matmul_flops_per_s"), 10, 1e10, 1e16),
    ("launch", ("ceilings", "launch_s"), 10, 1e-7, 1e-3),
    ("graph_node", ("ceilings", "graph_node_s"), 10, 1e-7, 1e-3),
    ("batch", ("batch_size",), 2, 1, 256),
)
CATEGORICAL_FEATURES = (
    ("dtype", DTYPES),
    ("weight_format", WEIGHT_FORMATS),
    ("device", DEVICE_CLASSES),
    ("drafter", DRAFTER_KINDS),
)
WORKLOAD_CLASSES = (*WORKLOADS, "other")
ONE_HOT_SCALE = 1 / math.sqrt(2)  # two one-hot vectors of different classes are sqrt(2) apart: scaled to 1


def feature_names() -> list[str]:
    """The name of each coordinate of `deployment_vector`, in order."""
    names = [name for name, *_ in CONTINUOUS_FEATURES]
    for group, classes in CATEGORICAL_FEATURES:
        names += [f"{group}={c}" for c in (*classes, "other")]
    return names + [f"workload={w}" for w in WORKLOAD_CLASSES]


# -- the deployment descriptor --------------------------------------------------------------------------------------

def normalize_dtype(dtype: str) -> str:
    """fp32 / bf16 / fp16 from any of torch's or the CLI's spellings; anything else lower-cased as given."""
    name = str(dtype).lower().removeprefix("torch.")
    return {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(name, name)


def device_class(device: str) -> str:
    """cuda / cpu / … from a device string such as "cuda:0"."""
    return str(device).split(":", 1)[0].lower()


def normalize_workload_mix(spec) -> dict:
    """Fractions of each workload summing to 1, from a {name: weight} dict or a comma-separated workload spec
    ("code,chat": equal parts). Files and categories count as "other"; None or a non-workload string gives {}."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        names = [s.strip() for s in spec.split(",") if s.strip()]
        if not names or not all(n in WORKLOADS or n.split(":", 1)[0].endswith(".jsonl") for n in names):
            return {}  # e.g. the profiler's "token ids given": the mix is not known
        spec = {}
        for n in names:
            key = n if n in WORKLOADS else "other"
            spec[key] = spec.get(key, 0) + 1
    weights = {(k if k in WORKLOADS else "other"): float(v) for k, v in spec.items()}
    if any(v < 0 for v in weights.values()):
        raise ValueError(f"workload mix {spec!r}: weights must not be negative")
    total = sum(weights.values())
    return {k: v / total for k, v in sorted(weights.items()) if v > 0} if total > 0 else {}


def describe_deployment(*, target: str, architecture: str, shape: ModelShape | dict, dtype: str, weight_format: str,
                        drafter: str, device: str, ceilings: DeviceCeilings | dict, batch_size: int,
                        workload_mix=None) -> dict:
    """The deployment descriptor the memory records and compares (module docstring)."""
    if isinstance(shape, dict):
        shape = ModelShape(**{f.name: shape[f.name] for f in fields(ModelShape)})
    if isinstance(ceilings, DeviceCeilings):
        ceilings = asdict(ceilings)
    missing = [k for k in ("name", *CEILING_KEYS[:4]) if ceilings.get(k) is None]
    if missing:
        raise ValueError(f"device ceilings lack {', '.join(missing)} (run `specpilot calibrate`)")
    return {
        "target": str(target), "architecture": str(architecture),
        "params": shape.params, "layers": shape.layers, "hidden": shape.hidden, "intermediate": shape.intermediate,
        "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab,
        "dtype": normalize_dtype(dtype), "weight_format": str(weight_format), "drafter": str(drafter),
        "device": device_class(device), "device_name": str(ceilings["name"]),
        "ceilings": {k: ceilings.get(k) for k in CEILING_KEYS},
        "batch_size": int(batch_size), "workload_mix": normalize_workload_mix(workload_mix),
    }


def deployment_from_profile(profile: dict, *, architecture: str, weight_format: str, workload_mix=None) -> dict:
    """The descriptor of a profiled deployment, from tools/profile/profiler.py `profile(...).to_dict()`.

    The profile does not carry the target's architecture (model_type) or the recipe's weight format: the caller,
    which loaded both, passes them. The workload mix defaults to the profiled workload (meta.workload)."""
    meta, model = profile["meta"], profile["prediction"]["deployment"]["model"]
    spec = meta.get("workload") if workload_mix is None else workload_mix
    return describe_deployment(target=meta["target"], architecture=architecture, shape=model, dtype=meta["dtype"],
                               weight_format=weight_format, drafter=meta["drafter"], device=meta["device"],
                               ceilings=profile["ceilings"], batch_size=meta["batch_size"], workload_mix=spec)


# -- the deployment embedding ---------------------------------------------------------------------------------------

def _lookup(deployment: dict, path: tuple[str, ...]):
    value = deployment
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            raise ValueError(f"deployment descriptor lacks {'.'.join(path)} (build it with "
                             "memory.records.describe_deployment)")
        value = value[key]
    return value


def deployment_vector(deployment: dict) -> list[float]:
    """The documented numeric embedding of a deployment descriptor (module docstring; names: feature_names())."""
    vec = []
    for name, path, base, low, high in CONTINUOUS_FEATURES:
        value = _lookup(deployment, path)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"deployment {'.'.join(path)} must be a positive number, got {value!r}")
        vec.append((math.log(value, base) - math.log(low, base)) / (math.log(high, base) - math.log(low, base)))
    for group, classes in CATEGORICAL_FEATURES:
        value = _lookup(deployment, (group,))
        if group == "dtype":
            value = normalize_dtype(value)
        hot = value if value in classes else "other"
        vec += [ONE_HOT_SCALE * (c == hot) for c in (*classes, "other")]
    mix = normalize_workload_mix(deployment.get("workload_mix") or {})
    vec += [ONE_HOT_SCALE * mix.get(w, 0.0) for w in WORKLOAD_CLASSES]
    return vec


def deployment_distance(a: dict, b: dict) -> float:
    return math.dist(deployment_vector(a), deployment_vector(b))


def similarity_from_distance(distance: float) -> float:
    """exp(-d^2): 1 for the same deployment, 0.78 at d = 0.5, 0.37 at d = 1 (one class change), 0.02 at d = 2."""
    return math.exp(-distance * distance)


# -- outcomes -------------------------------------------------------------------------------------------------------

def outcome_json(outcome: Outcome) -> str:
    """The canonical JSON of an outcome: what the store keeps and exports (non-JSON values become strings)."""
    return json.dumps(outcome.to_dict(), sort_keys=True, default=str)


def record_id(outcome: Outcome) -> str:
    """<candidate id>-<hash of the whole outcome>: recording the same outcome twice stores it once, and the same
    candidate measured on another deployment or at another time gets its own record."""
    digest = hashlib.sha256(outcome_json(outcome).encode()).hexdigest()[:12]
    return f"{outcome.candidate.get('id') or 'candidate'}-{digest}"


def worked(outcome: Outcome) -> bool:
    """No failure recorded, and the token-forcing gate did not fail it."""
    return outcome.failure is None and (outcome.gate or {}).get("passed") is not False


def speedup(outcome: Outcome) -> float:
    value = (outcome.results or {}).get("speedup_vs_ar")
    return float(value) if isinstance(value, (int, float)) and value > 0 else 1.0


def combined_score(similarity: float, outcome: Outcome) -> float:
    """similarity x speedup_vs_ar for outcomes that worked; similarity - 1 (a warning, below every success) else."""
    return similarity * speedup(outcome) if worked(outcome) else similarity - 1.0


def failure_reason(outcome: Outcome) -> str:
    if outcome.failure:
        return outcome.failure
    gate = outcome.gate or {}
    return f"gate: {gate.get('reason') or 'failed'}"


def mechanism_text(outcome: Outcome) -> str:
    """What the text embedding sees: the agent's reason first (MiniLM reads 256 word pieces), then the change, then
    how it fared."""
    c = outcome.candidate
    parts = [f"{c.get('agent', '')}: {c.get('reason', '')}"]
    patch = c.get("recipe_patch") or {}
    if patch:
        parts.append("change: " + json.dumps(patch, sort_keys=True))
    kernel = c.get("kernel")
    if kernel:
        parts.append(f"kernel for the {kernel.get('slot')} slot")
    parts.append("worked" if worked(outcome) else f"failed: {failure_reason(outcome)}")
    return ". ".join(parts)


# -- versions -------------------------------------------------------------------------------------------------------

def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    """The driver version as tools/bench/env.py records it (nvidia-smi), None without an NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines else None


def current_versions() -> dict:
    """specpilot, torch, triton, transformers (installed distributions; importing none) and the NVIDIA driver."""
    out = {name: _distribution_version(name) for name in VERSION_KEYS if name != "driver"}
    return out | {"driver": _nvidia_driver()}


def version_differences(recorded: dict, current: dict) -> list[str]:
    """'torch 2.12.0 (now 2.13.0)' for each of VERSION_KEYS that differs; a key never recorded counts as differing
    when a version is installed now."""
    recorded = recorded or {}
    return [f"{k} {recorded.get(k) or 'none'} (now {current.get(k) or 'none'})" for k in VERSION_KEYS
            if recorded.get(k) != current.get(k)]
