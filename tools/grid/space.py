"""The grid's space file: its format, its validation and its expansion into recipes (docs/GRID.md).

    {"base": {recipe fields}, "axes": {"dotted.key": [values, ...]},
     "variants": [{"name": "...", "base": {...}, "axes": {...}}, ...],
     "constraints": [{"if": {"dotted.key": value}, "then": {"dotted.key": value}}, ...]}

A space is validated whole before anything runs, so that a typo costs one line, not a half-run grid. Expansion is
deterministic (axes in the order written, the last varying fastest; variants in order), so two runs of one file
name and order their recipes alike. Whether a combination is a valid recipe is engine/recipe.py's `parse`'s call
alone: a refused combination is skipped with the parser's reason, never fatal.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...engine.errors import SpecPilotError
from ...engine.recipe import Recipe, RecipeError, parse, reported_name

TOP_KEYS = ("base", "axes", "variants", "constraints")
VARIANT_KEYS = ("name", "base", "axes")
CONSTRAINT_KEYS = ("if", "then")
SHIPPED = Path(__file__).parent / "data"  # grids that ship with the package: `--space NAME` finds NAME.json here
MAX_COMBINATIONS = 100_000  # a product past this is a mistake in the file, refused before it is enumerated
RESERVED_NAMES = ("ar", "stock", "ar-fused-overlap")  # the bench's own systems and the grid's reference
# Short name parts for the keys grids vary most; any other key is named by its last segment.
SHORT = {"k": "k", "drafter.max_ngram": "ng", "drafter.min_ngram": "mn", "drafter.adaptive": "adapt",
         "drafter.ar_after_miss": "arm", "drafter.layers": "ls", "overlap": "ovl", "batch.controller": "ctl",
         "batch.ragged": "ragged", "batch.probe_every": "probe", "batch.refill_at": "refill", "batch.max_batch_size": "mb", "tree.topk": "topk",
         "tree.depth": "depth", "tree.tokens": "tok", "cuda_graphs": "graphs", "compile": "compile"}
VALUE_ONLY = ("layer", "drafter.kind", "verification", "tree.kind", "weights.format")  # the value says which key


class SpaceError(SpecPilotError):
    """The space file cannot be expanded as written: one line naming what is wrong."""


@dataclass
class GridRecipe:
    """One recipe of the expansion: its name, its recipe data (a valid recipe file) and the axis values it took."""
    name: str
    recipe: dict
    values: dict
    variant: str | None = None


@dataclass
class Skipped:
    """A combination left out of the measurement, and why (a constraint, the recipe parser, a duplicate)."""
    name: str
    values: dict
    reason: str
    variant: str | None = None


@dataclass
class Expansion:
    recipes: list[GridRecipe] = field(default_factory=list)
    excluded: list[Skipped] = field(default_factory=list)  # a constraint left them out
    refused: list[Skipped] = field(default_factory=list)  # the recipe parser refused them
    duplicates: list[Skipped] = field(default_factory=list)  # the same recipe as an earlier combination
    combinations: int = 0

    def to_dict(self) -> dict:
        return {"combinations": self.combinations, "recipes": [asdict(r) for r in self.recipes],
                "excluded": [asdict(s) for s in self.excluded], "refused": [asdict(s) for s in self.refused],
                "duplicates": [asdict(s) for s in self.duplicates]}


# -- reading and validating --------------------------------------------------------------------------------------

def shipped_grids() -> list[str]:
    """The names of the grids shipped in data/ (`smollm2` is data/smollm2.json)."""
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def space_path(spec: str) -> Path:
    """A space file path, or the name of a shipped grid (`smollm2` is data/smollm2.json)."""
    path = Path(spec)
    if path.is_file():
        return path
    shipped = SHIPPED / f"{spec}.json"
    if "/" not in spec and shipped.is_file():
        return shipped
    names = ", ".join(shipped_grids())
    raise SpaceError(f"space {spec!r} is neither a file nor a shipped grid ({names})")


def load_space(spec: str) -> dict:
    """The space file, read and validated (SpaceError naming the first problem)."""
    path = space_path(spec)
    try:
        space = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpaceError(f"space file {path} is not valid JSON: {e}") from None
    validate_space(space, str(path))
    return space


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise SpaceError(f"{what}: expected an object, got {type(value).__name__}")
    return value


def _keys(data: dict, allowed: tuple[str, ...], what: str) -> None:
    for key in data:
        if key not in allowed:
            raise SpaceError(f"{what}: key {key!r} is unknown (allowed: {', '.join(allowed)})")


def _axes(axes, what: str) -> None:
    for key, values in _object(axes, what).items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise SpaceError(f"{what}: axis {key!r} is not a dotted recipe key")
        if not isinstance(values, list):
            raise SpaceError(f"{what}: axis {key!r}: expected a list of values, got {type(values).__name__}")
        if not values:
            raise SpaceError(f"{what}: axis {key!r} has no values")


def validate_space(space, where: str = "space") -> None:
    """Every structural rule of the format; what makes a valid recipe is left to `parse`."""
    _keys(_object(space, where), TOP_KEYS, where)
    base = _object(space.get("base", {}), f"{where}: base")
    _axes(space.get("axes", {}), f"{where}: axes")
    variants = space.get("variants", [])
    if not isinstance(variants, list):
        raise SpaceError(f"{where}: variants: expected a list, got {type(variants).__name__}")
    names = set()
    for i, variant in enumerate(variants):
        what = f"{where}: variants[{i}]"
        _keys(_object(variant, what), VARIANT_KEYS, what)
        name = variant.get("name", f"v{i}")
        if not isinstance(name, str) or not name or name in names:
            raise SpaceError(f"{what}: name {name!r} must be a non-empty string, unique among the variants")
        names.add(name)
        merge(base, _object(variant.get("base", {}), f"{what}: base"), f"{what}: base")
        _axes(variant.get("axes", {}), f"{what}: axes")
    constraints = space.get("constraints", [])
    if not isinstance(constraints, list):
        raise SpaceError(f"{where}: constraints: expected a list, got {type(constraints).__name__}")
    defaults = asdict(Recipe())
    for i, rule in enumerate(constraints):
        what = f"{where}: constraints[{i}]"
        _keys(_object(rule, what), CONSTRAINT_KEYS, what)
        for part in CONSTRAINT_KEYS:
            pairs = _object(rule.get(part), f"{what}: {part!r}")
            if not pairs:
                raise SpaceError(f"{what}: {part!r} names no key")
            for key in pairs:
                if lookup(defaults, key) is MISSING:  # a misspelt key would silently never match
                    raise SpaceError(f"{what}: {part!r} key {key!r} is not a recipe key")


# -- dotted keys -----------------------------------------------------------------------------------------------

MISSING = object()


def lookup(data: dict, key: str):
    """The value at a dotted key, MISSING where there is none."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def assign(data: dict, key: str, value, what: str) -> None:
    """Set a dotted key in place, making the objects on its way; a key through a non-object is a SpaceError."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpaceError(f"{what}: key {key!r} goes through {'.'.join(parts[:i + 1])!r}, which is "
                             f"{type(child).__name__} {child!r}, not an object")
        node = child
    last = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        node[last] = merge(node[last], value, what)
    else:
        node[last] = copy.deepcopy(value)


def merge(base: dict, over: dict, what: str) -> dict:
    """`over` merged onto a copy of `base`, objects merged key by key (a variant's base onto the top base)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        assign(out, key, value, what)
    return out


# -- expansion --------------------------------------------------------------------------------------------------

def subgrids(space: dict) -> list[tuple[str | None, dict, dict]]:
    """(variant name, base, axes) per sub-grid: the top grid alone, or each variant's base merged onto the top base
    and its axes added to the top axes (a variant's axis replaces a top axis of the same key)."""
    base, axes = space.get("base", {}), space.get("axes", {})
    variants = space.get("variants", [])
    if not variants:
        return [(None, base, axes)]
    return [(v.get("name", f"v{i}"), merge(base, v.get("base", {}), f"variants[{i}]: base"),
             {**axes, **v.get("axes", {})}) for i, v in enumerate(variants)]


def count_combinations(space: dict) -> int:
    return sum(math.prod(len(vs) for vs in axes.values()) for _, _, axes in subgrids(space))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text).strip("_.") or "x"


