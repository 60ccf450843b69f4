"""Constrained output (meshlm.serve.grammar): random walks through each constraint's masks end in text that
`jsonschema` validates (or the regex matches, or is one of the choices); the request fields of OpenAI and
vLLM map to one Constraint each, bad ones to an InputError naming the field; forced tool calls; the
bitmask's layout and the compile cache.

A walk samples uniformly among each step's allowed tokens until the grammar is done, taking end-of-sequence
with probability 1/2 whenever it is allowed (else a walk through a grammar that may go on, like `a+`, could
run long). Schemas bound their strings, numbers and arrays (maxLength, minimum/maximum, maxItems) and close
their objects (additionalProperties: false), so most walks end in tens of tokens (a "required" tool-call
list, unbounded as vLLM's, in at most about 500); MAX_STEPS catches one that does not end."""

import json
import re

import jsonschema
import numpy as np
import pytest

from meshlm.config import InputError
from meshlm.http.constraints import request_constraint, tool_calls, tool_constraint
from meshlm.serve import grammar
from meshlm.serve.grammar import Constraint, Grammars, all_allowed
from meshlm.tokenizer import load_tokenizer

MODEL_VOCAB = 50400  # GPT-J's padded vocabulary: ids 50257.. have no token
MAX_STEPS = 2000  # the longest of these walks takes about 500
SEEDS = range(6)


@pytest.fixture(scope="module")
def gpt2(gpt2_bpe_file):
    return load_tokenizer(gpt2_bpe_file)


