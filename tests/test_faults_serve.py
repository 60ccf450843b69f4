"""`meshlm serve` faults: impossible settings and a port that cannot be had are refused in one line before
the model loads; a KV pool or batch the memory cannot hold is refused before it is allocated; the listening
line comes once the port is really listening; and every way out (an error, Ctrl-C while loading, compiling
or serving with requests in flight) is one line and no traceback, exit 1 or 130.

Issue 42's serving faults, in process (the live-server cases are in test_faults_live.py): OpenAI's
tool-calling turns render through the template; chat_template_kwargs the server sets, a body over
--max-request-bytes, a seed past 64 bits are 4xx naming what is wrong; prompts are tokenized off the event
loop; runtime adapters are opt-in, from under --adapter-root only, with one message for every refused path;
a malformed adapter_config.json is a 400 on load and one line at start-up."""

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import meshlm
from meshlm import cli
from meshlm.footprint import OutOfMemory
from meshlm.http.app import create_app
from meshlm.http.handlers import REFUSED_ADAPTER_PATH
from meshlm.http.state import Group
from meshlm.serve import runner

ABSENT = "no-such-checkpoint"  # a refusal that names anything else came before the model would load
ROOT = Path(__file__).resolve().parents[1]

Serve = Callable[..., tuple[int, str]]


@pytest.fixture
def serve(capsys: pytest.CaptureFixture) -> Serve:
    """`meshlm serve ARGS` in-process; returns its exit code and stderr."""

    def run(*args: object) -> tuple[int, str]:
        code = cli.main(["serve", *map(str, args)])
        return code, capsys.readouterr().err

    return run


def assert_refused(code: int, err: str, *words: str) -> None:
    """Exit 1 and one line, no traceback, holding every word."""
    assert code == 1, err
    assert err.startswith("meshlm serve: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--port", "70000"], ["port", "0..65535", "70000"]),
        (["--port", "-1"], ["port", "0..65535", "-1"]),
        (["--max-batch", "0"], ["--max-batch", "at least 1"]),
        (["--max-batch", "-4"], ["--max-batch", "-4"]),
        (["--chunk", "0"], ["--chunk"]),
        (["--max-len", "0"], ["--max-len"]),
        (["--kv-tokens", "0"], ["--kv-tokens"]),
        (["--max-queue", "0"], ["--max-queue"]),
        (["--speculate", "0"], ["--speculate"]),
        (["--request-timeout", "-1"], ["--request-timeout", "> 0"]),
        (["--request-timeout", "nan"], ["--request-timeout"]),
        (["--host", "no-such-host.invalid"], ["no-such-host.invalid"]),
        (["--max-request-bytes", "0"], ["--max-request-bytes", "at least 1"]),
        (["--allow-runtime-adapters"], ["--allow-runtime-adapters needs at least one --adapter-root"]),
        (["--adapter-root", "."], ["--adapter-root needs --allow-runtime-adapters"]),
        (["--allow-runtime-adapters", "--adapter-root", "no-such-folder"], ["--adapter-root no-such-folder"]),
        (["--model-name", "tiny", "--adapter", "tiny=."], ["'tiny' is the served model's own name"]),
        (["--mixed-steps", "--draft", "."], ["--mixed-steps with --draft", "speculation"]),
        (["--mixed-steps", "--mesh", "data=2,model=4"], ["--mixed-steps on mesh data=2,model=4", "batch axes"]),
    ],
)
def test_impossible_settings_are_refused_before_the_model_loads(serve: Serve, args: list[str], words: list[str]):
    assert_refused(*serve(ABSENT, *args), *words)


def test_a_port_in_use_is_refused_before_the_model_loads(serve: Serve, taken_port: int):
    assert_refused(*serve(ABSENT, "--port", taken_port), f"127.0.0.1:{taken_port} is already in use")


@pytest.fixture
def socket_path() -> Iterator[Path]:
    """A unix socket's path, short (the kernel takes 107 bytes at most), in a folder of its own."""
    folder = Path(tempfile.mkdtemp(prefix="uds-", dir="/tmp"))
    yield folder / "meshlm.sock"
    shutil.rmtree(folder, ignore_errors=True)


