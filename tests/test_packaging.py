"""The wheel holds every package of the checkout: pyproject.toml lists its packages by hand (the repository root is
`specpilot`), so a folder with an __init__.py that the list misses installs everywhere but a non-editable install,
where its imports fail (specpilot.tools.train, `specpilot train-drafter`, was missed so)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_PACKAGED = {"tests", "benchmarks"}  # run from the checkout, never installed


def test_every_package_folder_is_in_pyprojects_package_list():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"specpilot": "."}
    listed = set(config["packages"])
    found = {".".join(("specpilot", *init.parent.relative_to(ROOT).parts))
             for init in ROOT.rglob("__init__.py")
             if not ({"build", "dist", ".git", ".gpu"} | NOT_PACKAGED) & set(init.relative_to(ROOT).parts)
             and not any(part.startswith(".") or part.endswith(".egg-info") for part in init.relative_to(ROOT).parts)}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages with no folder: {sorted(listed - found)}"
