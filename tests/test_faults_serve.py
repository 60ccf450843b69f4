"""`meshlm serve` faults: impossible settings and a port that cannot be had are refused in one line before
the model loads; a KV pool or batch the memory cannot hold is refused before it is allocated; the listening
line comes once the port is really listening; and every way out (an error, Ctrl-C while loading, compiling
or serving with requests in flight) is one line and no traceback, exit 1 or 130."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import meshlm
from meshlm import cli, runner
from meshlm.footprint import OutOfMemory
from meshlm.server import Group, create_app

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
    ],
)
def test_impossible_settings_are_refused_before_the_model_loads(serve: Serve, args: list[str], words: list[str]):
    assert_refused(*serve(ABSENT, *args), *words)


def test_a_port_in_use_is_refused_before_the_model_loads(serve: Serve, taken_port: int):
    assert_refused(*serve(ABSENT, "--port", taken_port), f"127.0.0.1:{taken_port} is already in use")


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


def test_port_0_listens_on_a_free_port_it_names_and_ctrl_c_ends_serving(hf_tiny, neox_style_tokenizer):
    proc = start(hf_tiny.path, neox_style_tokenizer, "--port", "0", "--max-len", "16", "--max-batch", "1")
    lines = [proc.stdout.readline() for _ in range(3)]
    assert " on http://127.0.0.1:" in lines[-1], lines
    port = int(lines[-1].rsplit(":", 1)[1])
    assert port and httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok"
    interrupt(proc)
