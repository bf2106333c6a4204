"""The package's imports run one way: models <- convert <- {data, train, eval, serve} <- {bench, recipes} <- commands.

Every import in src/looplm (also the ones inside functions) is read with `ast`. A module may import
its own area and the areas below it; the four areas above convert are siblings (data is below the
other three: they read corpora); the benchmarks and the recipes (work that drives one area with another,
such as the engine writing a corpus) use all four and are siblings; the commands package is the command layer on
top, and area folders hold library code only. errors.py, util.py and settings.py are the bottom and import
nothing of the package. No two modules may import each other, directly or through others."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "looplm"

# rank of each area: a module may import areas of lower rank and its own
RANK = {
    "bottom": 0,
    "models": 1,
    "convert": 2,
    "data": 3,
    "train": 4,
    "eval": 4,
    "serve": 4,
    "bench": 5,
    "recipes": 5,
    "docs": 5,
    "commands": 6,
    "package": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def area(module: str) -> str:
    parts = module.split(".")
    if module == "looplm" or module == "looplm.__main__":
        return "package"
    if parts[1] in ("errors", "util", "settings"):
        return "bottom"
    return parts[1]


def imports(path: Path, module: str, modules: set[str]) -> list[tuple[str, int]]:
    """(imported looplm module, line) for every import statement in the file."""
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("looplm")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("looplm"):
                target = node.module
            else:
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: [(t, line) for t, line in imports(p, m, set(files)) if t in files and t != m] for m, p in files.items()}


def test_imports_run_one_way():
    wrong = []
    for module, targets in graph().items():
        for target, line in targets:
            a, b = area(module), area(target)
            if a == b:
                continue
            if RANK[b] >= RANK[a]:
                wrong.append(f"{module}:{line} imports {target} ({a} must not import {b})")
    assert not wrong, "upward or sideways imports:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges = graph()
    # a package's __init__ imports its modules; a module importing names from its own package
    # (`from . import x`) is fine when it names a submodule, which `imports` resolves
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for t, _ in edges.get(m, []):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t) :] + [m, t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [m])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not cycles, "circular imports:\n" + "\n".join(cycles)


def test_the_check_sees_a_bad_import(tmp_path):
    """The parser resolves relative imports as Python does, so an upward import is caught."""
    pkg = tmp_path / "looplm" / "models"
    pkg.mkdir(parents=True)
    f = pkg / "bad.py"
    f.write_text("from ..serve.engine import Engine\nfrom . import layers\n")
    found = imports(f, "looplm.models.bad", {"looplm.serve.engine", "looplm.models.layers"})
    assert found == [("looplm.serve.engine", 1), ("looplm.models.layers", 2)]
    assert RANK[area("looplm.serve.engine")] > RANK[area("looplm.models.bad")]
