"""The house's import rules, read from the source with ast: cli → graph → memory/prompts → tools → engine → kernels,
never back up, and no circle between modules anywhere (lazy imports inside functions count too)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"cli": 6, "graph": 5, "memory": 4, "prompts": 4, "tools": 3, "engine": 2, "kernels": 1}
# Inside tools/: which subpackage may use which (agent_tools.py sits above all four; argtypes.py below them).
TOOLS_USES = {"agent_tools": {"bench", "gate", "profile", "sandbox", "argtypes"}, "gate": {"sandbox"},
              "bench": {"argtypes"}, "grid": {"bench", "gate", "argtypes"}, "profile": {"argtypes"}, "sandbox": set(),
              "argtypes": set()}


def package_modules() -> dict[str, Path]:
    """'specpilot.x.y' -> file, for every module of the package (tests and benchmarks are not in it)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"tests", "benchmarks", "build", ".scratch", ".gpu"} or rel.parts[0].startswith("."):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(["specpilot", *parts])] = path
    return mods


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports, resolved (relative imports, `from pkg import module`)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = package_modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_imports_never_run_back_up(graph):
    upward = [f"{a} -> {b}" for a, deps in graph.items() for b in deps
              if top(a) in LAYERS and top(b) in LAYERS and top(a) != top(b) and LAYERS[top(b)] >= LAYERS[top(a)]]
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


def test_tools_subpackages_use_only_what_they_may(graph):
    def sub(m: str) -> str | None:
        parts = m.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "tools" else None

    bad = [f"{a} -> {b}" for a, deps in graph.items() for b in deps
           if sub(a) and sub(b) and sub(a) != sub(b) and sub(b) not in TOOLS_USES.get(sub(a), set())]
    assert not bad, "tools/ subpackages used against their rules:\n" + "\n".join(sorted(bad))


def test_no_import_circle(graph):
    # A package's own __init__ re-exporting its modules is not a circle of modules: edges into a package face from
    # inside that package are left out.
    edges = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in graph.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in edges.get(node, ()):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_rule_is_checked_on_real_imports(graph):
    # The checker itself sees the imports it must judge (an empty graph would pass everything).
    assert "specpilot.tools.gate.check" in graph["specpilot.cli"]
    assert "specpilot.tools.sandbox.candidate_client" in graph["specpilot.tools.gate.check"]
    assert "specpilot.memory.outcome" in graph["specpilot.memory.records"]
