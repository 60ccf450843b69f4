"""`meshlm serve` as OpenAI's and vLLM's clients use it, against a live server on a tiny model: chat
completions (the openai SDK, lm-eval's `local-chat-completions`), the tokenizer endpoints (lm-eval's remote
tokenizer), the standard sampling parameters, prompt scoring (lm-eval's `local-completions` loglikelihood),
the defects of issue 25, `meshlm sample --chat`, LoRA adapters served by name (loaded and unloaded while
serving) and output constrained to JSON schemas, regexes, choices and forced tool calls.

Which tests wait for work elsewhere: the prompt-scoring tests (`test_prompt_scoring_*`, `test_lm_eval_*loglikelihood*`)
need the engine to fill `RowOutput.prompt_logprobs`; the sampling-parameter tests need the engine to honour
`SamplingParams`' presence/frequency penalties, logit_bias, min_p, min_tokens and include_stop_str_in_output.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest

import meshlm
from meshlm.chat import ChatTemplate
from tests import oracle
from tests.helpers.lora import peft_model
from tests.helpers.schemas import SCHEMAS
from tests.helpers.serving import serving

# Every test here shares a live server (or processes) started by a module fixture: the whole file is slow.
pytestmark = pytest.mark.slow

MAX_BATCH, MAX_QUEUE, MAX_LEN = 4, 32, 128
PROMPT = "Hello world, this is"
API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROOT = Path(__file__).resolve().parents[1]
# ChatML with GPT-2's <|endoftext|> closing each turn (so a reply ends where the model ends a document)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def adapters(hf_tiny_gpt2_vocab, tmp_path_factory) -> dict[str, Path]:
    """PEFT adapters of the served model: "tuned" (rank 4) served from the start, "late" (rank 8) loaded while
    serving, "wide" (rank 16) above the slots' rank 8, and "alien", of another base."""
    root = tmp_path_factory.mktemp("adapters")
    folders = {name: root / name for name in ("tuned", "late", "wide", "alien")}
    for seed, (name, rank) in enumerate((("tuned", 4), ("late", 8), ("wide", 16)), start=1):
        peft_model(hf_tiny_gpt2_vocab.path, "gptj", seed=seed, r=rank, lora_alpha=rank).save_pretrained(folders[name])
    alien = oracle.make_hf_model(root / "alien-base", n_embd=64, n_layer=2, n_head=4, rotary_dim=4, vocab_size=256)
    peft_model(alien.path, "gptj").save_pretrained(folders["alien"])
    return folders


