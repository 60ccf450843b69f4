"""The quick tier's rules, read by conftest.py and tests/test_tiers.py.

The quick tier is every test not marked `slow` (`python -m pytest -q -m "not slow"`, docs/testing.md). Each of
its tests must finish within a budget on the machine running it, or the suite fails: a slow test left unmarked
would otherwise creep into the tier a contributor runs on every change.
"""

import ast
import itertools
import os
from pathlib import Path

import pytest

# Seconds one quick test may take (its setup, module fixtures included, and its call). Tests are marked `slow`
# at about a quarter of this on a quiet 2-core machine, so a machine 3x slower, or a busy one, still passes.
QUICK_TEST_BUDGET_S = float(os.environ.get("MESHLM_QUICK_TEST_BUDGET_S", "20"))
EXEMPT_MARKERS = ("slow", "tpu")


def over_budget(item: pytest.Item, wall_s: float, cpu_s: float) -> str | None:
    """Why a finished quick test broke the budget, or None. It counts the smaller of wall and CPU seconds: a
    machine busy with other work stretches the wall clock, and XLA's compiler threads stretch the CPU clock;
    a test that is really slow stretches both."""
    if QUICK_TEST_BUDGET_S <= 0 or any(item.get_closest_marker(m) for m in EXEMPT_MARKERS):
        return None
    spent = min(wall_s, cpu_s)
    if spent <= QUICK_TEST_BUDGET_S:
        return None
    return (
        f"{item.nodeid} took {spent:.1f} s (wall {wall_s:.1f} s, CPU {cpu_s:.1f} s), over the quick tier's "
        f"{QUICK_TEST_BUDGET_S:.0f} s budget: make it faster or mark it @pytest.mark.slow (docs/testing.md)"
    )


def _is_slow_mark(node: ast.expr) -> bool:
    """`pytest.mark.slow`, called or not, alone or in a list (a module's `pytestmark`)."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(_is_slow_mark(e) for e in node.elts)
    if isinstance(node, ast.Call):
        node = node.func
    return (
        isinstance(node, ast.Attribute) and node.attr in EXEMPT_MARKERS and ast.unparse(node).startswith("pytest.mark.")
    )


def quick_tests(tree: ast.Module) -> list[ast.FunctionDef]:
    """The test functions of a test file's syntax tree that run in the quick tier."""
    for stmt in tree.body:
        targets = [getattr(t, "id", "") for t in getattr(stmt, "targets", [])]
        if "pytestmark" in targets and _is_slow_mark(stmt.value):
            return []
    found = []
    for stmt in tree.body:
        functions = [stmt] if isinstance(stmt, ast.FunctionDef) else []
        if (
            isinstance(stmt, ast.ClassDef)
            and stmt.name.startswith("Test")
            and not any(map(_is_slow_mark, stmt.decorator_list))
        ):
            functions = [s for s in stmt.body if isinstance(s, ast.FunctionDef)]
        found += [f for f in functions if f.name.startswith("test") and not any(map(_is_slow_mark, f.decorator_list))]
    return found


def meshlm_imports(tree: ast.AST) -> set[str]:
    """The meshlm modules a syntax tree imports (`import meshlm.x`, `from meshlm import x`, `from meshlm.x import
    y`), or runs (`[sys.executable, "-m", "meshlm", ...]` runs `meshlm.__main__`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            strings = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if any(a == "-m" and b == "meshlm" for a, b in itertools.pairwise(strings)):
                found.add("meshlm.__main__")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "meshlm"}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "meshlm"
            and not node.level
        ):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def package_modules(package: Path) -> dict[str, Path]:
    """Every module of the package under `package` (a folder), by dotted name."""
    root = package.parent
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(package.rglob("*.py"))
    }


def reached_modules(start: set[str], modules: dict[str, Path]) -> set[str]:
    """The modules `start` imports, and the modules those import, transitively (a package reaches its `__init__`)."""
    reached, todo = set(), [m for m in start if m in modules]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules]
        todo += [m for m in meshlm_imports(ast.parse(modules[name].read_text())) if m in modules]
    return reached
