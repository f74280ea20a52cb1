"""From a provider's answer to a checked candidate: validated as a Candidate, merged into the current best recipe,
parsed by the recipe schema, and written to DIR/candidates/<id>/ (kernel source, recipe.json, candidate.json).

Nothing here runs candidate code: a kernel's source is only written to a file, which the recipe then names. A
candidate that fails any check is recorded with the error and never evaluated.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from ..engine.recipe import RecipeError, parse
from ..kernels import SLOTS
from .artifacts import candidate_dir, recipe_key, write_json
from .candidates import AGENTS, Candidate, CandidateError, merge_patch

RESERVED = ("measured", "name")  # tools attach measurements and the graph names recipes; a candidate may do neither
# Which agent owns a recipe field; the rest (graphs, compile, overlap, batch) is the scheduler's.
FIELD_OWNERS = {"drafter": "algorithm", "k": "algorithm", "verification": "algorithm", "kernels": "kernel_writer",
                "weights": "kernel_writer", "layer": "kernel_writer"}


def owner_of(patch: dict) -> str:
    """The agent a patch of several fields is proposed by: the owner of its first field in FIELD_OWNERS' order, else
    the scheduler."""
    return next((FIELD_OWNERS[k] for k in FIELD_OWNERS if k in patch), "scheduler")


def plain(recipe: dict) -> dict:
    """The recipe without the measurements attached to it."""
    return {k: v for k, v in recipe.items() if k != "measured"}


def leaves(value, prefix: str = "") -> dict:
    """{"drafter.kind": "ngram", "k": 4, ...}: every leaf of a JSON object by its dotted path."""
    if isinstance(value, dict) and value:
        out = {}
        for k, v in value.items():
            out |= leaves(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): value}


def changes(before: dict, after: dict) -> dict:
    """Leaf path -> (before, after) for what differs, ignoring name, description and measurements."""
    a = leaves({k: v for k, v in before.items() if k not in ("name", "description", "measured")})
    b = leaves({k: v for k, v in after.items() if k not in ("name", "description", "measured")})
    return {p: (a.get(p), b.get(p)) for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)}


def _raw_id(raw) -> str:
    return "x" + hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:11]


def as_candidate(raw, agent: str, origin: str) -> Candidate:
    """Candidate.from_dict semantics on whatever a provider or a person gave (a Candidate or a mapping)."""
    return Candidate.from_dict(raw.to_dict() if isinstance(raw, Candidate) else raw, agent=agent, origin=origin)


def materialize(cand: Candidate, best_recipe: dict, out: Path) -> tuple[dict | None, str | None]:
    """(the candidate's recipe as a dict, None) written to DIR/candidates/<id>/recipe.json, or (None, why not)."""
    bad = [k for k in RESERVED if k in cand.recipe_patch]
    if bad:
        return None, f"recipe_patch sets {', '.join(bad)}: measurements and names are the graph's, not a candidate's"
    d = candidate_dir(out, cand.id)
    patch = dict(cand.recipe_patch)
    if cand.kernel is not None:
        if cand.kernel.slot not in SLOTS:
            return None, f"kernel slot {cand.kernel.slot!r} is not one of {', '.join(SLOTS)}"
        source = d / f"{cand.kernel.slot}.py"
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(cand.kernel.source)
        # the file the graph wrote is what the recipe names, whatever path the patch gave for this slot
        patch = merge_patch(patch, {"kernels": {cand.kernel.slot: str(source.resolve())}})
    merged = merge_patch(plain(best_recipe), patch) | {"name": f"cand-{cand.id}", "description": cand.reason[:300]}
    try:
        recipe = asdict(parse(merged))
    except RecipeError as e:
        return None, str(e)
    if not changes(best_recipe, recipe):
        return None, "the patch changes nothing in the current best recipe"
    write_json(d / "recipe.json", recipe)
    return recipe, None


def record(raw, agent: str, origin: str, best_recipe: dict, out: Path, round_: int, pass_: int, order: int,
           who: str) -> dict:
    """The state's record of one proposal: status `proposed` (valid, not evaluated yet) or `invalid` with the
    validation error."""
    base = {"round": round_, "pass": pass_, "order": order, "agent": agent, "proposed_by": who, "error": None,
            "recipe_path": None, "recipe_key": None}
    try:
        cand = as_candidate(raw, agent, origin)
    except CandidateError as e:
        data = raw.to_dict() if isinstance(raw, Candidate) else raw
        return base | {"id": _raw_id(data), "status": "invalid", "error": f"not a candidate: {e}",
                       "candidate": data if isinstance(data, dict) else {"raw": repr(data)}, "origin": origin,
                       "reason": str(data.get("reason", "")) if isinstance(data, dict) else ""}
    rec = base | {"id": cand.id, "agent": cand.agent, "origin": cand.origin, "reason": cand.reason,
                  "candidate": cand.to_dict()}
    if cand.agent not in AGENTS:
        return rec | {"status": "invalid", "error": f"unknown agent {cand.agent!r}"}
    recipe, error = materialize(cand, best_recipe, out)
    if error:
        write_json(candidate_dir(out, cand.id) / "candidate.json", rec | {"status": "invalid", "error": error})
        return rec | {"status": "invalid", "error": error}
    rec |= {"status": "proposed", "recipe_path": str(candidate_dir(out, cand.id) / "recipe.json"),
            "recipe_key": recipe_key(recipe)}
    write_json(candidate_dir(out, cand.id) / "candidate.json", rec)
    return rec