def test_a_unix_socket_that_cannot_be_had_is_refused_before_the_model_loads(serve: Serve, socket_path: Path):
    socket_path.write_text("not a socket")
    assert_refused(*serve(ABSENT, "--uds", socket_path), f"unix:{socket_path}", "exists and is not a socket")
    socket_path.unlink()
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(socket_path))
        live.listen()
        assert_refused(*serve(ABSENT, "--uds", socket_path), f"unix:{socket_path} is already in use")
    assert socket_path.is_socket()  # left behind by a server that is gone: taken over
    from meshlm.http.app import bind_unix

    with bind_unix(socket_path) as sock:
        assert sock.getsockname() == str(socket_path)
    assert_refused(*serve(ABSENT, "--uds", socket_path.parent / "no-such-folder" / "s"), "cannot listen on unix:")


# ---------------------------------------------------------------------------------------------------
# Memory: the pool and the slots are checked against what is free before they are allocated


@pytest.fixture(scope="module")
def lm(hf_tiny, neox_style_tokenizer):
    return meshlm.load(hf_tiny.path, tokenizer=neox_style_tokenizer)


def test_a_kv_pool_larger_than_the_memory_is_refused_before_it_is_allocated(
    serve: Serve, hf_tiny, neox_style_tokenizer
):
    """10^12 tokens would be ~1 PB of keys and values (and a host list of 6 * 10^10 pages)."""
    code, err = serve(hf_tiny.path, "--tokenizer", neox_style_tokenizer, "--port", 0, "--kv-tokens", 10**12)
    assert_refused(code, err, "1,000,000,000,000 KV tokens", "GiB are free", "lower kv_tokens or max_batch")


def test_a_batch_whose_slots_alone_do_not_fit_is_refused(lm):
    """The default pool is a share of what the slots leave; 2^30 rows' slots (a [rows, vocab] mask, the
    logits of a step) exceed any host."""
    with pytest.raises(OutOfMemory, match=r"1073741824 rows .* need .* GiB are free: lower max_batch$"):
        lm.engine(max_batch=2**30)


def test_the_default_pool_takes_a_share_of_the_free_memory_not_of_the_physical(lm, monkeypatch):
    """What other processes hold is not free: 64 MiB free means a pool of at most 80% of 64 MiB, however many
    full rows `max_batch` asks for, and the rows that do not fit it are refused."""
    free = 64 << 20
    monkeypatch.setattr(runner, "free_memory", lambda device: free)
    engine = lm.engine(max_batch=1024)
    pool = engine.runner.n_pages * engine.page_size * engine.kv_bytes_per_token()
    assert 0 < pool <= runner.KV_MEMORY_FRACTION * free
    with pytest.raises(OutOfMemory, match="lower max_batch$"):
        lm.engine(max_batch=2**17)  # its [rows, vocab] logits alone take 256 MiB


@pytest.mark.slow
def test_a_compiled_step_larger_than_the_free_memory_is_refused_before_it_runs(lm, monkeypatch):
    engine = lm.engine(max_batch=1, max_len=16, kv_tokens=16)
    monkeypatch.setattr(runner, "free_memory", lambda device: 1024)
    with pytest.raises(OutOfMemory, match="a compiled step needs .* working memory .* but 0.00 GiB are free"):
        engine.warm_up()
    assert engine.snapshot().compiled_shapes == 0


# ---------------------------------------------------------------------------------------------------
# Stopping: requests in flight are answered, the engine's thread may outlive the event loop


def test_a_row_changed_after_the_event_loop_closed_wakes_nobody_quietly(lm):
    """At shutdown the engine's thread can finish a step after uvicorn's loop has closed ("Event loop is
    closed" was printed with a traceback)."""

    engine = lm.engine(max_batch=1, max_len=16, kv_tokens=16)

    async def make_group():
        group = Group(engine)
        group.add([[1, 2, 3]], [lm.sampling(max_new_tokens=2)], lm.tokenizer)
        return group

    group = asyncio.run(make_group())
    group.rows[0].notify()  # the loop is closed now