@pytest.fixture(scope="module")
def grammars(gpt2) -> Grammars:
    return Grammars(gpt2, MODEL_VOCAB)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """The token ids whose bits are set: bit t of word t // 32 (little-endian within each word)."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def walk(grammars: Grammars, c: Constraint, seed: int) -> str:
    """The text of a random walk through `c`'s masks (module docstring), checked at every step: only ids of
    the tokenizer allowed, every sampled token accepted, done once end-of-sequence is taken."""
    tok = grammars.tokenizer
    matcher = grammars.matcher(c)
    rng = np.random.default_rng(seed)
    row = np.full(grammars.words, -1, dtype=np.int32)  # -1: fill must clear what it does not allow
    ids: list[int] = []
    while not matcher.done:
        assert len(ids) < MAX_STEPS, f"walk did not end: {tok.decode(ids)[:200]!r}"
        matcher.fill(row)
        allowed = allowed_ids(row)
        assert allowed.size and allowed.max() < tok.vocab_size
        others = allowed[allowed != tok.eot_id]
        token = tok.eot_id if others.size == 0 or (tok.eot_id in allowed and rng.random() < 0.5) else rng.choice(others)
        matcher.accept(int(token))
        if token == tok.eot_id:
            assert matcher.done
            break
        ids.append(int(token))
    return tok.decode(ids)


def walks(grammars: Grammars, c: Constraint) -> list[str]:
    return [walk(grammars, c, seed) for seed in SEEDS]


def closed(properties: dict, required: list[str] | None = None) -> dict:
    """An object schema with exactly these properties (all required unless `required` says)."""
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


WORD = {"type": "string", "maxLength": 6}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS = {
    "nested objects": closed({
        "name": WORD,
        "address": closed({"city": WORD, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, ["zip"]),
    }),
    "array of integers": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                          "minItems": 1, "maxItems": 4},
    "enums and booleans": closed({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2.5, None]},
                                  "ok": {"type": "boolean"}, "kind": {"const": "point"}}),
    "numbers": closed({"price": {"type": "number", "minimum": 0, "maximum": 100}, "count": DIGIT}),
    "optional keys": closed({"a": DIGIT, "b": WORD, "c": {"type": "boolean"}}, required=["b"]),
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": closed({
        "id": DIGIT, "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}})},
    "refs and anyOf": {"$defs": {"pt": closed({"x": DIGIT, "y": DIGIT})}, "anyOf": [
        {"$ref": "#/$defs/pt"}, {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2}]},
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Walks: what the masks allow is what the constraint says


@pytest.mark.slow
@pytest.mark.parametrize("schema", SCHEMAS.values(), ids=SCHEMAS.keys())
def test_walks_through_a_json_schema_end_in_json_valid_against_it(grammars, schema):
    for text in walks(grammars, Constraint.json_schema(schema)):
        jsonschema.validate(json.loads(text), schema)


def test_optional_keys_are_sometimes_given_and_sometimes_not(grammars):
    schema = SCHEMAS["optional keys"]
    keys = {tuple(json.loads(walk(grammars, Constraint.json_schema(schema), seed))) for seed in range(12)}
    assert ("b",) in keys and len(keys) > 1


def test_properties_come_in_the_schemas_order_not_sorted(grammars):
    schema = closed({"zebra": DIGIT, "apple": DIGIT})
    for text in walks(grammars, Constraint.json_schema(schema)):
        assert list(json.loads(text)) == ["zebra", "apple"]


def test_json_object_allows_only_an_object_and_is_done_at_its_closing_brace(grammars, gpt2):
    matcher = grammars.matcher(Constraint.json_object())
    row = np.zeros(grammars.words, dtype=np.int32)
    matcher.fill(row)
    assert {gpt2.decode([int(t)])[0] for t in allowed_ids(row)} == {"{"}
    for token in gpt2.encode('{"a": [1, 2.5, "x"], "b": {"c": null}}'):
        assert not matcher.done
        matcher.accept(token)
    assert matcher.done
    matcher.fill(row)
    assert allowed_ids(row).tolist() == [gpt2.eot_id]


def test_any_json_takes_every_kind_of_value(grammars, gpt2):
    for text in ['"hi"', "-1.5e3", "[true, false, null]", '{"k": []}']:
        matcher = grammars.matcher(Constraint.json_schema())
        for token in gpt2.encode(text):
            matcher.accept(token)


@pytest.mark.parametrize("pattern", [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no)!*"])
def test_walks_through_a_regex_match_it_whole(grammars, pattern):
    for text in walks(grammars, Constraint.regex(pattern)):
        assert re.fullmatch(pattern, text), text


def test_walks_through_choices_end_in_one_of_them(grammars):
    choices = ["yes", "no", "maybe so", 'say "hi"', "café"]
    texts = {walk(grammars, Constraint.choice(choices), seed) for seed in range(16)}
    assert texts <= set(choices) and len(texts) > 2


@pytest.mark.parametrize(
    "text",
    [
        'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/\n',
        'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]? [0-9]?',
    ],
    ids=["lark", "gbnf"],
)
def test_walks_through_a_grammar_are_its_sentences(grammars, text):
    for out in walks(grammars, Constraint.grammar(text)):
        assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", out), out


def test_a_pythia_style_tokenizer_json_walks_too(neox_style_tokenizer):
    tok = load_tokenizer(neox_style_tokenizer)
    assert tok.eot_id == 0 and tok.vocab_size == 512
    grammars = Grammars(tok, 544)
    schema = SCHEMAS["nested objects"]
    for text in walks(grammars, Constraint.json_schema(schema)):
        jsonschema.validate(json.loads(text), schema)


# ---------------------------------------------------------------------------------------------------
# The bitmask and the matchers


def test_bits_past_the_tokenizers_vocabulary_are_never_set(grammars, gpt2):
    row = np.full(grammars.words, -1, dtype=np.int32)
    grammars.matcher(Constraint.regex(r"(?s).*")).fill(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert grammars.words == 1575 and bits.size == 1575 * 32
    assert bits[gpt2.vocab_size :].sum() == 0 and bits[: gpt2.eot_id].sum() > 50_000


def test_a_row_of_a_batch_mask_is_filled_alone(grammars):
    batch = np.zeros((3, grammars.words), dtype=np.int32)
    grammars.matcher(Constraint.choice(["yes"])).fill(batch[1])
    assert batch[0].sum() == 0 and batch[2].sum() == 0 and batch[1].any()
    with pytest.raises(ValueError, match="int32"):
        grammars.matcher(Constraint.choice(["yes"])).fill(np.zeros(grammars.words, dtype=np.int64))


def test_matchers_of_one_constraint_advance_independently(grammars, gpt2):
    c = Constraint.choice(["yes", "no"])
    first, second = grammars.matcher(c), grammars.matcher(c)
    first.accept(gpt2.encode("yes")[0])
    assert first.done and not second.done
    second.accept(gpt2.encode("no")[0])
    assert second.done


def test_a_token_the_mask_refused_is_a_runtime_error(grammars, gpt2):
    matcher = grammars.matcher(Constraint.choice(["yes"]))
    with pytest.raises(RuntimeError, match="not allowed"):
        matcher.accept(gpt2.encode("no")[0])


def test_all_allowed_is_a_shared_read_only_row_of_set_bits():
    row = all_allowed(1575)
    assert row.dtype == np.int32 and row.shape == (1575,) and (row == -1).all()
    assert all_allowed(1575) is row and not row.flags.writeable


def test_the_same_constraint_compiles_once(gpt2, monkeypatch):
    compiled = []
    real = grammar.llguidance.LLMatcher
    monkeypatch.setattr(grammar.llguidance, "LLMatcher", lambda *a, **k: compiled.append(1) or real(*a, **k))
    monkeypatch.setattr(grammar, "CACHE_SIZE", 2)
    grammars = Grammars(gpt2, MODEL_VOCAB)
    a, b, c = (Constraint.json_schema(closed({k: DIGIT})) for k in "abc")
    grammars.check(a)
    grammars.matcher(Constraint.json_schema(closed({"a": DIGIT}), param="guided_json"))  # equal: the param is no key
    assert len(compiled) == 1
    grammars.check(b)
    grammars.check(c)  # evicts a, the least recently used
    grammars.check(b)
    grammars.check(a)
    assert len(compiled) == 4


@pytest.mark.parametrize(
    "c, reason",
    [
        (Constraint.json_schema({"type": "thing"}, param="guided_json"), "invalid json: .*thing"),
        (Constraint.json_schema(False, param="response_format"), "invalid json: .*[Uu]nsatisfiable"),
        (Constraint.json_schema({"$ref": "#/$defs/none"}, param="guided_json"), "invalid json: .*none"),
        (Constraint.regex("a(b", param="guided_regex"), "invalid regex: .*unclosed group"),
        (Constraint.grammar("start: missing\n", param="guided_grammar"), "invalid grammar: .*missing"),
        (Constraint.grammar("root ::= [a-z", param="guided_grammar"), "invalid grammar: .*GBNF"),
    ],
    ids=["json type", "false schema", "dangling ref", "regex", "lark", "gbnf"],
)
def test_an_invalid_constraint_is_an_input_error_naming_its_field(grammars, c, reason):
    with pytest.raises(InputError, match=reason) as e:
        grammars.check(c)
    assert e.value.param == c.param and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# Requests: OpenAI's and vLLM's fields

SCHEMA = closed({"a": DIGIT})


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}, "guided_json": None, "structured_outputs": None}, None),
        ({"response_format": {"type": "json_object"}}, Constraint.json_object()),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
         Constraint.json_schema(SCHEMA)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, Constraint.json_schema({})),
        ({"guided_json": SCHEMA}, Constraint.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, Constraint.json_schema(SCHEMA)),
        ({"guided_regex": r"\d+"}, Constraint.regex(r"\d+")),
        ({"guided_choice": ["a", "b"]}, Constraint.choice(["a", "b"])),
        ({"guided_grammar": 'start: "x"'}, Constraint.grammar('start: "x"')),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA), "regex": None}}, Constraint.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": "a+"}}, Constraint.regex("a+")),
        ({"structured_outputs": {"choice": ["x"]}}, Constraint.choice(["x"])),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, Constraint.grammar('start: "x"')),
        ({"structured_outputs": {"json_object": True}}, Constraint.json_object()),
    ],
)  # fmt: skip
def test_request_fields_map_to_one_constraint(body, expected):
    c = request_constraint(body)
    assert c == expected
    if c is not None:
        assert c.param == next(k for k in body if body[k] is not None)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "not both guided_json and guided_regex"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "one output constraint"),
        ({"response_format": "json"}, "response_format", "type is one of text, json_object, json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "type is one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "with a name and a schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}}, "response_format",
         "must be a JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}}, "response_format",
         "strict must be true or false"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": 3}, "guided_json", "must be a JSON schema"),
        ({"guided_regex": 5}, "guided_regex", "must be a string"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty list of strings"),
        ({"guided_choice": "a"}, "guided_choice", "non-empty list of strings"),
        ({"guided_grammar": " "}, "guided_grammar", "non-empty string"),
        ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern is not"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs", "structured_outputs.choice must be"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "true or false"),
    ],
)  # fmt: skip
def test_bad_request_fields_are_input_errors_naming_the_field(body, param, message):
    with pytest.raises(InputError, match=re.escape(message)) as e:
        request_constraint(body)
    assert e.value.param == param and "\n" not in str(e.value)


def test_a_constraint_is_keyed_by_its_kind_and_text_not_its_field():
    a, b = Constraint.json_schema(SCHEMA, param="guided_json"), Constraint.json_schema(SCHEMA, param="response_format")
    assert a == b and hash(a) == hash(b) and Constraint.regex("a") != Constraint.grammar("a")


# ---------------------------------------------------------------------------------------------------
# Tool calls


def function(name: str, parameters: dict | None = None) -> dict:
    """A tool in OpenAI's shape."""
    spec = {"name": name, "description": f"The {name} tool."}
    return {"type": "function", "function": spec if parameters is None else spec | {"parameters": parameters}}