@pytest.fixture(scope="module")
def server(hf_tiny_gpt2_vocab, gpt2_bpe_file, template_file, adapters):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHLM_TOKENIZER": gpt2_bpe_file}
    args = [str(hf_tiny_gpt2_vocab.path), "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)]
    args += [
        "--max-len",
        str(MAX_LEN),
        "--model-name",
        "tiny",
        "--api-key",
        API_KEY,
        "--chat-template",
        str(template_file),
        "--adapter",
        f"tuned={adapters['tuned']}",
        "--max-adapters",
        "2",
        "--max-lora-rank",
        "8",
        "--allow-runtime-adapters",
        "--adapter-root",
        str(adapters["late"].parent),
    ]
    with serving(args, env, start_within=300) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(hf_tiny_gpt2_vocab, gpt2_bpe_file):
    """The same checkpoint in this process."""
    return meshlm.load(hf_tiny_gpt2_vocab.path, tokenizer=gpt2_bpe_file)


@pytest.fixture(scope="module")
def template(reference) -> ChatTemplate:
    return ChatTemplate(TEMPLATE, reference.tokenizer.special_tokens)


def post(url: str, payload: dict | None = None, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(url, json=payload, headers={**AUTH, **(headers or {})}, timeout=120, **kwargs)


def greedy(reference, ids: list[int], max_new: int, **settings):
    """What the engine in this process generates for token ids, greedily."""
    (done,) = reference.generate_tokens([ids], reference.sampling(max_new_tokens=max_new, temperature=0, **settings))
    return done


def events(response: httpx.Response) -> list:
    """The JSON payloads of a server-sent event stream, and "[DONE]"."""
    out = []
    for block in response.text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------------------------------------------
# The defects of issue 25


@pytest.mark.slow
def test_stream_options_include_usage_sends_a_final_usage_chunk(server):
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        payload = {**body, "max_tokens": 5, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        chunks = events(post(f"{server}{path}", payload))
        assert chunks[-1] == "[DONE]"
        usage = chunks[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5, usage
        assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
        assert all(c["usage"] is None for c in chunks[:-2]), chunks  # as OpenAI: null on every other chunk
        plain = events(post(f"{server}{path}", {**payload, "stream_options": None}))
        assert all("usage" not in c for c in plain[:-1]), plain
    r = post(f"{server}/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_an_unknown_model_is_404_and_the_served_one_has_a_card(server, client):
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        r = post(f"{server}{path}", {**body, "model": "gpt-4", "max_tokens": 1})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error", error
        assert "gpt-4" in error["message"] and set(error) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "meshlm"
    assert card.model_dump()["max_model_len"] == MAX_LEN
    assert client.models.list().data[0].model_dump() == card.model_dump()
    r = httpx.get(f"{server}/v1/models/other", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_prompt_tokens_count_each_prompt_once(server, reference, template):
    prompts = [PROMPT, "Once upon a time"]
    r = post(f"{server}/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 2, "temperature": 0}).json()
    n_prompt = sum(len(reference.encode_prompt(p)) for p in prompts)
    assert r["usage"]["prompt_tokens"] == n_prompt
    assert r["usage"]["completion_tokens"] == 2 * 3 * 2 and len(r["choices"]) == 6
    chat = post(f"{server}/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 2, "temperature": 0}).json()
    n_chat = len(template.encode(CHAT, reference.tokenizer, add_generation_prompt=True))
    assert chat["usage"]["prompt_tokens"] == n_chat and chat["usage"]["completion_tokens"] == 4


def test_five_stop_strings_are_refused_naming_the_limit(server):
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        r = post(f"{server}{path}", {**body, "stop": ["a", "b", "c", "d", "e"]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"] == "stop: at most 4 stop strings, got 5" and error["param"] == "stop", error
    r = post(f"{server}/v1/completions", {"prompt": PROMPT, "stop": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stop: must be a string or a list")


def test_malformed_json_gets_400_without_a_character_position(server):
    r = post(f"{server}/v1/completions", content=b'{"prompt": "x", oops}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is None and error["message"].startswith("invalid JSON: "), error
    assert error["type"] == "invalid_request_error"


def test_the_bearer_scheme_is_case_insensitive(server):
    body = {"prompt": PROMPT, "max_tokens": 1}
    for scheme in ("bearer", "BEARER", "Bearer", "beaRer"):
        r = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"{scheme} {API_KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    for header in (f"Basic {API_KEY}", f"bearer {API_KEY}x", "bearer", API_KEY):
        r = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": header})
        assert r.status_code == 401, (header, r.text)
    assert httpx.get(f"{server}/tokenizer_info").status_code == 401  # the new routes are guarded too


def test_an_unknown_field_is_refused_naming_it(server):
    cases = [
        ("/v1/completions", {"prompt": PROMPT, "temprature": 0.5}, "temprature"),
        ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"messages": CHAT, "functions": []}, "functions"),
        ("/v1/completions", {"prompt": PROMPT, "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
        ("/tokenize", {"prompt": PROMPT, "return_everything": True}, "return_everything"),
    ]
    for path, payload, name in cases:
        r = post(f"{server}{path}", payload)
        assert r.status_code == 400, (payload, r.text)
        error = r.json()["error"]
        assert error["message"] == f"{name}: unknown field; this server does not support it", error
        assert error["param"] == name.split(".")[0]
    refused = [
        ("/v1/completions", {"prompt": PROMPT, "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
    ]
    for path, payload, name in refused:
        r = post(f"{server}{path}", payload)
        assert r.status_code == 400 and r.json()["error"]["message"] == f"{name} is not supported by this server"
    r = post(f"{server}/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    # the off values of those, and the fields OpenAI and vLLM clients send, are accepted
    ok = {"prompt": PROMPT, "max_tokens": 1, "suffix": None, "best_of": 1, "user": "u1", "top_k": -1}
    assert post(f"{server}/v1/completions", ok).status_code == 200


# ---------------------------------------------------------------------------------------------------
# Tokenizer endpoints, as vLLM serves them and lm-eval reads them


def test_tokenize_detokenize_and_tokenizer_info(server, reference, template):
    tok = reference.tokenizer
    r = post(f"{server}/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert r == {"count": len(tok.encode(PROMPT)), "max_model_len": MAX_LEN, "tokens": tok.encode(PROMPT)}
    chat = post(f"{server}/tokenize", {"messages": CHAT, "model": "tiny"}).json()
    assert chat["tokens"] == template.encode(CHAT, tok, add_generation_prompt=True)
    no_prompt = post(f"{server}/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == template.encode(CHAT, tok)
    assert post(f"{server}/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    assert post(f"{server}/detokenize", {"tokens": [10**9]}).status_code == 400
    assert post(f"{server}/tokenize", {"prompt": "x", "messages": CHAT}).status_code == 400
    assert post(f"{server}/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    info = httpx.get(f"{server}/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == info["bos_token"] == "<|endoftext|>", info
    assert info["chat_template"] == TEMPLATE and info["model_max_length"] == MAX_LEN and info["tokenizer_class"]


def test_lm_eval_detects_and_uses_the_servers_tokenizer(server, reference):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url = f"{server}/v1/completions"
    assert check_remote_tokenizer_support(url, auth_token=API_KEY)
    assert not check_remote_tokenizer_support(url, auth_token="wrong", max_retries=1)
    remote = RemoteTokenizer(url, auth_token=API_KEY)
    tok = reference.tokenizer
    assert remote.encode(PROMPT) == tok.encode(PROMPT)
    assert remote.decode(tok.encode(PROMPT)) == PROMPT
    assert remote.eos_token_id == tok.eot_id and remote.bos_token_id == tok.eot_id
    assert remote.apply_chat_template(CHAT) == ChatTemplate(TEMPLATE).render(CHAT, True)


# ---------------------------------------------------------------------------------------------------
# Chat completions


def test_openai_sdk_chat_matches_the_engine(client, reference, template):
    ids = template.encode(CHAT, reference.tokenizer, add_generation_prompt=True)
    want = greedy(reference, ids, 12)
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=12, temperature=0)
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason and choice.logprobs is None
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.tokens)
    assert r.usage.total_tokens == len(ids) + len(want.tokens)
    old = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert old.choices[0].message.content == want.text  # the deprecated name works the same


def test_openai_sdk_chat_streams_what_it_answers_whole(client):
    kwargs = dict(model="tiny", messages=CHAT, max_completion_tokens=16, temperature=0.9, seed=3, n=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for i, choice in enumerate(whole.choices):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert deltas[0].delta.role == "assistant" and deltas[0].delta.content == ""
        assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
        assert deltas[-1].finish_reason == choice.finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.choices[0].message.content != whole.choices[1].message.content  # seeds seed and seed + 1
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in whole.choices]


def test_openai_sdk_chat_logprobs_and_stop(client, reference, template):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3)  # fmt: skip
    (choice,) = r.choices
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the likeliest
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
    ids = template.encode(CHAT, reference.tokenizer, add_generation_prompt=True)
    want = greedy(reference, ids, 10)
    assert [t.logprob for t in content] == pytest.approx(want.logprobs, abs=1e-5)
    stop = choice.message.content[3:6]
    cut = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0,
                                         stop=[stop])  # fmt: skip
    assert cut.choices[0].message.content == choice.message.content[: choice.message.content.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kwargs = dict(model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0, logprobs=True, top_logprobs=1)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_chat_requests_that_cannot_work_are_400(server, reference):
    url = f"{server}/v1/chat/completions"
    cases = [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "'role' and 'content'"),
        ({"messages": CHAT, "top_logprobs": 2}, "needs logprobs"),
        ({"messages": CHAT, "top_logprobs": 9, "logprobs": True}, "top_logprobs"),
        ({"messages": CHAT, "max_completion_tokens": MAX_LEN}, "context"),
        ({"messages": CHAT, "continue_final_message": True}, "cannot both be true"),
    ]
    for payload, words in cases:
        r = post(url, payload)
        assert r.status_code == 400, (payload, r.text)
        assert words in r.json()["error"]["message"], (payload, r.text)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]}]
    r = post(url, {"messages": parts, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        reference.tokenizer.encode(ChatTemplate(TEMPLATE).render([{"role": "user", "content": "Name a\ncolour."}],
                                                                 True)))  # fmt: skip
    prefill = post(url, {"messages": [*CHAT, {"role": "assistant", "content": "Blue is"}], "max_tokens": 2,
                         "add_generation_prompt": False, "continue_final_message": True, "temperature": 0})  # fmt: skip
    assert prefill.status_code == 200, prefill.text


def test_a_model_without_a_chat_template_answers_400(reference):
    from fastapi.testclient import TestClient

    from meshlm.http.app import create_app

    engine = reference.engine(max_batch=1, max_len=64, kv_tokens=64)  # never started: nothing is generated
    with TestClient(create_app(reference, engine, "tiny")) as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 400, r.text
        assert "no chat template" in r.json()["error"]["message"] and "--chat-template" in r.json()["error"]["message"]
        assert "chat_template" not in http.get("/tokenizer_info").json()


def test_lm_eval_local_chat_completions_generate_until(server, reference, template, monkeypatch):
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    lm = LocalChatCompletion(base_url=f"{server}/v1/chat/completions", model="tiny", max_retries=1)
    chats = [CHAT, [{"role": "user", "content": "Say something."}]]
    gen = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    requests = [Instance("generate_until", {}, (JsonChatStr(json.dumps(c)), gen), i) for i, c in enumerate(chats)]
    texts = lm.generate_until(requests)
    for chat, text in zip(chats, texts, strict=True):
        ids = template.encode(chat, reference.tokenizer, add_generation_prompt=True)
        assert text == greedy(reference, ids, 12, stop=["\n\n"]).text


# ---------------------------------------------------------------------------------------------------
# Sampling parameters: the request's fields reach the engine as SamplingParams


def test_sampling_parameters_reach_the_engine(server, reference):
    tok = reference.tokenizer
    ids = tok.encode(PROMPT)
    cases = [
        dict(presence_penalty=1.5, frequency_penalty=0.7, temperature=0),
        dict(presence_penalty=-1.0, temperature=0.8, seed=5),
        dict(min_p=0.2, temperature=1.3, seed=7),
        dict(logit_bias={str(tok.encode(" the")[0]): 5.0, "11": -100}, temperature=0),
        dict(repetition_penalty=1.3, frequency_penalty=0.5, temperature=0.7, top_k=40, seed=9),
    ]
    for case in cases:
        r = post(f"{server}/v1/completions", {"prompt": PROMPT, "max_tokens": 16, **case})
        assert r.status_code == 200, (case, r.text)
        settings = {k: v for k, v in case.items() if k != "logit_bias"}
        if "logit_bias" in case:
            settings["logit_bias"] = {int(k): v for k, v in case["logit_bias"].items()}
        (want,) = reference.generate_tokens([ids], reference.sampling(max_new_tokens=16, **settings))
        assert r.json()["choices"][0]["text"] == want.text, case


def test_logit_bias_min_tokens_ignore_eos_and_stop_token_ids(server, reference):
    tok = reference.tokenizer
    url = f"{server}/v1/completions"
    forced = tok.encode(" blue")[0]
    r = post(url, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logit_bias": {str(forced): 100}}).json()
    assert r["choices"][0]["text"] == tok.decode([forced] * 6)
    eot = {str(tok.eot_id): 100}  # <|endoftext|> is all but certain
    r = post(url, {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logit_bias": eot}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 0
    r = post(url, {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logit_bias": eot, "min_tokens": 4}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 4, r
    r = post(url, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logit_bias": eot, "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5, r
    plain = greedy(reference, tok.encode(PROMPT), 20)
    stop_id = plain.tokens[6]
    r = post(url, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop_token_ids": [stop_id]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == tok.decode(plain.tokens[: plain.tokens.index(stop_id)])


def test_include_stop_str_in_output(server, reference):
    text = greedy(reference, reference.tokenizer.encode(PROMPT), 20).text
    stop = text[6:9]
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop": [stop]}
    r = post(f"{server}/v1/completions", body).json()["choices"][0]
    assert r["text"] == text[: text.index(stop)] and r["finish_reason"] == "stop"
    r = post(f"{server}/v1/completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert r["text"] == text[: text.index(stop) + len(stop)] and r["finish_reason"] == "stop"


def test_bad_sampling_parameters_are_400(server):
    url = f"{server}/v1/completions"
    cases = [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt_logprobs": 9}, "prompt_logprobs"),
    ]
    for extra, word in cases:
        r = post(url, {"prompt": PROMPT, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert word in r.json()["error"]["message"], (extra, r.text)


# ---------------------------------------------------------------------------------------------------
# Prompt scoring: echo with logprobs, max_tokens 0, vLLM's prompt_logprobs


def scores(reference, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """log p(ids[j] | ids[:j]) for j >= 1, and the argmax there, in this process."""
    lp, best = reference.token_logprobs(np.array([ids[:-1]]), np.array([ids[1:]]))
    return lp[0], best[0]


def test_prompt_scoring_with_echo_and_logprobs(server, reference):
    tok = reference.tokenizer
    prompts = [PROMPT, "The quick brown fox jumps over the lazy dog"]
    for max_tokens in (1, 0):
        body = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
        r = post(f"{server}/v1/completions", body)
        assert r.status_code == 200, r.text
        for text, choice in zip(prompts, r.json()["choices"], strict=True):
            ids = tok.encode(text)
            lp = choice["logprobs"]
            assert choice["text"].startswith(text) and len(lp["tokens"]) == len(ids) + max_tokens
            assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            want, best = scores(reference, ids)
            assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want.tolist(), abs=1e-5)
            for j, top in enumerate(lp["top_logprobs"][1 : len(ids)]):
                assert tok.decode([int(best[j])]) in top and len(top) <= 3
                assert max(top.values()) >= lp["token_logprobs"][j + 1] - 1e-6
            assert lp["text_offset"][: len(ids)] == [len(tok.decode(ids[:j])) for j in range(len(ids))]


def test_prompt_scoring_streams_the_prompt_first(server, reference):
    ids = reference.tokenizer.encode(PROMPT)
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "stream": True}
    chunks = [c for c in events(post(f"{server}/v1/completions", body)) if c != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(scores(reference, ids)[0].tolist(), abs=1e-5)
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(ids) + 3


def test_prompt_scoring_vllm_prompt_logprobs(server, reference):
    tok = reference.tokenizer
    ids = tok.encode(PROMPT)
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        r = post(f"{server}{path}", {**body, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        plp = r.json()["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and all(isinstance(p, dict) for p in plp[1:])
    plp = post(f"{server}/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1}).json()
    plp = plp["choices"][0]["prompt_logprobs"]
    want, best = scores(reference, ids)
    assert len(plp) == len(ids)
    for j, entry in enumerate(plp[1:]):
        own = entry[str(ids[j + 1])]
        assert own["logprob"] == pytest.approx(float(want[j]), abs=1e-5)
        assert own["decoded_token"] == tok.decode([ids[j + 1]])
        assert entry[str(int(best[j]))]["rank"] == 1 and 2 <= len(entry) <= 3


def test_lm_eval_local_completions_loglikelihood(server, reference, monkeypatch):
    """lm-eval's `local-completions` with the server's own tokenizer (detected): each loglikelihood and its
    is-greedy flag as this process computes them."""
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    lm = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model="tiny", auth_token=API_KEY, max_retries=1,
                             max_length=MAX_LEN)  # fmt: skip
    assert lm.tokenizer_backend == "remote"
    tok = reference.tokenizer
    pairs = [("The capital of France is", " Paris"), ("Two plus two is", " four"), ("Hello", " world, this is")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (ll, is_greedy) in zip(pairs, results, strict=True):
        ctx = tok.encode(context)  # as lm-eval splits a pair: the whole text's tokens after the context's
        cont = tok.encode(context + continuation)[len(ctx) :]
        want, best = scores(reference, ctx + cont)
        assert ll == pytest.approx(float(want[len(ctx) - 1 :].sum()), abs=1e-5)
        assert is_greedy == bool((best[len(ctx) - 1 :] == np.array(cont)).all())
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (PROMPT,), 0)])
    ids = [tok.eot_id, *tok.encode(PROMPT)]
    assert rolling[0] == pytest.approx(float(scores(reference, ids)[0].sum()), abs=1e-4)


# ---------------------------------------------------------------------------------------------------
# `meshlm sample --chat`


@pytest.mark.slow
def test_sample_chat_keeps_the_history(hf_tiny_gpt2_vocab, gpt2_bpe_file, template_file, reference, template):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHLM_TOKENIZER": gpt2_bpe_file}
    cmd = [sys.executable, "-m", "meshlm", "sample", str(hf_tiny_gpt2_vocab.path), "--chat", "--chat-template",
           str(template_file), "--temperature", "0", "--max-new-tokens", "8", "--system", "You are terse."]  # fmt: skip
    turns = ["Name a colour.", "And another?"]
    done = subprocess.run(cmd, env=env, input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    chat, replies = [{"role": "system", "content": "You are terse."}], []
    for turn in turns:
        chat.append({"role": "user", "content": turn})
        ids = template.encode(chat, reference.tokenizer, add_generation_prompt=True)
        reply = greedy(reference, ids, 8).text
        replies.append(reply)
        chat.append({"role": "assistant", "content": reply})
    assert done.stdout == "".join(f"{r}\n" for r in replies), (done.stdout, replies)


def test_chat_flags_that_cannot_work_are_refused_before_the_model_loads(capsys):
    from meshlm import cli

    cases = [
        (["serve", "no-such-checkpoint", "--port", "0", "--chat-template", "no-such.jinja"],
         "meshlm serve: error: --chat-template no-such.jinja: no such file"),
        (["sample", "no-such-checkpoint", "--chat", "--prompt", "hi"],
         "meshlm sample: error: --chat reads the user's turns from stdin; it takes no --prompt"),
        (["sample", "no-such-checkpoint", "--system", "Be brief."],
         "meshlm sample: error: --chat-template and --system are for --chat"),
    ]  # fmt: skip
    for argv, line in cases:
        assert cli.main(argv) == 1
        assert capsys.readouterr().err == line + "\n"


# ---------------------------------------------------------------------------------------------------
# LoRA adapters served by name (vLLM's --lora-modules and /v1/load_lora_adapter)


@pytest.mark.slow
def test_an_adapter_is_served_by_name_as_the_single_adapter_path_runs_it(server, client, adapters, gpt2_bpe_file,
                                                                         hf_tiny_gpt2_vocab):  # fmt: skip
    cards = httpx.get(f"{server}/v1/models", headers=AUTH).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("tuned", "tiny")]
    assert cards[1]["root"] == str(adapters["tuned"])
    tuned = meshlm.load(hf_tiny_gpt2_vocab.path, tokenizer=gpt2_bpe_file, adapter=adapters["tuned"])
    want = greedy(tuned, tuned.encode_prompt(PROMPT), 8)
    got = client.completions.create(model="tuned", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    assert got.model == "tuned" and got.choices[0].text == want.text
    np.testing.assert_allclose(got.choices[0].logprobs.token_logprobs, want.logprobs, atol=1e-5, rtol=0)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    assert np.abs(np.subtract(plain.choices[0].logprobs.token_logprobs, want.logprobs)).max() > 1e-3
    chat = client.chat.completions.create(model="tuned", messages=CHAT, max_tokens=4, temperature=0)
    assert chat.model == "tuned" and chat.choices[0].message.content is not None


def test_adapters_load_and_unload_while_serving_and_nothing_compiles(server, client, adapters):
    r = post(f"{server}/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully.", r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "tuned", "late"]
    # 16 rows of 120 tokens, 4 at a time: the request runs "late" for a while after its first token
    payload = {
        "model": "late",
        "prompt": PROMPT,
        "max_tokens": MAX_LEN - 8,
        "ignore_eos": True,
        "stream": True,
        "n": 16,
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=payload, headers=AUTH, timeout=120) as running:
        lines = running.iter_lines()
        next(lines)
        busy = post(f"{server}/v1/unload_lora_adapter", {"lora_name": "late"})
        assert busy.status_code == 400 and "in use by running requests" in busy.json()["error"]["message"], busy.text
        # "tuned" joins the batch that runs "late"
        both = client.completions.create(model="tuned", prompt=PROMPT, max_tokens=4, temperature=0)
        assert both.choices[0].finish_reason == "length"
        list(lines)
    r = post(f"{server}/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully.", r.text
    gone = post(f"{server}/v1/completions", {"model": "late", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
    health = httpx.get(f"{server}/health").json()
    assert health["compiles_since_warm_up"] == 0, health


def test_bad_adapters_get_a_clear_4xx_and_the_server_serves_on(server, client, adapters, tmp_path):
    cases = [
        ({"lora_name": "alien", "lora_path": str(adapters["alien"])}, 400, "adapter does not match the base"),
        ({"lora_name": "wide", "lora_path": str(adapters["wide"])}, 400, "rank 16 exceeds the adapter slots' rank 8"),
        ({"lora_name": "gone", "lora_path": str(tmp_path / "gone")}, 400, "not an adapter folder under"),
        ({"lora_name": "tuned", "lora_path": str(adapters["late"])}, 400, "loaded already"),
        ({"lora_name": "tiny", "lora_path": str(adapters["late"])}, 400, "the served model's name"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ]
    for body, status, message in cases:
        r = post(f"{server}/v1/load_lora_adapter", body)
        assert r.status_code == status and message in r.json()["error"]["message"], (body, r.text)
    r = post(f"{server}/v1/unload_lora_adapter", {"lora_name": "never"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name", r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert [m.id for m in client.models.list().data] == ["tiny", "tuned"]
    assert client.completions.create(model="tuned", prompt=PROMPT, max_tokens=2).choices[0].text is not None


# ---------------------------------------------------------------------------------------------------
# Output constrained to a JSON schema, a regex, a choice or a tool call


def test_response_format_json_schema_streamed_and_not(server, client):
    for name in ("nested", "array_of_objects"):
        schema = SCHEMAS[name]
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=1, n=8, seed=1,
                                               response_format=fmt)  # fmt: skip
        texts = [c.message.content for c in plain.choices]
        streamed = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=1, n=8,
                                                  seed=2, response_format=fmt, stream=True)  # fmt: skip
        pieces = [""] * 8
        for chunk in streamed:
            for c in chunk.choices:
                pieces[c.index] += c.delta.content or ""
        completions = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=96, temperature=1, n=8, seed=3,
                                                extra_body={"guided_json": schema})  # fmt: skip
        for text in [*texts, *pieces, *(c.text for c in completions.choices)]:
            jsonschema.validate(json.loads(text), schema)


def test_guided_regex_choice_and_stop_strings(server, client):
    regex = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1, n=8,
                                      extra_body={"guided_regex": r"(yes|no), [0-9]{2}!"})  # fmt: skip
    assert all(re.fullmatch(r"(yes|no), [0-9]{2}!", c.text) for c in regex.choices), regex
    choice = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1, n=8,
                                       extra_body={"structured_outputs": {"choice": ["red", "green"]}})  # fmt: skip
    assert {c.text for c in choice.choices} <= {"red", "green"}
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=["b"],
                                        extra_body={"guided_regex": "a(bc)+"})  # fmt: skip
    assert stopped.choices[0].text == "a" and stopped.choices[0].finish_reason == "stop"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
        "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]  # fmt: skip


def test_a_forced_tool_call_returns_tool_calls_whose_arguments_follow_the_schema(server, client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=64, temperature=1, n=4, seed=0,
                                           tools=TOOLS, tool_choice=named)  # fmt: skip
    streamed = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=64, temperature=1, n=2, seed=1,
                                              tools=TOOLS, tool_choice=named, stream=True)  # fmt: skip
    calls = [c.message.tool_calls[0] for c in reply.choices]
    calls += [d.tool_calls[0] for chunk in streamed for c in chunk.choices if (d := c.delta).tool_calls]
    assert len(calls) == 6 and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    required = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=1, n=4, seed=2,
                                              tools=TOOLS, tool_choice="required")  # fmt: skip
    for choice in required.choices:
        if choice.finish_reason == "length":  # a long list of calls, cut off: its text is the content
            continue
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "now")
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


@pytest.mark.slow
def test_an_invalid_constraint_is_a_400(server, client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError, match="invalid json"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, response_format=bad)
    r = post(f"{server}/v1/completions", {"prompt": PROMPT, "guided_regex": "(", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    r = post(f"{server}/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function",
             "function": {"name": "nope"}}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = post(f"{server}/v1/completions", {"prompt": PROMPT, "guided_regex": "a", "guided_choice": ["a"]})
    assert r.status_code == 400, r.text
