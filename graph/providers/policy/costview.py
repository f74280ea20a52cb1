"""The profiled deployment in the cost model's terms (tools/profile/costmodel.py): CostView, with its calibrated
ceilings, model shape, measured kernel counts and measured acceptance per draft position, and the helpers the agents'
catalogs price and word their options with (the per-token acceptance that breaks even, a measured kernel count carried
over to another drafter, a step's phases in milliseconds)."""
from __future__ import annotations

from dataclasses import dataclass

from ....tools.profile.costmodel import (KERNELS_NGRAM_FIXED, KERNELS_PER_NGRAM_ORDER, Deployment, DeviceCeilings,
                                         ModelShape, Prediction, expected_tokens, predict)


def _shape(data: dict | None) -> ModelShape | None:
    if not data:
        return None
    fields = ModelShape.__dataclass_fields__
    return ModelShape(**{k: v for k, v in data.items() if k in fields})


def _ceilings(data: dict | None) -> DeviceCeilings | None:
    fields = DeviceCeilings.__dataclass_fields__
    optional = ("gemm_node_s", "gemm_curve", "matmul_curve")  # absent from older calibrations
    if not isinstance(data, dict) or any(k not in data for k in fields if k not in optional):
        return None
    return DeviceCeilings(**{k: v for k, v in data.items() if k in fields})


def _normal_dtype(name: str | None) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
        str(name or "").lower(), str(name or "").lower())


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def positions(values) -> str:
    return ", ".join(f"{a:.2f}" for a in values) or "none"


@dataclass(frozen=True)
class CostView:
    """The profiled deployment in cost-model terms, with its measured acceptance."""
    dev: DeviceCeilings
    dep: Deployment
    per_position: tuple[float, ...]   # measured acceptance a_1..a_k of the profiled drafter
    tau: float
    device: str
    dtype: str
    batch: int                        # the deployment's batch (the profile's when the deployment gives none)
    # measured fraction of row-steps whose drafter found at least one draft (acceptance.draft_availability); None
    # when the profile does not record it (a_1 then only bounds it below: a row accepts a draft only if it had one)
    availability: float | None = None
    heads: tuple[str, ...] = ()       # EAGLE-3 heads the deployment has for its target (optimize --head)
    synthetic: bool = False           # the target's weights are random (engine/synthetic.py): its text is noise
    replay: tuple[float, ...] = ()    # optimize --acceptance: a_i, the share of steps accepting >= i drafts, replayed
    # ... and per depth, the chances that the target's token is the drafter's 2nd, 3rd, ... candidate (FILE's ranks)
    replay_ranks: tuple[tuple[float, ...], ...] = ()

    @classmethod
    def from_context(cls, deployment: dict, profile: dict) -> "CostView | None":
        """None when the profile has no cost-model deployment (nothing can be predicted then)."""
        pred = (profile or {}).get("prediction") or {}
        dep = pred.get("deployment")
        # The deployment's ceilings (memory's copy) override the profile's, which alone carry the CPU's GEMM curve.
        dev = _ceilings({**((profile or {}).get("ceilings") or {}), **((deployment or {}).get("ceilings") or {})})
        if not dep or dev is None:
            return None
        fields = Deployment.__dataclass_fields__
        dep = Deployment(**{k: v for k, v in dep.items() if k in fields} |
                         {"model": _shape(dep["model"]), "drafter_model": _shape(dep.get("drafter_model"))})
        meta, acc = profile.get("meta") or {}, profile.get("acceptance") or {}
        device = str((deployment or {}).get("device") or meta.get("device") or "cpu")
        dtype = _normal_dtype((deployment or {}).get("dtype") or meta.get("dtype"))
        batch = int((deployment or {}).get("batch_size") or meta.get("batch_size") or dep.batch)
        availability = acc.get("draft_availability")
        return cls(dev, dep, tuple(acc.get("per_position") or ()), float(acc.get("tau") or 1.0), device, dtype, batch,
                   None if availability is None else float(availability),
                   tuple((deployment or {}).get("drafter_heads") or ()), bool((deployment or {}).get("synthetic")),
                   tuple(float(a) for a in (deployment or {}).get("replay_acceptance") or ()),
                   tuple(tuple(float(v) for v in r) for r in (deployment or {}).get("replay_ranks") or ()))

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def acceptance(self, k: int) -> list[float]:
        """Measured acceptance for positions 1..k; positions beyond the measured ones are taken at the worst measured
        position (conservative: no unmeasured position is assumed to accept better than any measured one)."""
        measured = list(self.per_position)
        if len(measured) >= k:
            return measured[:k]
        return measured + [min(measured) if measured else 0.0] * (k - len(measured))

    def current(self) -> Prediction:
        return predict(self.dep, self.dev, list(self.per_position))

    def predict(self, dep: Deployment, acceptance) -> Prediction:
        return predict(dep, self.dev, acceptance, self.availability)

    def per_token_acceptance(self) -> float:
        """The single per-token rate that gives the measured tau at the measured k."""
        return break_even_rate(self.dep.k, self.tau) if self.dep.k else 0.0


def break_even_rate(k: int, tokens: float) -> float | None:
    """The per-token acceptance a at which k drafts give `tokens` tokens a step; None when even a = 1 cannot."""
    if tokens <= 1.0:
        return 0.0
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(k, mid) < tokens else (lo, mid)
    return hi


def _scaled_kernels(measured: int | None, estimate_now: int, estimate_new: int) -> int | None:
    """A measured kernel count carried over to another configuration in proportion to the structural estimates:
    the profiler counted the real ops (on CPU every aten op, several times the compiled estimate), the structure says
    how they scale."""
    if not measured:
        return None
    return max(1, round(measured * estimate_new / max(estimate_now, 1)))


def _ngram_kernels(orders: int) -> int:
    return KERNELS_PER_NGRAM_ORDER * orders + KERNELS_NGRAM_FIXED


def _phases(p: Prediction) -> str:
    return (f"step {ms(p.step_s)} (draft {ms(p.draft.time_s)}, verify {ms(p.verify.time_s)}, "
            f"bookkeeping {ms(p.bookkeeping.time_s)})")