WEATHER = function("get_weather", closed({"city": WORD, "unit": {"enum": ["celsius", "fahrenheit"]}}))
SMALL = {"$ref": "#/$defs/small"}
ADD = function("add", {"$defs": {"small": DIGIT}, **closed({"a": SMALL, "b": SMALL})})
NOW = function("now")  # no parameters: an empty object
TOOLS = [WEATHER, ADD, NOW]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def test_a_named_tool_choice_makes_the_output_that_functions_arguments(grammars):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    c = tool_constraint(TOOLS, choice)
    assert c == Constraint.json_schema(WEATHER["function"]["parameters"])
    for text in walks(grammars, c):
        (call,) = tool_calls(text, TOOLS, choice)
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
        assert call["function"] == {"name": "get_weather", "arguments": text}
        jsonschema.validate(json.loads(text), WEATHER["function"]["parameters"])


def test_required_tool_choice_makes_the_output_a_list_of_calls_to_the_tools(grammars):
    c = tool_constraint(TOOLS, "required")
    schema = json.loads(c.text)
    assert schema["$defs"] == {"small": DIGIT}  # hoisted to the root, where the refs resolve
    parameters = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    names = set()
    for seed in range(12):
        text = walk(grammars, c, seed)
        jsonschema.validate(json.loads(text), schema)
        calls = tool_calls(text, TOOLS, "required")
        assert len(calls) == len(json.loads(text)) >= 1
        for call in calls:
            assert CALL_ID.fullmatch(call["id"])
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), parameters[name])
            names.add(name)
    assert len(names) > 1
    two = tool_calls('[{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]', TOOLS, "required")
    assert two[0]["id"] != two[1]["id"]


