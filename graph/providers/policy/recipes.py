"""The recipe as the policy changes it: the agents' names and the fields each may change, a patch applied and checked
against the recipe it changes, and what an engine would run with the result, so that two patches with the same effect
are one change; and how a reason names the current drafter."""
from __future__ import annotations

import json
from dataclasses import asdict

from ....engine.recipe import Recipe, RecipeError, parse
from ....kernels import DEFAULTS as KERNEL_DEFAULTS
from ...candidates import KernelSource, merge_patch

# The recipe fields each agent may change (the prompts say the same; the OpenAI provider enforces it).
AGENT_FIELDS = {
    "algorithm": ("drafter", "k", "verification", "tree"),
    "scheduler": ("cuda_graphs", "compile", "compile_mode", "overlap", "batch"),
    "kernel_writer": ("kernels", "weights", "layer"),
}


def agent_name(gap_agent: str) -> str:
    """The profiler writes `kernel-writer`; the graph's agents are Python names."""
    return str(gap_agent).replace("-", "_")


def apply_patch(recipe: dict, patch: dict) -> Recipe:
    """The recipe with `patch` merged in, validated (RecipeError names the bad key)."""
    return parse(merge_patch(recipe, patch))


# The drafter fields each kind reads (docs/RECIPE.md); the others are ignored by the engine.
DRAFTER_FIELDS = {"none": (), "ngram": ("max_ngram", "min_ngram", "adaptive", "ar_after_miss"),
                  "layerskip": ("layers", "adaptive", "ar_after_miss"), "model": ("model", "dtype", "adaptive",
                                                                                  "ar_after_miss"),
                  "eagle3": ("model", "adaptive", "ar_after_miss")}


def recipe_effect(recipe: Recipe, kernel: KernelSource | None = None) -> str:
    """What an engine runs with this recipe: equal strings are the same change, whatever the patch looked like
    (names, descriptions, drafter fields the drafter kind does not read and slots named at their default make no
    difference)."""
    body = asdict(recipe)
    for key in ("name", "description", "measured"):
        body.pop(key)
    drafter = body["drafter"]
    body["drafter"] = {"kind": drafter["kind"], **{f: drafter[f] for f in DRAFTER_FIELDS.get(drafter["kind"], ())}}
    body["kernels"] = {**KERNEL_DEFAULTS, **body["kernels"]}  # a slot left out runs its default
    return json.dumps({"recipe": body, "kernel": asdict(kernel) if kernel else None}, sort_keys=True)


def checkable_patch(patch: dict, kernel: KernelSource | None) -> dict:
    """The patch without the kernel slot a kernel candidate fills: the graph writes the source to a file and points
    kernels.<slot> at it, so whatever path the patch names there cannot be checked here."""
    if kernel is None or not isinstance(patch.get("kernels"), dict):
        return patch
    return {**patch, "kernels": {s: v for s, v in patch["kernels"].items() if s != kernel.slot}}


def patch_error(recipe: dict, patch: dict, agent: str | None = None, kernel: KernelSource | None = None) -> str | None:
    """Why `patch` is not a valid change of `recipe` (by `agent`), or None when it is one."""
    if agent is not None:
        outside = sorted(set(patch) - set(AGENT_FIELDS[agent]))
        if outside:
            return (f"the {agent} agent may change only {', '.join(AGENT_FIELDS[agent])}; "
                    f"this patch changes {', '.join(outside)}")
    try:
        after = apply_patch(recipe, checkable_patch(patch, kernel))
    except RecipeError as e:
        return str(e)
    if kernel is None and recipe_effect(after) == recipe_effect(parse(recipe)):
        return "the patch changes nothing in the current recipe"
    return None


def _describe_current(recipe: Recipe) -> str:
    d = recipe.drafter
    if d.kind == "none":
        return "AR (no drafter)"
    if d.kind == "ngram":
        return f"n-gram k={recipe.k}, max_ngram={d.max_ngram}"
    if d.kind == "layerskip":
        return f"layer-skip k={recipe.k}, {d.layers} layers"
    if d.kind == "eagle3":
        return f"EAGLE-3 head {d.model} k={recipe.k}" + (" (tree)" if recipe.verification == "tree" else "")
    return f"{d.kind} drafter {d.model} k={recipe.k}" if d.kind != "model" else f"draft model {d.model} k={recipe.k}"
