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
from meshlm.grammar import Constraint
from tests.helpers.schemas import SCHEMAS

SAMPLES = 200


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


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_completions_validate_against_the_schema(engine, lm, name):
    schema = SCHEMAS[name]
    outputs = sampled(engine, lm, Constraint.json_schema(schema))
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({out.text for out in outputs}) > SAMPLES // 4  # sampled, not one answer


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
