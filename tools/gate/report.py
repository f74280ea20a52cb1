"""The gate's verdict: DIR/report.json (fields documented in docs/GATE.md) and the readable DIR/summary.txt."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class GateReport:
    passed: bool
    reason: str | None  # None on a pass; one line naming the first failure otherwise
    target: str
    recipe: dict  # the parsed recipe the candidate ran (with --batch-size applied)
    workload: str
    limit: int | None
    max_new_tokens: int
    salt: str
    epsilon: float | None  # None when the check stopped before the reference existed
    noise: float | None
    safety_factor: float
    epsilon_floor: float | None
    dtype: str
    device: str
    patch: str | None = None
    batch_size: int | None = None
    tokens_checked: int = 0
    exact_matches: int = 0
    ties: list[dict] = field(default_factory=list)  # {question_id, position, reference_token, candidate_token, margin}
    failure: dict | None = None
    per_question: list[dict] = field(default_factory=list)
    reference_cached: bool = False
    reference_seconds: float = 0.0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def write(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        (out_dir / "summary.txt").write_text(self.summary() + "\n")

    def summary(self) -> str:
        n_q = len(self.per_question)
        lines = [f"specpilot check: {'PASS' if self.passed else 'FAIL'}" + ("" if self.passed else f": {self.reason}"),
                 f"  target {self.target}, recipe {self.recipe.get('name')!r} (k={self.recipe.get('k')}, "
                 f"drafter {self.recipe.get('drafter', {}).get('kind')}, "
                 f"batch {self.recipe.get('batch', {}).get('max_batch_size')}), {self.dtype} on {self.device}",
                 f"  workload {self.workload}: {n_q} questions, max_new_tokens {self.max_new_tokens}, salt {self.salt}"]
        if self.patch:
            lines.append(f"  patch {self.patch}")
        if self.epsilon is not None:
            lines.append(f"  epsilon {self.epsilon:.3g} = max({self.safety_factor:g} x noise {self.noise:.3g}, "
                         f"floor {self.epsilon_floor:.3g}); reference "
                         f"{'from cache' if self.reference_cached else f'computed in {self.reference_seconds:.1f} s'}")
        lines.append(f"  tokens checked {self.tokens_checked}, exact matches {self.exact_matches}, "
                     f"ties forced {len(self.ties)}")
        for t in self.ties:
            lines.append(f"    tie: question {t['question_id']} token {t['position']}: reference "
                         f"{t['reference_token']['text']!r} ({t['reference_token']['id']}) vs candidate "
                         f"{t['candidate_token']['text']!r} ({t['candidate_token']['id']}), margin {t['margin']:.3g}")
        f = self.failure
        if f:
            where = f" (question {f['question_id']}, token {f['position']})" if "question_id" in f else ""
            lines.append(f"  failure: {f['kind']}{where}")
            if f.get("context") is not None:
                lines.append(f"    context (last tokens before it): ...{f['context']!r}")
            if f.get("stderr_tail"):
                lines.append("    candidate stderr (tail):")
                lines += ["      " + s for s in f["stderr_tail"].rstrip().splitlines()[-15:]]
        lines.append(f"  {self.seconds:.1f} s")
        return "\n".join(lines)