def name_part(key: str, value, index: int) -> str:
    """A short, filesystem-safe name for one axis value: `k4`, `ng2`, `fused`, `adapt` (true; false says nothing),
    `paths1` (the axis' second value, for a list or an object)."""
    short = SHORT.get(key, _safe(key.rsplit(".", 1)[-1]))
    if isinstance(value, bool):
        return short if value else ""
    if isinstance(value, (int, float)):
        return f"{short}{_safe(str(value))}"
    if isinstance(value, str):
        return _safe(value) if key in VALUE_ONLY else f"{short}-{_safe(value)}"
    return f"{short}{index}"


def combination_name(prefix: str | None, axes: dict, picks: tuple[int, ...]) -> str:
    parts = [prefix] if prefix else []
    parts += [name_part(key, axes[key][i], i) for key, i in zip(axes, picks)]
    return "-".join(p for p in parts if p) or "base"


def matches(data: dict, pairs: dict) -> bool:
    return all(lookup(data, key) == value for key, value in pairs.items())


def violated(full: dict, constraints: list[dict]) -> dict | None:
    """The first constraint whose `if` pairs all match and whose `then` pairs do not, else None."""
    for rule in constraints:
        if matches(full, rule["if"]) and not matches(full, rule["then"]):
            return rule
    return None


