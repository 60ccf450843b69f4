"""The quick tier (`-m "not slow"`) smokes every module and every command, and keeps to its time budget.

Both checks read the test files' source, so they cost no compile; docs/testing.md says why each holds.
"""

import ast
import types
from pathlib import Path

import pytest

from meshlm import cli
from tests.helpers import tiers

TESTS = Path(__file__).parent
PACKAGE = TESTS.parent / "meshlm"
TEST_FILES = {p: ast.parse(p.read_text()) for p in sorted(TESTS.glob("test_*.py"))}
HELPERS = tiers.package_modules(TESTS / "helpers")


def helper_imports(tree: ast.AST) -> set[str]:
    """The meshlm modules a test file reaches through the shared helpers (tests/helpers) it imports."""
    seen, todo, found = set(), [tree], set()
    while todo:
        node = todo.pop()
        found |= tiers.meshlm_imports(node)
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("tests.helpers"):
                for name in {sub.module, *(f"{sub.module}.{a.name}" for a in sub.names)}:
                    key = name.removeprefix("tests.")
                    if key in HELPERS and key not in seen:
                        seen.add(key)
                        todo.append(ast.parse(HELPERS[key].read_text()))
    return found


def quick_files() -> dict[Path, list[ast.FunctionDef]]:
    """Each test file with quick tests: those tests, and the file's other functions (fixtures, helpers)."""
    found = {}
    for path, tree in TEST_FILES.items():
        if quick := tiers.quick_tests(tree):
            others = [f for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("test")]
            found[path] = quick + others
    return found


def test_every_module_is_reached_by_a_quick_test_file():
    modules = tiers.package_modules(PACKAGE)
    start = set().union(*(helper_imports(TEST_FILES[p]) for p in quick_files()))
    missing = sorted(set(modules) - tiers.reached_modules(start, modules))
    assert not missing, f"no quick test imports these modules (directly or through another module): {missing}"


def commands() -> list[str]:
    (sub,) = [a for a in cli.build_parser()._actions if a.dest == "command"]
    return sorted(sub.choices)


def runs_command(function: ast.FunctionDef, command: str) -> bool:
    """Whether a test function runs `meshlm command`: a call of `main`, or of a helper named for the command
    line (`run_cli`, ...), with `command` among its arguments, or an argument list that starts `-m meshlm`."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name == "main" or "cli" in name:
                lists = [a.elts for a in node.args if isinstance(a, ast.List | ast.Tuple)]
                if command in strings([*node.args, *(e for elts in lists for e in elts)]):
                    return True
        elif isinstance(node, ast.List | ast.Tuple) and {command, "meshlm"} <= set(strings(node.elts)):
            return True
    return False


def strings(nodes: list[ast.expr]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_every_command_is_run_by_a_quick_test():
    functions = [f for fs in quick_files().values() for f in fs]
    missing = [c for c in commands() if not any(runs_command(f, c) for f in functions)]
    assert not missing, f"no quick test runs `meshlm {' / '.join(missing)}`"


QUICK_SOURCE = """
import pytest
pytestmark = [pytest.mark.filterwarnings("ignore")]
def test_a(): pass
@pytest.mark.slow
def test_b(): pass
class TestC:
    def test_c(self): pass
@pytest.mark.slow
class TestD:
    def test_d(self): pass
"""


def test_quick_tests_leave_out_slow_functions_classes_and_modules():
    assert [f.name for f in tiers.quick_tests(ast.parse(QUICK_SOURCE))] == ["test_a", "test_c"]
    slow_module = "import pytest\npytestmark = pytest.mark.slow\ndef test_a(): pass\n"
    assert tiers.quick_tests(ast.parse(slow_module)) == []


def test_runs_command_needs_the_command_passed_to_main_a_cli_helper_or_meshlm():
    source = """
def f(): cli.main(["train", "x"])
def g(): run([sys.executable, "-m", "meshlm", "serve"])
def h(): x = ["train"]
def i(): assert run_cli("eval", path) == 1
"""
    (f, g, h, i) = ast.parse(source).body
    assert runs_command(f, "train") and runs_command(g, "serve") and runs_command(i, "eval")
    assert not runs_command(h, "train") and not runs_command(f, "serve")


def fake_item(*markers: str) -> pytest.Item:
    return types.SimpleNamespace(nodeid="t::x", get_closest_marker=lambda m: object() if m in markers else None)


@pytest.mark.parametrize(
    "markers, wall, cpu, over",
    [
        ((), 30.0, 31.0, True),  # slow on both clocks
        ((), 45.0, 8.0, False),  # a busy machine: the wall clock stretched, the CPU clock did not
        ((), 6.0, 40.0, False),  # XLA's threads: CPU seconds beyond the wall clock
        (("slow",), 300.0, 300.0, False),
        (("tpu",), 300.0, 300.0, False),
    ],
)
def test_the_budget_counts_the_smaller_clock_and_exempts_slow_and_tpu_tests(markers, wall, cpu, over):
    message = tiers.over_budget(fake_item(*markers), wall, cpu)
    assert (message is not None) == over
    if over:
        assert "mark it @pytest.mark.slow" in message and "t::x" in message
