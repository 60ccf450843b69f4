"""`meshlm serve` as a real process."""

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str], start_within: float) -> Iterator[str]:
    """`meshlm serve ARGS --port P` as a real process, up once /health answers (else the test fails with its
    output): its URL. On exit it is stopped, and its output must hold no traceback."""
    port = free_port()
    cmd = [sys.executable, "-m", "meshlm", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_within
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{proc.stdout.read()}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    out = proc.stdout.read()
    assert "Traceback" not in out, out
