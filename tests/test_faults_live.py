"""Issue 42 on a live `meshlm serve`: one request's fault never reaches the others. A row that fails while
generating (a NaN adapter yields the padded id 50257) ends alone; oversized constraints are refused before
admission; a constraint that takes seconds to compile does so off the serving loop and is refused past its
budget; a body over --max-request-bytes is a 413; an unexpected error is a JSON 500 on a connection that
stays open. Each time, a good request sent alongside completes with exactly the tokens it gets alone."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers.serving import serving

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"model": "tiny", "prompt": "Hello world, this is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def nan_adapter(hf_tiny_gpt2_vocab, tmp_path_factory) -> Path:
    """A PEFT adapter whose weights are all NaN, as a diverged run leaves them."""
    from safetensors.numpy import load_file, save_file

    from tests.helpers.lora import peft_model

    folder = tmp_path_factory.mktemp("adapters") / "diverged"
    peft_model(hf_tiny_gpt2_vocab.path, "gptj", r=4).save_pretrained(folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k: np.full_like(v, np.nan) for k, v in weights.items()}, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def server(hf_tiny_gpt2_vocab, gpt2_bpe_file, nan_adapter):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHLM_TOKENIZER": gpt2_bpe_file}
    args = [str(hf_tiny_gpt2_vocab.path), "--max-batch", "4", "--max-len", "64", "--model-name", "tiny"]
    args += ["--adapter", f"nan={nan_adapter}", "--max-request-bytes", "200000"]
    with serving(args, env, start_within=300) as url:
        yield url


@pytest.fixture(scope="module")
def alone(server) -> str:
    """GOOD's text, asked alone."""
    r = httpx.post(f"{server}/v1/completions", json=GOOD, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def beside(server: str, bad: dict, route: str = "/v1/completions", delay: float = 0.0) -> tuple:
    """The bad request, and GOOD sent `delay` seconds after it; both answers, and when each came."""
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=server, timeout=120) as c:

        async def ask(path: str, body: dict, wait: float) -> tuple[httpx.Response, float]:
            await asyncio.sleep(wait)
            response = await c.post(path, json=body)
            return response, time.monotonic() - start

        return await asyncio.gather(ask(route, bad, 0.0), ask("/v1/completions", GOOD, delay))


def good_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_nan_adapters_row_fails_alone_and_the_rows_beside_it_keep_their_tokens(server, alone):
    bad = {**GOOD, "model": "nan"}
    (failed, _), (good, _) = asyncio.run(beside(server, bad))
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "token id 50257" in error["message"], error
    assert good_text(good) == alone
    with httpx.stream("POST", f"{server}/v1/completions", json={**bad, "stream": True}, timeout=120) as r:
        events = [line for line in r.iter_lines() if line]
    assert "token id 50257" in events[-2] and events[-1] == "data: [DONE]", events
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["active"] == 0, health
    assert good_text(httpx.post(f"{server}/v1/completions", json=GOOD, timeout=120)) == alone


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("guided_choice", [f"item {i}" for i in range(10_000)], "10,000 choices; at most 2,000"),
        ("guided_regex", "f{300000}", "repetition {300000} exceeds 2000"),
        ("guided_regex", "e{100000}", "repetition {100000} exceeds 2000"),
        ("guided_grammar", 'start: "a"{5000}', "exceeds 2000"),
    ],
)
def test_oversized_constraints_are_400_before_admission(server, alone, field, value, words):
    (refused, _), (good, _) = asyncio.run(beside(server, {**GOOD, field: value}))
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == field and words in error["message"], refused.text
    assert good_text(good) == alone


def test_a_constraint_slow_to_compile_is_refused_past_its_budget_and_stalls_no_one(server, alone):
    """(e{1000}){100} passes the size budget but its lexer takes seconds per row to build: it is built on a
    grammar worker while the good request, sent after it, runs and answers first."""
    bad = {**GOOD, "guided_regex": "(e{1000}){100}"}
    (refused, refused_at), (good, good_at) = asyncio.run(beside(server, bad, delay=0.5))
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "guided_regex", refused.text
    assert "did not compile within 5 s" in error["message"] or "too complex" in error["message"], error
    assert good_text(good) == alone and good_at < refused_at, (good_at, refused_at)
    start = time.monotonic()
    again = httpx.post(f"{server}/v1/completions", json=bad, timeout=120)  # the verdict is remembered
    assert again.status_code == 400 and time.monotonic() - start < 5 + 1, again.text


def test_a_body_over_max_request_bytes_is_413_and_health_answers(server, alone):
    big = {**GOOD, "prompt": "x" * 250_000}
    (refused, _), (good, _) = asyncio.run(beside(server, big))
    assert refused.status_code == 413 and "200,000 bytes" in refused.json()["error"]["message"], refused.text
    assert good_text(good) == alone
    assert httpx.get(f"{server}/health", timeout=5).json()["status"] == "ok"


# ---------------------------------------------------------------------------------------------------
# An unexpected error: the app in this process behind uvicorn on a real socket, with a route that fails


@pytest.fixture(scope="module")
def crashing_server(hf_tiny, neox_style_tokenizer):
    import uvicorn

    import meshlm
    from meshlm.http.app import create_app

    lm = meshlm.load(hf_tiny.path, tokenizer=neox_style_tokenizer)
    app = create_app(lm, lm.engine(max_batch=1, max_len=16, kv_tokens=16), "tiny")

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom, methods=["GET"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_open(crashing_server):
    connection = http.client.HTTPConnection("127.0.0.1", crashing_server, timeout=10)
    connection.request("GET", "/boom")
    first = connection.getresponse()
    body = first.read()
    assert first.status == 500 and first.getheader("content-type") == "application/json", body
    assert b'"type":"server_error"' in body and not first.will_close, first.headers
    sock = connection.sock
    connection.request("GET", "/health")
    second = connection.getresponse()
    assert second.status == 200 and b'"ok"' in second.read()
    assert connection.sock is sock  # the same connection answered both
    connection.close()
