"""Bad input to any `specpilot` command: one line `specpilot: error: ...` on stderr naming what was wrong, exit code
2, and no model loaded first. Numbers are checked by the same argparse validators in every command (argtypes.py);
a bad workload, recipe or file is reported the same way after parsing, before the model load."""
from __future__ import annotations

import argparse
import json

import pytest

from specpilot import cli
from specpilot.tools import argtypes
from specpilot.engine import loader
from specpilot.engine.errors import SpecPilotError

NO_MODEL = ["--target", "/no/such/model"]  # were anything loaded, the error would be about this target


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was rejected")

    monkeypatch.setattr(loader, "load", load)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("specpilot: error: "), err
    return err[0]


COMMANDS = {  # each command's arguments besides the bad one
    "generate": ["generate", "--prompt", "hi", *NO_MODEL],
    "bench": ["bench", *NO_MODEL],
    "profile": ["profile", *NO_MODEL],
    "check": ["check", *NO_MODEL, "--out", "unused"],
    "optimize": ["optimize", *NO_MODEL],
    "memory search": ["memory", "search", "overlap", "--memory", "unused.jsonl"],
}
BAD_NUMBERS = [
    ("generate", "--max-new-tokens", "-3", "must be positive"),
    ("generate", "--max-new-tokens", "0", "must be positive"),
    ("generate", "--max-new-tokens", "many", "must be an integer"),
    ("generate", "--temperature", "-0.5", "must be >= 0"),
    ("generate", "--temperature", "nan", "must be a finite number"),
    ("generate", "--top-p", "0", "must be in (0, 1]"),
    ("generate", "--top-p", "1.5", "must be in (0, 1]"),
    ("generate", "--top-k", "-1", "must be >= 0"),
    ("generate", "--seed", "-1", "must be >= 0"),
    ("bench", "--max-new-tokens", "0", "must be positive"),
    ("bench", "--limit", "0", "must be positive"),
    ("bench", "--repeats", "0", "must be positive"),
    ("bench", "--cell-requests", "-2", "must be positive"),
    ("bench", "--batch-sizes", "1,0", "must be comma-separated positive integers"),
    ("bench", "--batch-sizes", "1,x", "must be comma-separated positive integers"),
    ("bench", "--batch-sizes", ",", "must be comma-separated positive integers"),
    ("profile", "--max-new-tokens", "-3", "must be positive"),
    ("profile", "--limit", "0", "must be positive"),
    ("profile", "--batch-size", "0", "must be positive"),
    ("profile", "--repeats", "0", "must be positive"),
    ("check", "--max-new-tokens", "0", "must be positive"),
    ("check", "--limit", "-1", "must be positive"),
    ("check", "--batch-size", "0", "must be positive"),
    ("check", "--timeout", "0", "must be positive"),
    ("check", "--timeout", "inf", "must be a finite number"),
    ("optimize", "--max-new-tokens", "0", "must be positive"),
    ("optimize", "--limit", "0", "must be positive"),
    ("optimize", "--batch-size", "-1", "must be positive"),
    ("optimize", "--budget-rounds", "0", "must be positive"),
    ("optimize", "--budget-minutes", "0", "must be positive"),
    ("optimize", "--budget-gpu-minutes", "-5", "must be positive"),
    ("optimize", "--max-candidates", "0", "must be positive"),
    ("memory search", "-k", "0", "must be positive"),
]


@pytest.mark.parametrize("command, flag, value, words", BAD_NUMBERS)
def test_a_bad_number_is_one_line_and_exit_2(capsys, command, flag, value, words):
    # --flag=value: a value starting with "-" stays a value, as a script would write it
    code = cli.main([*COMMANDS[command], f"{flag}={value}"])
    line = one_error_line(capsys)
    assert code == 2
    assert f"argument {flag}: {words}" in line and repr(value) in line, line
    assert f"specpilot {command} --help" in line  # which command to look up


