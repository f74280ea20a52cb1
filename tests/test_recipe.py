"""Recipe parsing: unknown keys and wrong types are rejected naming the key path; files, built-ins, round trips."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from specpilot.engine.errors import SpecPilotError
from specpilot.kernels.builtin import DEFAULTS as KERNEL_DEFAULTS
from specpilot.engine.recipe import (BUILTIN, DRAFTER_KINDS, SCHEMA_VERSION, DrafterSpec, Recipe, RecipeError,
                                     load_recipe, parse)


def test_recipe_error_is_a_specpilot_error():
    assert issubclass(RecipeError, SpecPilotError)


def test_empty_object_gives_the_defaults():
    r = parse({})
    assert r == Recipe()
    assert r.k == 0 and r.drafter.kind == "none" and r.specpilot_recipe == SCHEMA_VERSION
    assert r.kernels == KERNEL_DEFAULTS


def test_full_recipe_parses_into_typed_fields():
    r = parse({"name": "mine", "drafter": {"kind": "ngram", "max_ngram": 4, "min_ngram": 2}, "k": 6,
               "cuda_graphs": False, "batch": {"max_batch_size": 8}, "kernels": {"linear": "builtin:torch"},
               "measured": {"speedup": 1.7}})
    assert isinstance(r.drafter, DrafterSpec)
    assert (r.name, r.k, r.drafter.kind, r.drafter.max_ngram, r.drafter.min_ngram) == ("mine", 6, "ngram", 4, 2)
    assert r.cuda_graphs is False and r.batch.max_batch_size == 8 and r.measured == {"speedup": 1.7}


@pytest.mark.parametrize("data,path", [
    ({"kk": 4}, "kk"),
    ({"drafter": {"kindd": "ngram"}}, "drafter.kindd"),
    ({"batch": {"max_batch": 4}}, "batch.max_batch"),
    ({"weights": {"format": "native", "bits": 4}}, "weights.bits"),
])
def test_unknown_keys_are_rejected_naming_the_path(data, path):
    with pytest.raises(RecipeError) as e:
        parse(data)
    msg = str(e.value)
    assert repr(path) in msg and "unknown" in msg


@pytest.mark.parametrize("data,path,got", [
    ({"k": "4"}, "k", "str"),
    ({"k": 4.0, "drafter": {"kind": "ngram"}}, "k", "float"),
    ({"k": True, "drafter": {"kind": "ngram"}}, "k", "bool"),  # bool is an int in Python, not in a recipe
    ({"drafter": {"kind": "ngram", "max_ngram": False}, "k": 2}, "drafter.max_ngram", "bool"),
    ({"cuda_graphs": 1}, "cuda_graphs", "int"),
    ({"name": 3}, "name", "int"),
    ({"drafter": "ngram"}, "drafter", "str"),
    ({"drafter": {"kind": 1}}, "drafter.kind", "int"),
    ({"batch": {"max_batch_size": None}}, "batch.max_batch_size", "NoneType"),
    ({"kernels": ["linear"]}, "kernels", "list"),
    ({"measured": 1}, "measured", "int"),
])
def test_wrong_types_are_rejected_naming_the_path(data, path, got):
    with pytest.raises(RecipeError) as e:
        parse(data)
    msg = str(e.value)
    assert path in msg and got in msg


def test_kernel_value_type_is_checked():
    with pytest.raises(RecipeError, match="linear") as e:
        parse({"kernels": {"linear": 3}})
    assert "int" in str(e.value)


def test_root_must_be_an_object():
    with pytest.raises(RecipeError, match="<root>"):
        parse([1, 2])


@pytest.mark.parametrize("data,path,words", [
    ({"drafter": {"kind": "medusa"}, "k": 4}, "drafter.kind", "medusa"),
    ({"drafter": {"kind": "ngram"}, "k": 0}, "k", "between 1 and 64"),
    ({"drafter": {"kind": "ngram"}}, "k", "between 1 and 64"),  # k defaults to 0
    ({"drafter": {"kind": "ngram"}, "k": 65}, "k", "between 1 and 64"),
    ({"drafter": {"kind": "ngram"}, "k": -1}, "k", "between 1 and 64"),
    ({"k": 4}, "k", "without a drafter"),
    ({"drafter": {"kind": "ngram", "min_ngram": 3, "max_ngram": 2}, "k": 4}, "drafter.min_ngram", "min_ngram"),
    ({"drafter": {"kind": "ngram", "min_ngram": 0}, "k": 4}, "drafter.min_ngram", "min_ngram"),
    ({"drafter": {"kind": "layerskip"}, "k": 4}, "drafter.layers", "layers >= 1"),
    ({"drafter": {"kind": "model"}, "k": 4}, "drafter.model", "draft model"),
    ({"verification": "beam"}, "verification", "beam"),
    ({"weights": {"format": "int4"}}, "weights.format", "int4"),
    ({"kernels": {"matmul": "builtin:torch"}}, "kernels.matmul", "slot"),
    ({"kernels": {"linear": "triton:fast"}}, "kernels.linear", "triton:fast"),
    ({"batch": {"max_batch_size": 0}}, "batch.max_batch_size", ">= 1"),
    ({"specpilot_recipe": 2}, "specpilot_recipe", "version 2"),
    ({"layer": "fusedd"}, "layer", "modular, fused"),
])
def test_invalid_values_are_rejected(data, path, words):
    with pytest.raises(RecipeError) as e:
        parse(data)
    msg = str(e.value)
    assert repr(path) in msg and words in msg


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_every_drafter_kind_has_a_valid_recipe(kind):
    spec = {"kind": kind, "layers": 2, "model": "smollm2-135m"} if kind != "none" else {}
    if kind == "replay":
        spec["acceptance"] = [0.9, 0.7, 0.5, 0.3, 0.1]
    r = parse({"drafter": spec, "k": 0 if kind == "none" else 5})
    assert r.drafter.kind == kind


@pytest.mark.parametrize("data", [
    {},
    {"name": "x", "drafter": {"kind": "layerskip", "layers": 10}, "k": 8, "cuda_graphs": False,
     "measured": {"speedup": 2.5, "gate": {"ok": True}}, "batch": {"max_batch_size": 3}},
    {"drafter": {"kind": "model", "model": "/models/draft", "dtype": "bf16"}, "k": 5, "description": "d"},
])
def test_round_trip_through_json(data):
    r = parse(data)
    again = parse(json.loads(r.to_json()))
    assert again == r
    assert again.to_json() == r.to_json()


def test_save_and_load_file(tmp_path):
    r = parse({"name": "saved", "drafter": {"kind": "ngram", "max_ngram": 5}, "k": 7})
    path = tmp_path / "r.json"
    r.save(path)
    assert load_recipe(str(path)) == r
    assert load_recipe(path) == r  # a Path works too
    assert json.loads(path.read_text())["k"] == 7


def test_load_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(RecipeError, match="neither a built-in") as e:
        load_recipe(str(missing))
    assert str(missing) in str(e.value)


def test_load_directory_is_not_a_recipe(tmp_path):
    with pytest.raises(RecipeError):
        load_recipe(str(tmp_path))


@pytest.mark.parametrize("text", ['{"k": 4,', "not json", "", '{"k": 1} trailing'])
def test_load_invalid_json(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(RecipeError, match="not valid JSON") as e:
        load_recipe(str(path))
    assert str(path) in str(e.value)


def test_load_non_utf8_file(tmp_path):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(RecipeError):
        load_recipe(str(path))


def test_load_file_with_schema_errors_names_the_key(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"drafter": {"kind": "ngram", "n": 3}, "k": 4}))
    with pytest.raises(RecipeError, match="drafter.n"):
        load_recipe(str(path))


def test_builtin_ar():
    r = load_recipe("ar")
    assert r.name == "ar" and r.drafter.kind == "none" and r.k == 0


def test_builtin_stock():
    r = load_recipe("stock")
    assert r.name == "stock" and r.drafter.kind == "ngram" and r.k == 4
    assert (r.drafter.max_ngram, r.drafter.min_ngram) == (3, 1)


def test_stock_is_the_targets(tmp_path):
    """A target with a packaged head (by alias, or its GGUF anywhere) gets that head's chain of STOCK_HEAD_K drafts,
    vLLM's EAGLE-3 default; any other target, or none, the n-gram stock, which `stock-ngram` names for every target."""
    from specpilot.engine import packaged
    from specpilot.engine.recipe import STOCK_HEAD_K, stock_recipe

    assert STOCK_HEAD_K == 2
    for target in ("smollm2-135m", str(packaged.path())):
        r = load_recipe("stock", target)
        assert r.name == "stock" and r.drafter.kind == "eagle3" and r.k == 2
        assert r.drafter.model == "smollm2-135m-eagle3" and r.verification == "chain" and r.layer == "modular"
        assert asdict(stock_recipe(target)) == asdict(r)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF not the packaged one")
    for target in (None, str(other), str(tmp_path)):
        assert asdict(load_recipe("stock", target)) == asdict(BUILTIN["stock"])
    named = load_recipe("stock-ngram", "smollm2-135m")
    assert named.name == "stock-ngram" and named.drafter.kind == "ngram" and named.k == 4
    assert {**asdict(named), "name": "stock"} == asdict(BUILTIN["stock"])


def test_builtins_are_copies():
    """Mutating a loaded built-in must not change the next load."""
    r = load_recipe("stock")
    r.k = 9
    r.drafter.kind = "layerskip"
    r.kernels["linear"] = "x"
    again = load_recipe("stock")
    assert again.k == 4 and again.drafter.kind == "ngram" and again.kernels["linear"] == "builtin:torch"
    assert asdict(BUILTIN["stock"]) == asdict(again)


def test_builtin_names_win_over_files_of_that_name(tmp_path, monkeypatch):
    """A built-in name resolves to the built-in even if a file of that name exists in the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ar").write_text(json.dumps({"name": "file", "drafter": {"kind": "ngram"}, "k": 2}))
    assert load_recipe("ar").name == "ar"
    assert load_recipe("./ar").name == "file"
