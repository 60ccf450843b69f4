"""The server is HTTP only: it reaches the model through the front door (`meshlm.api`), the engine through its
public names and methods, and nothing of the engine's insides (its scheduler, runner, pool or queue)."""

import ast
from pathlib import Path

import meshlm.server

SOURCE = Path(meshlm.server.__file__).read_text()
# the meshlm modules the server may import from, and the names it may take from each
ALLOWED = {
    "meshlm.api": {"LanguageModel", "is_adapter", "load", "read_adapter"},
    "meshlm.serve.engine": {"Engine", "QueueFull", "Request", "SlotsBusy", "Snapshot"},
    "meshlm.serve.params": {"SamplingParams"},
    "meshlm.serve.grammar": {"Constraint", "request_constraint", "tool_calls", "tool_constraint"},
    "meshlm.config": {"ConfigError", "DataError", "InputError", "MeshlmError"},
    "meshlm.chat": {"ChatTemplate", "check_messages", "load_chat_template"},
    "meshlm.tokenizer": {"Tokenizer"},
}
# the engine's insides (meshlm.serve.scheduler, meshlm.serve.runner), which only the engine itself touches; the
# server reads the engine's state through `snapshot()` (whose `running` and `queued` are counts)
ENGINE_INSIDES = {"scheduler", "runner", "pool", "queue", "stats", "slots", "fail_all"}


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
    imports = meshlm_imports(ast.parse(SOURCE))
    assert imports, "the server imports nothing of meshlm?"
    for module, name in imports:
        assert module in ALLOWED and name in ALLOWED[module], (
            f"meshlm/server.py imports {name or module} from {module}: the server may use only "
            f"{ {m: sorted(n) for m, n in ALLOWED.items()} }"
        )


def test_the_server_touches_nothing_inside_the_engine():
    """No attribute of the engine's scheduler or runner, and nothing private of another object (`x._y`)."""
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            assert node.attr not in ENGINE_INSIDES, f"line {node.lineno}: .{node.attr} is the engine's inside"
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            assert not private or owner == "self", f"line {node.lineno}: {owner}.{node.attr} is private"


def test_the_layer_check_catches_a_back_door():
    tree = ast.parse("from meshlm.scheduler import Scheduler\ndef f():\n    import meshlm.runner\n")
    assert meshlm_imports(tree) == [("meshlm.scheduler", "Scheduler"), ("meshlm.runner", None)]