def unique_name(name: str, taken: set[str]) -> str:
    out, n = name, 2
    while out in taken or out in RESERVED_NAMES:
        out, n = f"{name}-{n}", n + 1
    return out


def identity(recipe: Recipe) -> str:
    """What makes two recipes the same engine configuration: everything but the labels."""
    data = asdict(recipe)
    for key in ("name", "description", "measured"):
        data.pop(key)
    return json.dumps(data, sort_keys=True)


def expand(space: dict, max_recipes: int | None = None) -> Expansion:
    """Every combination of every sub-grid: merged over its base, named, checked against the constraints (on the
    recipe with its defaults, so that `if overlap: false` matches a recipe that leaves it out), parsed, and kept
    unless a constraint, the parser or an earlier identical recipe leaves it out. More than `max_recipes` recipes
    (or MAX_COMBINATIONS combinations) is a SpaceError naming the count."""
    validate_space(space)
    total = count_combinations(space)
    if total > MAX_COMBINATIONS:
        raise SpaceError(f"the space has {total} combinations, more than {MAX_COMBINATIONS}: narrow its axes")
    defaults = asdict(Recipe())
    constraints = space.get("constraints", [])
    out, taken, seen = Expansion(combinations=total), set(), {}
    for variant, base, axes in subgrids(space):
        what = f"variant {variant!r}" if variant else "the space"
        for picks in itertools.product(*(range(len(vs)) for vs in axes.values())):
            values = {key: axes[key][i] for key, i in zip(axes, picks)}
            data = copy.deepcopy(base)
            for key, value in values.items():
                assign(data, key, value, what)
            full = merge(defaults, data, what)
            name = combination_name(variant, axes, picks)
            # the bench's name for it (a replay recipe's says so), so that the ranking finds it
            name = reported_name(name, full.get("drafter", {}).get("kind", "none"))
            name = unique_name(name, taken)
            taken.add(name)
            rule = violated(full, constraints)
            if rule is not None:
                out.excluded.append(Skipped(name, values, f"constraint if {json.dumps(rule['if'])} then "
                                                          f"{json.dumps(rule['then'])}", variant))
                continue
            data["name"] = name
            try:
                recipe = parse(data)
            except RecipeError as e:
                out.refused.append(Skipped(name, values, str(e), variant))
                continue
            key = identity(recipe)
            if key in seen:
                out.duplicates.append(Skipped(name, values, f"the same recipe as {seen[key]}", variant))
                continue
            seen[key] = name
            out.recipes.append(GridRecipe(name, data, values, variant))
    if max_recipes is not None and len(out.recipes) > max_recipes:
        raise SpaceError(f"the space expands to {len(out.recipes)} recipes, more than --max-recipes {max_recipes}: "
                         "narrow its axes, add constraints or raise --max-recipes")
    return out