def test_a_stopping_server_answers_its_requests_in_flight_with_503(lm):
    """Requests waiting on the engine when the server stops are answered at once (a stream with an error
    event), not cancelled mid-way with a traceback; new ones are refused."""
    from fastapi.testclient import TestClient

    engine = lm.engine(max_batch=2, max_len=32, kv_tokens=64)  # not started: rows stay queued
    app = create_app(lm, engine, "tiny")
    body = {"prompt": "Hello", "max_tokens": 4}
    answers: dict[str, httpx.Response] = {}
    with TestClient(app) as http:

        def ask(kind: str) -> None:
            answers[kind] = http.post("/v1/completions", json={**body, "stream": kind == "stream"})

        threads = [threading.Thread(target=ask, args=(kind,)) for kind in ("plain", "stream")]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while engine.snapshot().queued < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        http.portal.call(app.state.stop)
        for t in threads:
            t.join(timeout=30)
        late = http.post("/v1/completions", json=body)
    assert answers["plain"].status_code == 503 and "shutting down" in answers["plain"].json()["error"]["message"]
    events = answers["stream"].text.split("\n\n")
    assert "shutting down" in events[-3] and events[-2] == "data: [DONE]", events
    assert late.status_code == 503


# ---------------------------------------------------------------------------------------------------
# The real process: the listening line, Ctrl-C while compiling and while serving


def start(checkpoint: Path, tokenizer: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "meshlm", "serve", str(checkpoint), "--tokenizer", str(tokenizer), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def interrupt(proc: subprocess.Popen) -> str:
    """Ctrl-C; the process's whole output, once it has ended with 130 and one line."""
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 130, out
    assert out.endswith("meshlm serve: stopped by signal 2 (Ctrl-C)\n") and "Traceback" not in out, out
    assert "Exception ignored" not in out and "ERROR" not in out, out
    return out


def test_ctrl_c_while_compiling_ends_at_once(hf_tiny, neox_style_tokenizer):
    proc = start(hf_tiny.path, neox_style_tokenizer, "--port", "0", "--max-len", "96", "--max-batch", "16")
    assert "compiling" in proc.stdout.readline()
    assert "compiled" not in interrupt(proc)


@pytest.mark.slow
def test_port_0_listens_on_a_free_port_it_names_and_ctrl_c_ends_serving(hf_tiny, neox_style_tokenizer):
    proc = start(hf_tiny.path, neox_style_tokenizer, "--port", "0", "--max-len", "16", "--max-batch", "1")
    lines = [proc.stdout.readline() for _ in range(3)]
    assert " on http://127.0.0.1:" in lines[-1], lines
    port = int(lines[-1].rsplit(":", 1)[1])
    assert port and httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok"
    interrupt(proc)


@pytest.mark.slow
def test_serving_on_a_unix_socket_answers_openais_client_and_removes_the_socket(
    hf_tiny, neox_style_tokenizer, socket_path
):
    """Issue 38: a host that forbids TCP is served over a unix socket (--uds), which the openai SDK reaches
    through an httpx transport; the socket file goes when the server stops."""
    from openai import OpenAI

    proc = start(hf_tiny.path, neox_style_tokenizer, "--uds", socket_path, "--max-len", "32", "--max-batch", "2")
    lines = [proc.stdout.readline() for _ in range(3)]
    assert lines[-1].rstrip().endswith(f" on unix:{socket_path}"), lines
    transport = httpx.HTTPTransport(uds=str(socket_path))
    with httpx.Client(transport=transport, base_url="http://meshlm") as http_client:
        assert http_client.get("/health").json()["status"] == "ok"
        client = OpenAI(base_url="http://meshlm/v1", api_key="none", http_client=http_client)
        model = client.models.list().data[0].id
        whole = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0)
        assert whole.usage.completion_tokens == 6
        pieces = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0, stream=True)
        assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    interrupt(proc)
    assert not socket_path.exists()


# ---------------------------------------------------------------------------------------------------
# Issue 42, in process: the app over an engine of the tiny model

# ChatML, with an assistant's tool calls written from their parsed arguments, and a tool answer's call id
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'tool' %} [{{ m['tool_call_id'] }}]{% endif %}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},  # as the openai SDK's agent loop sends it back
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def http(lm):
    """The app over a running engine of the tiny model, with TOOL_TEMPLATE; adapters are not loadable."""
    from fastapi.testclient import TestClient

    from meshlm.chat import ChatTemplate

    engine = lm.engine(max_batch=2, max_len=128, kv_tokens=256)
    engine.start(chunk=4)
    app = create_app(lm, engine, "tiny", chat_template=ChatTemplate(TOOL_TEMPLATE, lm.tokenizer.special_tokens),
                     max_request_bytes=4096)  # fmt: skip
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client
    finally:
        engine.stop()


