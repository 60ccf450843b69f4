"""`meshlm serve` as a real process on 127.0.0.1, driven by the official `openai` client and plain HTTP."""

import asyncio
import os
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

import meshlm
from tests.helpers.serving import serving

# Every test here shares a live server (or processes) started by a module fixture: the whole file is slow.
pytestmark = pytest.mark.slow

MAX_BATCH, MAX_QUEUE, MAX_LEN = 4, 24, 128
PROMPT = "Hello world, this is"
API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(url: str, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(url, headers={**AUTH, **(headers or {})}, **kwargs)


@pytest.fixture(scope="module")
def server(hf_tiny_gpt2_vocab, gpt2_bpe_file):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "MESHLM_TOKENIZER": gpt2_bpe_file}
    args = [str(hf_tiny_gpt2_vocab.path), "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)]
    args += ["--max-len", str(MAX_LEN), "--model-name", "tiny", "--api-key", API_KEY]
    with serving(args, env, start_within=180) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(hf_tiny_gpt2_vocab, gpt2_bpe_file):
    """The same checkpoint in this process, through `LanguageModel.generate`."""
    return meshlm.load(hf_tiny_gpt2_vocab.path, tokenizer=gpt2_bpe_file)


@pytest.mark.slow
def test_a_cold_burst_of_assorted_requests_compiles_nothing(server, reference):
    """The first requests a fresh server sees (prompts of 1 to 120 tokens, several rows, greedy and
    sampled together) run on shapes compiled before /health answered; greedy rows equal `generate`."""
    rng = np.random.default_rng(0)
    cases = []
    for n in (1, 3, 17, 40, 70, 120):
        prompt = rng.integers(1, 50000, n).tolist()
        cases.append(dict(prompt=prompt, max_tokens=int(min(MAX_LEN - n, rng.integers(1, 30))), temperature=0))
        cases.append(dict(prompt=prompt, max_tokens=4, temperature=0.9, top_k=20, n=2))

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            return await asyncio.gather(*(c.post(f"{server}/v1/completions", json=body) for body in cases))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * len(cases), [r.text for r in responses]
    health = httpx.get(f"{server}/health").json()
    assert health["compiled_shapes"] > 0 and health["compiles_since_warm_up"] == 0, health
    assert health["kv_tokens_used"] == 0  # every row gave its pages back
    for body, r in zip(cases, responses, strict=True):
        if body["temperature"] == 0:
            params = reference.sampling(max_new_tokens=body["max_tokens"], temperature=0)
            (want,) = reference.generate_tokens([body["prompt"]], params)
            assert r.json()["choices"][0]["text"] == want.text


def test_the_api_key_guards_everything_but_health(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(f"{server}/metrics", headers=headers).status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200


def test_prometheus_metrics(server):
    post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
    text = httpx.get(f"{server}/metrics", headers=AUTH).text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    for name in ("meshlm_queue_depth", "meshlm_running_rows", "meshlm_kv_pages_used", "meshlm_tokens_per_second"):
        assert name in values, name
    assert values["meshlm_generated_tokens_total"] >= 3
    assert values["meshlm_time_to_first_token_seconds_count"] >= 1
    assert values["meshlm_prefix_cache_hit_tokens_total"] <= values["meshlm_prefix_cache_lookup_tokens_total"]
    assert values["meshlm_compiles_since_warm_up_total"] == 0


def test_openai_client_completions(client, reference):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2)
    (choice,) = r.choices
    assert choice.text == reference.generate([PROMPT], max_new_tokens=24, temperature=0)[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 24
    assert len(choice.logprobs.tokens) == 24 == len(choice.logprobs.token_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(
        len(top) == 2 and max(top.values()) >= lp - 1e-6
        for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs, strict=True)
    )
    prompts = [PROMPT, "Once"]
    echoed = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, echo=True, n=2)
    assert [c.index for c in echoed.choices] == [0, 1, 2, 3]
    assert echoed.choices[0].text == PROMPT + choice.text[: len(echoed.choices[0].text) - len(PROMPT)]
    assert echoed.choices[2].text.startswith("Once")


def test_openai_client_streaming_matches_non_streaming(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.8, seed=11)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_legacy_complete_endpoint(server, client):
    r = post(f"{server}/complete", json={"context": PROMPT, "top_p": 0.9, "temp": 0.0, "gen_len": 12}, timeout=60)
    assert r.status_code == 200
    want = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert r.json() == {"completion": want}
    sampled = post(f"{server}/complete", json={"context": PROMPT, "top_p": 0.9, "temp": 1.0}, timeout=60)
    assert sampled.status_code == 200 and isinstance(sampled.json()["completion"], str)


def test_sixteen_concurrent_requests_are_batched(server, client):
    def body(i: int) -> dict:
        return dict(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=48, temperature=0)

    def decode_calls() -> int:
        return httpx.get(f"{server}/health", timeout=30).json()["decode_calls"]

    before = decode_calls()
    one_by_one = [client.completions.create(**body(i)).choices[0].text for i in range(16)]
    sequential = decode_calls() - before

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0) as aclient:
            results = await asyncio.gather(*(aclient.completions.create(**body(i)) for i in range(16)))
        return [r.choices[0].text for r in results]

    before = decode_calls()
    concurrent = asyncio.run(together())
    batched = decode_calls() - before
    assert concurrent == one_by_one  # a row gives the same text alone or batched with others
    # device calls, not wall time (which a loaded machine moves): the 16 rows share decode calls
    assert batched < sequential / 2, (batched, sequential)  # four slots: ideally a quarter


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    url = f"{server}/v1/completions"
    cases = [
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ({"prompt": 42}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
        ({"prompt": PROMPT, "logprobs": 9}, "logprobs"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": "hello " * 300, "max_tokens": 4}, "context"),
        ({"prompt": PROMPT, "max_tokens": 10_000}, "context"),
        ({"prompt": [[1, 2], [70000]]}, "prompt"),
        ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
        ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ]
    for payload, word in cases:
        r = post(url, json=payload, timeout=30)
        assert r.status_code == 400, (payload, r.text)
        error = r.json()["error"]
        assert word in error["message"] and error["type"] == "invalid_request_error", (payload, error)
    r = post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    assert post(f"{server}/complete", json={"top_p": 0.9}, timeout=30).status_code == 400
    r = post(f"{server}/complete", json={"context": PROMPT, "temp": 2.5}, timeout=30)
    assert r.status_code == 400 and "temp" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server}/v1/nothing", headers=AUTH, timeout=30).status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=-5)
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_a_cancelled_stream_stops_its_row(server):
    before = httpx.get(f"{server}/health").json()["tokens_generated"]
    payload = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=payload, headers=AUTH, timeout=30) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while (health := httpx.get(f"{server}/health").json())["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health["active"] == 0 and health["kv_tokens_used"] == 0  # its slot and pages are back
    assert health["tokens_generated"] - before < 75  # the row stopped well before its 100 tokens


def test_a_full_queue_answers_503_with_retry_after(server):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            payload = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0}
            requests = MAX_BATCH + MAX_QUEUE + 8  # more than the slots and the queue hold
            return await asyncio.gather(*(c.post(f"{server}/v1/completions", json=payload) for _ in range(requests)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 503} and codes.count(200) >= MAX_BATCH, codes
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and "busy" in busy.json()["error"]["message"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


@pytest.mark.slow
def test_a_request_past_its_timeout_answers_408_and_frees_its_row(reference):
    from fastapi.testclient import TestClient

    from meshlm.http.app import create_app

    engine = reference.engine(max_batch=1, max_len=64, kv_tokens=64)
    engine.start(chunk=1)
    try:
        app = create_app(reference, engine, "tiny", request_timeout=0.05)
        with TestClient(app) as http:
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 50, "temperature": 0})
            assert r.status_code == 408 and r.json()["error"]["type"] == "timeout", r.text
            deadline = time.monotonic() + 60
            while http.get("/health").json()["kv_tokens_used"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert http.get("/health").json()["kv_tokens_used"] == 0
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="request_timeout"):
        create_app(reference, engine, "tiny", request_timeout=0)


@pytest.mark.slow
def test_a_server_with_a_draft_model_reports_its_acceptance(reference):
    """The model as its own draft: greedy text as `generate` gives it, every proposal kept, and the
    counts in the response's usage and in /health."""
    from fastapi.testclient import TestClient

    from meshlm.http.app import create_app

    engine = reference.engine(draft=reference, max_batch=2, max_len=64, kv_tokens=128, speculate=3)
    engine.start(chunk=1)
    try:
        with TestClient(create_app(reference, engine, "tiny")) as http:
            body = {"prompt": PROMPT, "max_tokens": 9, "temperature": 0, "stop": None}
            r = http.post("/v1/completions", json=body).json()
            (expected,) = reference.generate(PROMPT, max_new_tokens=9, temperature=0)
            assert r["choices"][0]["text"] == expected
            details = r["usage"]["completion_tokens_details"]
            assert details["accepted_prediction_tokens"] >= 6 and details["rejected_prediction_tokens"] == 0
            assert http.get("/health").json()["speculative_acceptance_rate"] == 1.0
    finally:
        engine.stop()
