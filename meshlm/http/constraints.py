"""OpenAI's and vLLM's constraint fields read into one `Constraint`, and a forced tool call's output written back
as OpenAI's `tool_calls`: `response_format`, `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`,
`structured_outputs`, and chat `tools` with a forced `tool_choice`. The grammar itself (compiling a
`Constraint`, its token masks) is the engine's, in `meshlm.serve.grammar`."""

from __future__ import annotations

import json
import secrets
from typing import Any

from meshlm.config import InputError
from meshlm.serve.grammar import KINDS, Constraint

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = (*KINDS, "json_object")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


# ---------------------------------------------------------------------------------------------------
# Requests: OpenAI's and vLLM's fields -> one Constraint


def request_constraint(body: dict[str, Any]) -> Constraint | None:
    """The output constraint a /v1/completions or /v1/chat/completions request asks for, None if none.

    Read from `response_format` (OpenAI), `guided_json` / `guided_regex` / `guided_choice` /
    `guided_grammar` (vLLM) and `structured_outputs` (vLLM's newer form); a field set to null is absent.
    More than one constraint at once is an InputError, as is a field of the wrong shape."""
    found = []
    if body.get("response_format") is not None:
        found.append(_response_format(body["response_format"]))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append(_constraint(kind, body[name], name))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    found = [c for c in found if c is not None]
    if len(found) > 1:
        raise InputError(f"give one output constraint, not both {found[0].param} and {found[1].param}", found[1].param)
    return found[0] if found else None


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise InputError(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}", param)
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InputError("response_format.json_schema must be an object with a name and a schema", param)
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict | bool):
        raise InputError("response_format.json_schema.schema must be a JSON schema (an object)", param)
    if not isinstance(spec.get("strict", False), bool | None):
        raise InputError("response_format.json_schema.strict must be true or false", param)
    return Constraint.json_schema(schema, param)


def _structured_outputs(value: Any) -> Constraint | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InputError(f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KEYS)}", param)
    given = {k: v for k, v in value.items() if v is not None}
    unknown = [k for k in given if k not in STRUCTURED_KEYS]
    if unknown:
        raise InputError(
            f"structured_outputs.{unknown[0]} is not supported (give one of {', '.join(STRUCTURED_KEYS)})", param
        )
    if len(given) != 1:
        raise InputError(f"structured_outputs must give exactly one of {', '.join(STRUCTURED_KEYS)}", param)
    ((key, spec),) = given.items()
    if key != "json_object":
        return _constraint(key, spec, param, f"structured_outputs.{key}")
    if not isinstance(spec, bool):
        raise InputError("structured_outputs.json_object must be true or false", param)
    return Constraint.json_object(param) if spec else None


def _constraint(kind: str, value: Any, param: str, name: str | None = None) -> Constraint:
    """The constraint of one vLLM field (`guided_<kind>`, or `structured_outputs.<kind>`)."""
    name = name or param
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InputError(f"{name} is not valid JSON ({e})", param) from None
        if not isinstance(value, dict | bool):
            raise InputError(f"{name} must be a JSON schema (an object, or its JSON text)", param)
        return Constraint.json_schema(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InputError(f"{name} must be a non-empty list of strings", param)
        return Constraint.choice(value, param)
    if not isinstance(value, str) or (kind == "grammar" and not value.strip()):
        raise InputError(f"{name} must be a {'non-empty ' * (kind == 'grammar')}string", param)
    return Constraint(kind, value, param)


# ---------------------------------------------------------------------------------------------------
# Tool calls: chat `tools` with a forced `tool_choice`


def tool_constraint(tools: list[dict[str, Any]] | None, tool_choice: Any) -> Constraint | None:
    """The constraint forcing a tool call, None when the model may answer freely.

    A named function (`{"type": "function", "function": {"name": N}}`): the output is N's arguments, valid
    against its `parameters`. "required": a JSON array of one or more `{"name", "parameters"}` calls, each
    of a given tool with its parameters (as vLLM). "auto", "none" or absent: None (no tool parser runs)."""
    mode, functions = _forced(tools, tool_choice)
    if mode is None:
        return None
    if mode != "required":
        return Constraint.json_schema(_parameters(functions[mode]), "tools")
    defs: dict[str, Any] = {}
    calls = []
    for name, function in functions.items():
        parameters = dict(_parameters(function))
        # A $ref resolves from the root: the tools' definitions move to the root of the combined schema.
        for key in ("$defs", "definitions"):
            for def_name, definition in parameters.pop(key, {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise InputError(f"tools define {key}/{def_name} differently; give each its own name", "tools")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    return Constraint.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}, "tools")


def tool_calls(text: str, tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` for a chat answer generated under `tool_constraint(tools, tool_choice)`.

    Empty when no call was forced, and when a "required" answer is not a whole JSON array (generation was
    cut off at max_tokens): the text is then the message's content. A named call's arguments are the text
    as generated, cut off or not, as OpenAI's are."""
    mode, _ = _forced(tools, tool_choice)
    if mode is None:
        return []
    if mode != "required":
        return [_call(mode, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _forced(tools: list[dict[str, Any]] | None, tool_choice: Any) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """What `tool_choice` forces: None (nothing), "required", or the name of the function to call; with the
    tools' functions by name. Checks both fields."""
    functions = _functions(tools) if tools is not None else {}
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None, functions
    if tool_choice == "required":
        if not functions:
            raise InputError('tool_choice "required" needs at least one tool in tools', "tool_choice")
        return "required", functions
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    function = tool_choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InputError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in functions:
        raise InputError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return name, functions


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """The tools' functions by name, checked: OpenAI's shape, unique names, parameters a schema."""
    if not isinstance(tools, list):
        raise InputError("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InputError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InputError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in functions:
            raise InputError(f"tools name function {name!r} twice", "tools")
        if not isinstance(function.get("parameters", {}), dict | None):
            raise InputError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        functions[name] = function
    return functions


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; a function without one takes an empty object, and only that."""
    return function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