def test_the_same_value_is_judged_the_same_in_every_command(capsys):
    """--max-new-tokens 0 (the issue: generate took it, bench refused it) is refused alike everywhere."""
    lines = set()
    for command in ("generate", "bench", "profile", "check", "optimize"):
        assert cli.main([*COMMANDS[command], "--max-new-tokens", "0"]) == 2, command
        lines.add(one_error_line(capsys).split(" (see ")[0])
    assert lines == {"specpilot: error: argument --max-new-tokens: must be positive, got '0'"}


@pytest.mark.parametrize("command", ["bench", "profile", "check", "optimize"])
def test_an_unknown_workload_is_exit_2_in_every_command(capsys, command):
    code = cli.main([*COMMANDS[command], "--workload", "no-such-workload", "--device", "cpu"])
    line = one_error_line(capsys)
    assert code == 2, line
    if command in ("bench", "profile"):  # read before the target is looked at
        assert "no-such-workload" in line


@pytest.mark.parametrize("command", ["generate", "bench", "profile"])
def test_a_missing_recipe_is_exit_2_before_any_load(capsys, tmp_path, command):
    recipe = str(tmp_path / "missing-recipe.json")
    code = cli.main([*COMMANDS[command], "--recipe", recipe, "--device", "cpu"])
    line = one_error_line(capsys)
    assert code == 2 and "missing-recipe.json" in line, line


def test_a_missing_import_file_is_exit_2(capsys, tmp_path):
    code = cli.main(["memory", "import", str(tmp_path / "nothing.jsonl"), "--memory", str(tmp_path / "m.jsonl")])
    line = one_error_line(capsys)
    assert code == 2 and "nothing.jsonl" in line, line


def test_unknown_flag_and_help(capsys):
    assert cli.main(["generate", "--prompt", "hi", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in one_error_line(capsys)
    assert cli.main(["generate", "--help"]) == 0
    assert "--max-new-tokens" in capsys.readouterr().out


def test_run_bench_checks_arguments_built_in_code():
    """run_bench's callers in the graph build `args` themselves: they get argparse's words, as a SpecPilotError."""
    from specpilot.tools.bench.run import parse_batch_sizes, run_bench

    args = cli.build_parser().parse_args(["bench", *NO_MODEL])
    args.repeats = 0
    with pytest.raises(SpecPilotError, match=r"^argument --repeats: must be positive, got '0'$"):
        run_bench(args)
    assert parse_batch_sizes("8,1,8") == [8, 1] and parse_batch_sizes([2, 2, 4]) == [2, 4]
    with pytest.raises(SpecPilotError, match="argument --batch-sizes"):
        parse_batch_sizes([1, 0])


def test_validators_accept_what_they_should():
    assert argtypes.positive_int(" 7 ") == 7 and argtypes.non_negative_int("0") == 0
    assert argtypes.positive_float("0.5") == 0.5 and argtypes.non_negative_float("0") == 0.0
    assert argtypes.probability("1") == 1.0 and argtypes.positive_int_list("1, 8,32,8") == [1, 8, 32]
    for validator, text in ((argtypes.positive_int, "1.5"), (argtypes.probability, "-0.1"),
                            (argtypes.positive_float, "-inf")):
        with pytest.raises(argparse.ArgumentTypeError):
            validator(text)


def test_optimize_takes_heads_for_the_algorithm_agent(monkeypatch):
    """`optimize --head DIR` (repeatable) reaches the run's settings, whence the deployment's drafter_heads."""
    seen = {}
    monkeypatch.setattr("specpilot.graph.run.optimize", lambda settings: seen.update(settings) or 0)
    args = cli.build_parser().parse_args(["optimize", "--head", "heads/a", "--head", "heads/b"])
    assert args.func(args) == 0 and seen["heads"] == ["heads/a", "heads/b"]
    from specpilot.graph.state import make_settings

    assert make_settings(heads=seen["heads"], device="cpu")["heads"] == ["heads/a", "heads/b"]


def test_optimize_takes_a_replayed_acceptance(monkeypatch):
    """`optimize --acceptance A1,A2,...` reaches the run's settings as shares; anything else is refused by the parser."""
    seen = {}
    monkeypatch.setattr("specpilot.graph.run.optimize", lambda settings: seen.update(settings) or 0)
    args = cli.build_parser().parse_args(["optimize", "--target", "synthetic:llama-3.1-8b", "--acceptance",
                                          "0.82,0.672,0.551"])
    assert args.func(args) == 0 and seen["acceptance"] == [0.82, 0.672, 0.551]
    for bad in ("0.8,1.5", "0.8,,0.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="shares between 0 and 1"):
            argtypes.acceptance_profile(bad)


def test_optimize_takes_a_replayed_profile_with_ranks_from_a_file(monkeypatch, tmp_path):
    """`optimize --acceptance FILE`: the head_ranks experiment's output (its pooled profile) or a plain
    {"acceptance", "ranks"} file gives the run both; a file without them is one clear error."""
    seen = {}
    monkeypatch.setattr("specpilot.graph.run.optimize", lambda settings: seen.update(settings) or 0)
    ranks = [[0.116, 0.035], [0.149, 0.048]]
    measured = tmp_path / "head_ranks.json"
    measured.write_text(json.dumps({"results": {"pooled": {"acceptance": [0.564, 0.316], "ranks": ranks}}}))
    args = cli.build_parser().parse_args(["optimize", "--target", "synthetic:llama-3.1-8b", "--acceptance",
                                          str(measured)])
    assert args.func(args) == 0
    assert seen["acceptance"] == [0.564, 0.316] and seen["acceptance_ranks"] == ranks
    args = cli.build_parser().parse_args(["optimize", "--target", "synthetic:llama-3.1-8b", "--acceptance", "0.8,0.6"])
    assert args.func(args) == 0 and seen["acceptance"] == [0.8, 0.6] and seen["acceptance_ranks"] is None
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"tau": 2.2}))
    with pytest.raises(argparse.ArgumentTypeError, match='no "acceptance" list'):
        argtypes.replay_profile(str(empty))