def test_a_required_answer_cut_off_has_no_tool_calls():
    assert tool_calls('[{"name": "add", "parameters": {"a": 1', TOOLS, "required") == []


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_auto_and_none_constrain_nothing(choice):
    assert tool_constraint(TOOLS, choice) is None and tool_calls('{"a": 1}', TOOLS, choice) == []
    assert tool_constraint(None, choice) is None


@pytest.mark.parametrize(
    "tools, choice, param, message",
    [
        (TOOLS, {"type": "function", "function": {"name": "fly"}}, "tool_choice", "'fly', which is not in tools"),
        (None, {"type": "function", "function": {"name": "add"}}, "tool_choice", "not in tools"),
        (None, "required", "tool_choice", "needs at least one tool"),
        ([], "required", "tool_choice", "needs at least one tool"),
        (TOOLS, "sometimes", "tool_choice", 'tool_choice must be "none", "auto", "required"'),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice", "tool_choice must be"),
        (TOOLS, {"type": "tool", "function": {"name": "add"}}, "tool_choice", "tool_choice must be"),
        ({"add": ADD}, "auto", "tools", "tools must be a list"),
        ([{"type": "retrieval"}], "auto", "tools", "tools[0] must be"),
        ([{"type": "function", "function": {"parameters": {}}}], "required", "tools", "name must be a non-empty"),
        ([ADD, ADD], "required", "tools", "'add' twice"),
        ([function("f", "{}")], "required", "tools", "parameters must be a JSON schema"),
        ([ADD, function("g", {"$defs": {"small": WORD}})], "required", "tools", "$defs/small differently"),
    ],
)  # fmt: skip
def test_bad_tools_and_tool_choice_are_input_errors(tools, choice, param, message):
    with pytest.raises(InputError, match=re.escape(message)) as e:
        tool_constraint(tools, choice)
    assert e.value.param == param and "\n" not in str(e.value)
