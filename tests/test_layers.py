"""The package's layering, as ../shared/DESIGN.md draws it: every module sits on a floor, and its imports
(function-level ones too) point to its own floor or below, never up."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "meshlm"

FLOORS = {
    0: "config paths",
    1: "sharding param footprint devices",
    2: "model attention fused_ce quant kv_cache kv_dma paged_attention lora tokenizer chat",
    3: "serve",  # the serving wing (meshlm/serve/): its own floors are SERVE_FLOORS below
    4: "formats data prepare loader corpus demo_corpus",
    5: "train_step optim metrics objectives grpo rewards",
    6: "api __init__ generate grammar",  # generate, grammar: the serving wing's deprecated re-exports
    7: "train rollout planner run_start distributed",
    8: "http evaluate",  # the HTTP wing (meshlm/http/): its own floors are HTTP_FLOORS below
    9: "cli __main__",
}
FLOOR = {name: floor for floor, names in FLOORS.items() for name in names.split()}
# The serving wing (meshlm/serve/) inside, as vLLM v1 stacks it: a host-only contract at the bottom, the
# sampler on it, the scheduler and the runner side by side above them, the engine on top.
SERVE_FLOORS = {
    0: "__init__ config pages adapter_slots grammar",
    1: "params",
    2: "batch outputs",
    3: "sampler",
    4: "scheduler runner",
    5: "engine",
}
SERVE_FLOOR = {name: floor for floor, names in SERVE_FLOORS.items() for name in names.split()}
# The HTTP wing (meshlm/http/) inside: what travels over the wire at the bottom, the app on top.
HTTP_FLOORS = {
    0: "__init__ protocol constraints",
    1: "openai_format metrics",
    2: "state",
    3: "rows",
    4: "handlers",
    5: "app",
}
HTTP_FLOOR = {name: floor for floor, names in HTTP_FLOORS.items() for name in names.split()}


def modules() -> dict[str, Path]:
    """Each module by its floor-table name: a top-level module's name, or "formats" for the formats package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts)] = path
    return out


def table_name(module: str) -> str:
    return module.split(".")[0]


def imports(path: Path) -> set[str]:
    """The meshlm modules a file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "meshlm":
            if node.module == "meshlm":
                found |= {a.name for a in node.names}
            else:
                found.add(node.module.removeprefix("meshlm."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("meshlm.") for a in node.names if a.name.startswith("meshlm.")}
    return found


def test_every_module_has_a_floor():
    assert sorted({table_name(m) for m in modules()} - set(FLOOR)) == []


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_point_down(module):
    path = modules()[module]
    here = FLOOR[table_name(module)]
    above = {m for m in imports(path) if FLOOR.get(table_name(m), here) > here}
    assert not above, f"{module} (floor {here}) imports {sorted(above)} from above"


def imported_test_modules(path: Path) -> set[str]:
    """The test modules (test_*.py) a file of the suite imports, absolutely or relatively, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            dotted = [module, *(f"{module}.{a.name}".lstrip(".") for a in node.names)]
        else:
            continue
        for name in dotted:
            parts = name.split(".")[1:] if name.startswith("tests.") else name.split(".")
            if len(parts) == 1 and parts[0].startswith("test_"):
                found.add(name)
    return found


def test_test_modules_share_helpers_and_fixtures_never_each_other():
    """Shared helpers live in tests/helpers/ and shared fixtures in tests/conftest.py: a test module that imports
    another collects the other's fixtures and ties the two files' tests together."""
    suite = PACKAGE.parent / "tests"
    reaching = {str(path.relative_to(suite)): imported_test_modules(path) for path in sorted(suite.rglob("*.py"))}
    assert {name: sorted(found) for name, found in reaching.items() if found} == {}


WING_FLOOR = {"serve": SERVE_FLOOR, "http": HTTP_FLOOR}  # each wing's own floors, by module name inside it


@pytest.mark.parametrize("wing", sorted(WING_FLOOR))
def test_every_module_of_a_wing_has_a_floor_in_it(wing):
    found = {m.removeprefix(f"{wing}.") for m in modules() if table_name(m) == wing}
    assert sorted(found ^ set(WING_FLOOR[wing])) == []


@pytest.mark.parametrize("module", sorted(m for m in modules() if table_name(m) in WING_FLOOR))
def test_imports_point_down_inside_each_wing(module):
    wing = table_name(module)
    floor = WING_FLOOR[wing]
    here = floor[module.removeprefix(f"{wing}.")]
    inside = {m.removeprefix(f"{wing}.") for m in imports(modules()[module]) if m.startswith(f"{wing}.")}
    above = {m for m in inside if floor[m] > here}
    assert not above, f"{module} (wing floor {here}) imports {sorted(above)} from above"
    assert not (module == "serve.scheduler" and "runner" in inside), "the scheduler and the runner sit side by side"