def test_optimize_refuses_impossible_ranks_in_one_line(capsys, tmp_path):
    """Ranks the replay drafter cannot take (the 1st candidate's chance and the others' add up to more than 1 at a
    depth) stop `optimize` before anything runs, in one line naming drafter.ranks."""
    bad = tmp_path / "ranks.json"
    bad.write_text(json.dumps({"acceptance": [0.8, 0.5], "ranks": [[0.3], [0.1]]}))
    code = cli.main(["optimize", "--target", "synthetic:llama-3.1-8b", "--acceptance", str(bad), "--device", "cpu",
                     "--out", str(tmp_path / "run")])
    line = one_error_line(capsys)
    assert code == 2 and "--acceptance" in line and "drafter.ranks" in line and "depth 1" in line, line
    assert not (tmp_path / "run").exists()


def test_optimize_takes_the_packaged_heads_measured_profile_by_name(monkeypatch):
    """`optimize --acceptance smollm2-135m-eagle3`: the profile measured for the packaged head (a head_ranks
    run, its raw output in docs/benchmarks) ships beside the head and is named by the head's alias; it is one the
    replay drafter takes, ranks and all."""
    import gzip
    from pathlib import Path

    from specpilot.graph.run import check_acceptance

    seen = {}
    monkeypatch.setattr("specpilot.graph.run.optimize", lambda settings: seen.update(settings) or 0)
    args = cli.build_parser().parse_args(["optimize", "--target", "synthetic:llama-3.1-8b", "--acceptance",
                                          "smollm2-135m-eagle3"])
    assert args.func(args) == 0
    raw = Path(__file__).parents[1] / "docs/benchmarks/raw/2026-12-07-forty-third/D_head_ranks.json.gz"
    measured = json.loads(gzip.open(raw).read())["results"]["pooled"]
    assert seen["acceptance"] == pytest.approx(measured["acceptance"], abs=1e-4)
    assert [r == pytest.approx(m, abs=1e-4) for r, m in zip(seen["acceptance_ranks"], measured["ranks"])] == [True] * 4
    check_acceptance("synthetic:llama-3.1-8b", seen["acceptance"], seen["acceptance_ranks"])
    with pytest.raises(argparse.ArgumentTypeError, match=r"a packaged head's name \(smollm2-135m-eagle3\)"):
        argtypes.replay_profile("no-such-head")
