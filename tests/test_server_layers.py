"""The server (`meshlm/http/`) is HTTP only: it reaches the model through the front door (`meshlm.api`), the engine
through its public names and methods, and nothing of the engine's insides (its scheduler, runner, pool or queue)."""

import ast
from pathlib import Path

import pytest

import meshlm.http

PACKAGE = Path(meshlm.http.__file__).parent
FILES = sorted(PACKAGE.glob("*.py"))
# the meshlm modules outside the server the server may import from, and the names it may take from each (its own
# modules, meshlm.http.*, import each other freely)
ALLOWED = {
    "meshlm.api": {"LanguageModel", "is_adapter", "load", "read_adapter"},
    "meshlm.serve.engine": {"Engine", "QueueFull", "Request", "SlotsBusy", "Snapshot"},
    "meshlm.serve.config": {"EngineConfig"},
    "meshlm.serve.params": {"SamplingParams", "SAMPLING_FIELDS"},  # the type, and its fields by name
    "meshlm.serve.grammar": {"Constraint", "KINDS"},
    "meshlm.config": {"ConfigError", "DataError", "InputError", "MeshlmError"},
    "meshlm.chat": {"ChatTemplate", "check_messages", "load_chat_template"},
    "meshlm.tokenizer": {"Tokenizer"},
}
# the engine's insides (meshlm.serve.scheduler, meshlm.serve.runner), which only the engine itself touches; the
# server reads the engine's state through `snapshot()` (whose `running` and `queued` are counts)
ENGINE_INSIDES = {"scheduler", "runner", "pool", "queue", "stats", "slots", "fail_all"}
# the engine's types the server must never build: its rows come from `Engine.add_requests`, its settings from
# `LanguageModel.sampling`, its engine from `LanguageModel.engine`
ENGINE_TYPES = {"Engine", "Request", "SamplingParams", "Runner", "Scheduler"}


def meshlm_imports(tree: ast.AST) -> list[tuple[str, str | None]]:
    """(module, name) of every import of meshlm code anywhere in the file (functions included); name None
    for a plain `import meshlm.x`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "meshlm"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "meshlm":
            found += [(node.module, a.name) for a in node.names]
    return found


def test_the_server_imports_only_the_front_door():
    imports = [(path, *found) for path in FILES for found in meshlm_imports(ast.parse(path.read_text()))]
    assert imports, "the server imports nothing of meshlm?"
    for path, module, name in imports:
        if module.startswith("meshlm.http.") or module == "meshlm.http":
            continue
        assert module in ALLOWED and name in ALLOWED[module], (
            f"meshlm/http/{path.name} imports {name or module} from {module}: the server may use only "
            f"{ {m: sorted(n) for m, n in ALLOWED.items()} }"
        )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_server_touches_nothing_inside_the_engine(path):
    """No attribute of the engine's scheduler or runner, and nothing private of another object (`x._y`)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            assert node.attr not in ENGINE_INSIDES, f"{path.name}:{node.lineno}: .{node.attr} is the engine's inside"
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            assert not private or owner == "self", f"{path.name}:{node.lineno}: {owner}.{node.attr} is private"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_server_builds_no_engine_type(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in ENGINE_TYPES, f"{path.name}:{node.lineno}: builds the engine's {node.func.id}"


def test_the_layer_check_catches_a_back_door():
    tree = ast.parse("from meshlm.scheduler import Scheduler\ndef f():\n    import meshlm.runner\n")
    assert meshlm_imports(tree) == [("meshlm.scheduler", "Scheduler"), ("meshlm.runner", None)]