@pytest.mark.slow  # compiles an engine's programs (over 8 s on a 2-core machine)
def test_a_tool_calling_turn_renders_as_transformers_renders_it(http, neox_style_tokenizer):
    """The assistant's tool calls (content null) and the tool's answer reach the template as transformers'
    apply_chat_template takes them: arguments as an object (vLLM parses OpenAI's JSON text the same way)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(neox_style_tokenizer))
    parsed = json.loads(json.dumps(TOOL_TURNS))
    parsed[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = hf.apply_chat_template(parsed, chat_template=TOOL_TEMPLATE, tokenize=True, add_generation_prompt=True)
    if isinstance(want, dict) or hasattr(want, "keys"):
        want = want["input_ids"]
    r = http.post("/tokenize", json={"messages": TOOL_TURNS})
    assert r.status_code == 200 and r.json()["tokens"] == list(want), r.text
    assert '<call>weather {"city": "Paris"}</call>' in hf.decode(r.json()["tokens"])
    r = http.post("/v1/chat/completions", json={"messages": TOOL_TURNS, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"tools": 5}, "tools"),
        ({"documents": "x"}, "documents"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_chat_template_kwargs_the_server_sets_are_400_naming_the_key(http, route, kwargs, key):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    r = http.post(route, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and f"chat_template_kwargs.{key}" in error["message"], r.text
    assert error["param"] == "chat_template_kwargs"


def test_a_template_failing_on_a_value_is_400_not_500(http):
    """A template's own runtime error (here iterating a tool's name, a number) is the request's fault."""
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}, "id": 5}]}]}  # fmt: skip
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text  # the shapes OpenAI allows render
    bad = {**body, "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": 5}]}
    r = http.post("/tokenize", json=bad)
    assert r.status_code == 400 and "messages[1].content" in r.json()["error"]["message"], r.text


def test_a_body_over_max_request_bytes_is_413_before_it_is_read(http):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413 and "4,096 bytes" in r.json()["error"]["message"], r.text
    chunked = http.post("/tokenize", content=iter([json.dumps(big).encode()[:3000], b" " * 3000]),
                        headers={"content-type": "application/json"})  # fmt: skip
    assert chunked.status_code == 413, chunked.text
    assert http.post("/tokenize", json={"prompt": "x" * 100}).status_code == 200


@pytest.mark.slow  # compiles an engine's programs (over 8 s on a 2-core machine)
def test_prompts_are_tokenized_off_the_event_loop(http, lm, monkeypatch):
    """A long prompt's tokenizing never holds the event loop (and so /health) up."""
    import threading

    loop_thread = http.portal.call(threading.current_thread)
    seen = []
    encode, encode_prompt = lm.tokenizer.encode, lm.encode_prompt
    monkeypatch.setattr(lm.tokenizer, "encode", lambda *a, **k: seen.append(threading.current_thread()) or
                        encode(*a, **k))  # fmt: skip
    monkeypatch.setattr(lm, "encode_prompt", lambda *a, **k: seen.append(threading.current_thread()) or
                        encode_prompt(*a, **k))  # fmt: skip
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1}).status_code == 200
    assert http.post("/tokenize", json={"prompt": "Hello"}).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": TOOL_TURNS[:1], "max_tokens": 1}).status_code == 200
    assert len(seen) >= 3 and loop_thread not in seen, (loop_thread, seen)


@pytest.mark.parametrize("seed", [2**63, 2**70, -(2**63) - 1])
def test_a_seed_outside_64_bits_is_400_naming_it(http, seed):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_seeds_past_32_bits_key_their_draws_whole():
    """2^32 and 0, 2^70 and 2^63 drew alike when a seed was cut to its low 32 bits."""
    from meshlm.serve.batch import seed_word

    assert seed_word(7) == 7 and seed_word(2**32 - 1) == 2**32 - 1
    words = [seed_word(s) for s in (0, 2**32, 2**63, 2**70, -1, 2**63 - 1)]
    assert len(set(words)) == len(words) and all(0 <= w < 2**32 for w in words)


