"""Output constrained to a JSON schema, a regex or a choice, through the engine: sampled completions from a random
tiny model each parse and validate; greedy output equals a reference loop that applies llguidance's own mask to
transformers' logits; constrained rows mix with free rows in one batch without changing them."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
import torch
from llguidance.tiktoken import lltokenizer_from_encoding

import meshlm
from meshlm import InputError
from meshlm.serve.grammar import Constraint
from tests.helpers.schemas import SCHEMAS

# 100 sampled rows reach every branch of each schema (every optional key present and left out, every array
# length allowed: `branches_of` below, asserted), as 200 did; the second hundred re-walked the same branches
# (about 20 CPU s of the suite).
SAMPLES = 100


@pytest.fixture(scope="module")
def lm(hf_tiny_gpt2_vocab, gpt2_bpe_file):
    return meshlm.load(hf_tiny_gpt2_vocab.path, tokenizer=gpt2_bpe_file)


@pytest.fixture(scope="module")
def engine(lm):
    """A small engine of its own: few program shapes to compile for the many sampled rows."""
    return lm.engine(max_batch=16, max_len=128, tokenizer=lm.tokenizer)


def sampled(engine, lm, constraint: Constraint, n: int = SAMPLES, max_new: int = 120) -> list:
    prompt = lm.encode_prompt("Data:")
    params = [lm.sampling(max_new_tokens=max_new, temperature=1.0, seed=i, constraint=constraint) for i in range(n)]
    return engine.generate([prompt] * n, params)


def branches_of(schema: dict, value=None, path: str = "$") -> set[tuple]:
    """The branches a JSON value takes through an object/array schema: (path, property, present) for each
    declared property, (path, "items", length) for each array; without a value, every branch the schema allows
    (a required property only present, an array every length from minItems to its maxItems)."""
    found: set[tuple] = set()
    if schema.get("type") == "object":
        for key, sub in schema["properties"].items():
            if value is None:
                optional = key not in schema.get("required", ())
                found |= {(path, key, True)} | ({(path, key, False)} if optional else set())
                found |= branches_of(sub, None, f"{path}.{key}")
            else:
                found.add((path, key, key in value))
                if key in value:
                    found |= branches_of(sub, value[key], f"{path}.{key}")
    elif schema.get("type") == "array":
        if value is None:
            found |= {(path, "items", n) for n in range(schema.get("minItems", 0), schema["maxItems"] + 1)}
            found |= branches_of(schema["items"], None, f"{path}[]")
        else:
            found.add((path, "items", len(value)))
            for item in value:
                found |= branches_of(schema["items"], item, f"{path}[]")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_completions_validate_against_the_schema(engine, lm, name):
    schema = SCHEMAS[name]
    outputs = sampled(engine, lm, Constraint.json_schema(schema))
    taken = set()
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(value := json.loads(out.text), schema)
        taken |= branches_of(schema, value)
    assert len({out.text for out in outputs}) > SAMPLES // 4  # sampled, not one answer
    assert taken == branches_of(schema)  # every optional key both ways, every array length: each branch validated


@pytest.mark.slow
def test_regex_and_choice_outputs_match(engine, lm):
    pattern = r"(yes|no), [0-9]{2,3}!"
    for out in sampled(engine, lm, Constraint.regex(pattern), n=50, max_new=16):
        assert re.fullmatch(pattern, out.text), out.text
    choices = ["alpha", "beta gamma", "δ"]
    texts = {out.text for out in sampled(engine, lm, Constraint.choice(choices), n=50, max_new=8)}
    assert texts <= set(choices) and len(texts) > 1


def reference_greedy(hf_model, tokenizer, schema: dict, prompt: list[int], max_new: int) -> list[int]:
    """transformers' logits, llguidance's own mask (its matcher, its numpy bitmask), argmax: the tokens before
    end-of-sequence."""
    ll = lltokenizer_from_encoding(tokenizer.encoding, eos_token=tokenizer.eot_id)
    matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("json", json.dumps(schema)))
    bitmask = llguidance.numpy.allocate_token_bitmask(1, ll.vocab_size)
    tokens, out = list(prompt), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = hf_model.torch_model(torch.tensor([tokens])).logits[0, -1].numpy()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: ll.vocab_size].astype(bool)
        masked = np.full_like(logits, -np.inf)
        masked[: ll.vocab_size] = np.where(bits, logits[: ll.vocab_size], -np.inf)
        token = int(masked.argmax())
        if token == tokenizer.eot_id:
            return out
        assert matcher.consume_token(token)
        tokens.append(token)
        out.append(token)
    return out


def test_greedy_under_a_schema_equals_the_reference_loop(lm, hf_tiny_gpt2_vocab):
    schema = SCHEMAS["numbers_and_optional_keys"]
    prompt = lm.encode_prompt("Score:")
    want = reference_greedy(hf_tiny_gpt2_vocab, lm.tokenizer, schema, prompt, 64)
    got = lm.generate_tokens([prompt], lm.sampling(max_new_tokens=64, temperature=0,
                                                   constraint=Constraint.json_schema(schema)))[0]  # fmt: skip
    assert got.tokens == want and got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), schema)


def test_constrained_rows_mix_with_free_rows(lm):
    """Free rows in a batch with constrained ones generate what they generate alone; `generate` takes a schema."""
    prompts = ["Once upon a time", "The capital of"]
    free = lm.generate(prompts, max_new_tokens=12, temperature=0)
    ids = [lm.encode_prompt(p) for p in prompts]
    json_row = lm.sampling(max_new_tokens=64, temperature=0, constraint=Constraint.json_schema(SCHEMAS["nested"]))
    mixed = lm.generate_tokens([ids[0], ids[0], ids[1]], [lm.sampling(max_new_tokens=12, temperature=0), json_row,
                                                          lm.sampling(max_new_tokens=12, temperature=0)])  # fmt: skip
    assert [mixed[0].text, mixed[2].text] == free
    jsonschema.validate(json.loads(mixed[1].text), SCHEMAS["nested"])
    (text,) = lm.generate(prompts[:1], max_new_tokens=64, temperature=0, json_schema=SCHEMAS["array_of_objects"])
    jsonschema.validate(json.loads(text), SCHEMAS["array_of_objects"])


def test_bad_constraints_are_refused_in_one_line(lm):
    with pytest.raises(InputError, match="invalid json"):
        lm.generate(["x"], json_schema={"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(InputError, match="invalid regex"):
        lm.generate(["x"], regex="(unclosed")
    with pytest.raises(InputError, match="one of json_schema, regex and choice"):
        lm.generate(["x"], regex="a", choice=["a"])
    speculating = lm.engine(ngram=2, max_batch=2)
    params = lm.sampling(max_new_tokens=4, constraint=Constraint.json_object())
    with pytest.raises(InputError, match="speculative decoding"):
        speculating.add_request(lm.encode_prompt("x"), params)


# ---------------------------------------------------------------------------------------------------
# Issue 42: budgets checked before admission, and a row whose constraint fails mid-way ends alone


@pytest.mark.parametrize(
    "constraint, words",
    [
        (Constraint.choice([str(i) for i in range(10_000)], "guided_choice"), "10,000 choices; at most 2,000"),
        (Constraint.regex("f{300000}", "guided_regex"), "repetition {300000} exceeds 2000"),
        (Constraint.regex("x{1,100000}", "guided_regex"), "repetition {1,100000} exceeds 2000"),
        (Constraint.grammar('start: "a"{5000}', "guided_grammar"), "repetition {5000} exceeds 2000"),
        (Constraint.regex("a" * 300_000, "guided_regex"), "300,000 bytes; at most 262,144"),
    ],
)
def test_constraints_over_the_size_budgets_are_refused_before_compiling(engine, constraint, words):
    """10,000 choices passed compiling and failed mid-generation (llguidance's 2,000 items per row);
    f{300000} compiled in a millisecond, then took 44 s for a row's first mask."""
    with pytest.raises(InputError, match=re.escape(words)) as e:
        engine.check_constraint(constraint)
    assert e.value.param == constraint.param and "\n" not in str(e.value)


def test_a_constraint_whose_first_mask_is_too_slow_is_refused_once(engine, monkeypatch):
    from meshlm.serve import grammar

    monkeypatch.setattr(grammar, "MASK_SECONDS", 0.0)
    slow = Constraint.regex("[a-z]{3,12}", "guided_regex")
    with pytest.raises(InputError, match="too complex: a token's mask took"):
        engine.check_constraint(slow)
    monkeypatch.setattr(grammar, "MASK_SECONDS", 60.0)
    with pytest.raises(InputError, match="too complex"):  # the verdict is remembered
        engine.check_constraint(slow)
    engine.check_constraint(Constraint.regex("[a-z]{3,11}", "guided_regex"))


class FailingMatcher:
    """A constraint that fails at its row's second step, as a runtime limit of llguidance does."""

    def __init__(self, matcher):
        self.matcher, self.steps = matcher, 0

    def fill(self, out: np.ndarray) -> None:
        self.steps += 1
        if self.steps == 2:
            raise InputError("max_items_in_row exceeded")
        self.matcher.fill(out)

    def accept(self, token: int) -> None:
        self.matcher.accept(token)


# The two tests below run the module's engine, whose programs the sampled tests compiled (an engine of
# their own, max_batch=4 and max_len=64, compiled a third set for nothing they prove: two rows of 12 tokens).


@pytest.mark.slow  # compiles an engine's programs when run alone (over 8 s on a 2-core machine)
def test_a_row_whose_constraint_fails_mid_way_ends_alone(lm, engine):
    """Before, the error failed every row in flight and reset the cache."""
    prompt = lm.encode_prompt("Once upon a time")
    free = lm.sampling(max_new_tokens=12, temperature=0)
    (alone,) = engine.generate([prompt], [free])
    constrained = lm.sampling(max_new_tokens=12, temperature=0, constraint=Constraint.regex("[a-z ]+"))
    rows = engine.add_requests([prompt, prompt], [constrained, free], tokenizer=lm.tokenizer)
    rows[0].matcher = FailingMatcher(rows[0].matcher)
    while engine.has_work():
        engine.step(4)
    assert rows[0].error_status == 400 and "max_items_in_row exceeded" in rows[0].error
    assert rows[1].error is None and rows[1].output.tokens == alone.tokens


@pytest.mark.slow  # compiles an engine's programs when run alone (over 8 s on a 2-core machine)
def test_a_row_with_an_id_past_the_tokenizers_fails_alone_and_the_id_is_never_decoded(lm, engine, monkeypatch):
    """A NaN adapter's logits pick the padded id 50257 (here put in its row's step); decoding it crashed every
    row in flight."""
    prompt = lm.encode_prompt("Once upon a time")
    free = lm.sampling(max_new_tokens=8, temperature=0)
    (alone,) = engine.generate([prompt], [free])
    rows = engine.add_requests([prompt, prompt], [free, free], tokenizer=lm.tokenizer)
    take, decode, decoded = engine.scheduler._take, lm.tokenizer.decode, []

    def poisoned(r, step, i):
        if r is rows[0]:
            step = step._replace(token=np.where(step.emitted, 50257, step.token))
        return take(r, step, i)

    monkeypatch.setattr(engine.scheduler, "_take", poisoned)
    monkeypatch.setattr(lm.tokenizer, "decode", lambda ids, *a, **k: decoded.extend(ids) or decode(ids, *a, **k))
    while engine.has_work():
        engine.step(4)
    assert rows[0].error_status == 500 and "token id 50257" in rows[0].error
    assert rows[0].output.tokens == [] and 50257 not in decoded
    assert rows[1].error is None and rows[1].output.tokens == alone.tokens