def test_runtime_adapter_loading_is_off_unless_allowed(http):
    """As vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: the routes are not there."""
    for route, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"}),
                        ("/v1/unload_lora_adapter", {"lora_name": "x"})):  # fmt: skip
        r = http.post(route, json=body)
        assert r.status_code == 404 and "--allow-runtime-adapters" in r.json()["error"]["message"], r.text


def test_an_unexpected_error_is_a_json_500_in_openais_shape(lm):
    from fastapi.testclient import TestClient

    app = create_app(lm, lm.engine(max_batch=1, max_len=16, kv_tokens=16), "tiny")

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom, methods=["GET"])
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/boom")
    error = {"message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": None}
    assert r.status_code == 500 and r.json()["error"] == error


BAD_CONFIGS = {
    "a-list": [],
    "rank-0": {"r": 0},
    "rank-text": {"r": "8"},
    "bad-regex": {"rank_pattern": {"(": 4}},
    "pattern-list": {"rank_pattern": [4]},
}


@pytest.fixture(scope="module")
def adapter_tree(hf_tiny, tmp_path_factory) -> dict[str, Path]:
    """An adapter root with a good adapter, malformed ones, a folder and a file that are no adapters and a
    link out of the root; and a good adapter outside the root."""
    from tests.helpers.lora import peft_model

    base = tmp_path_factory.mktemp("adapter-tree")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    peft_model(hf_tiny.path, "gptj", r=4).save_pretrained(root / "good")
    peft_model(hf_tiny.path, "gptj", r=4).save_pretrained(outside)
    config = json.loads((root / "good" / "adapter_config.json").read_text())
    weights = (root / "good" / "adapter_model.safetensors").read_bytes()
    for name, bad in BAD_CONFIGS.items():
        (root / name).mkdir()
        (root / name / "adapter_model.safetensors").write_bytes(weights)
        (root / name / "adapter_config.json").write_text(json.dumps({**config, **bad} if bad else bad))
    (root / "empty").mkdir()
    (root / "file.txt").write_text("x")
    (root / "link-out").symlink_to(outside)
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
def adapters_http(lm, adapter_tree):
    from fastapi.testclient import TestClient

    engine = lm.engine(max_batch=1, max_len=16, kv_tokens=16, max_adapters=1, max_lora_rank=4)
    app = create_app(lm, engine, "tiny", adapter_roots=[adapter_tree["root"]])
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_runtime_adapters_load_from_under_the_roots_and_every_refused_path_reads_alike(adapters_http, adapter_tree):
    root, outside = adapter_tree["root"], adapter_tree["outside"]
    refused = [outside, root / "link-out", root / ".." / "outside", root / "missing", root / "empty",
               root / "file.txt", "/etc", "/no/such/path", "relative/path", "bad\x00path", root.parent]  # fmt: skip
    answers = {adapters_http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(p)}).text
               for p in refused}  # fmt: skip
    assert len(answers) == 1, answers
    (answer,) = answers
    assert json.loads(answer)["error"]["message"] == REFUSED_ADAPTER_PATH
    r = adapters_http.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(root / "good")})
    assert r.status_code == 200, r.text
    assert adapters_http.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200


@pytest.mark.parametrize("name, words", [("a-list", "must be a JSON object, got list"), ("rank-0", "r is 0"),
                                         ("rank-text", "r is '8'"), ("bad-regex", "rank_pattern key '('"),
                                         ("pattern-list", "rank_pattern is list")])  # fmt: skip
def test_a_malformed_adapter_config_is_a_400_naming_it(adapters_http, adapter_tree, name, words):
    body = {"lora_name": name, "lora_path": str(adapter_tree["root"] / name)}
    r = adapters_http.post("/v1/load_lora_adapter", json=body)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "adapter_config.json" in message and words in message, r.text
    assert "\n" not in message


@pytest.mark.parametrize("name", ["a-list", "bad-regex"])
def test_a_malformed_adapter_config_is_one_line_at_start_up(serve: Serve, hf_tiny, neox_style_tokenizer,
                                                           adapter_tree, name):  # fmt: skip
    code, err = serve(hf_tiny.path, "--tokenizer", neox_style_tokenizer, "--port", 0,
                      "--adapter", f"bad={adapter_tree['root'] / name}")  # fmt: skip
    assert_refused(code, err, "adapter_config.json")
