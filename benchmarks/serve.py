"""Serving load test: `meshlm serve` on loopback under 1, 8 and 32 concurrent clients.

    python benchmarks/serve.py [CHECKPOINT] [--clients 1 8 32 --requests 64 --max-tokens 32 --time-limit 60]

Without CHECKPOINT a random GPT-J (d_model 256, 4 layers, vocab 50400) is written to a temporary
folder. The server runs as its own process with --max-batch 32; each client sends completions
back to back (greedy, `--max-tokens` tokens each) until `--requests` have been sent at that level
or `--time-limit` seconds have passed. Reports requests/s, tokens/s and p50/p99 latency per level,
and the throughput of each level relative to one client (what dynamic batching buys).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_random_model(folder: str) -> None:
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(n_embd=256, n_layer=4, n_head=4, rotary_dim=64, vocab_size=50400, n_positions=2048)
    GPTJForCausalLM(config).eval().save_pretrained(folder)


def start_server(checkpoint: str, max_batch: int, max_len: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo}
    cmd = [sys.executable, "-m", "meshlm", "serve", checkpoint, "--port", str(port), "--max-batch", str(max_batch)]
    if max_len:
        cmd += ["--max-len", str(max_len)]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


async def load(url: str, clients: int, requests: int, max_tokens: int, time_limit: float) -> dict[str, float]:
    """`clients` concurrent loops sending completions until `requests` are sent or time runs out."""
    latencies: list[float] = []
    tokens = 0
    sent = 0
    start = time.perf_counter()

    async def client(c: httpx.AsyncClient, index: int) -> None:
        nonlocal sent, tokens
        while sent < requests and time.perf_counter() - start < time_limit:
            sent += 1
            body = {"prompt": f"Request {sent} from client {index}:", "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            r = await c.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as c:
        await asyncio.gather(*(client(c, i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    lat = np.array(latencies)
    return {
        "requests": len(lat),
        "req_s": len(lat) / elapsed,
        "tok_s": tokens / elapsed,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", default=None)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64, help="requests per level at most")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per level at most")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=None, help="server --max-len (default: the model's context)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = args.checkpoint
        if checkpoint is None:
            write_random_model(folder)
            checkpoint = folder
        proc, url = start_server(checkpoint, args.max_batch, args.max_len)
        try:
            results = {}
            for n in args.clients:
                asyncio.run(load(url, n, 2 * n, args.max_tokens, args.time_limit))  # compile this level's shapes
                results[n] = asyncio.run(load(url, n, args.requests, args.max_tokens, args.time_limit))
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    print(
        f"\n{args.max_tokens} tokens per request, greedy, server --max-batch {args.max_batch} "
        f"--max-len {args.max_len or 'context'}, loopback"
    )
    print(f"{'clients':>8} {'requests':>9} {'req/s':>8} {'tokens/s':>9} {'p50 s':>7} {'p99 s':>7} {'vs 1 client':>12}")
    base = results[args.clients[0]]["req_s"]
    for n, r in results.items():
        print(
            f"{n:>8} {r['requests']:>9.0f} {r['req_s']:>8.2f} {r['tok_s']:>9.0f} {r['p50']:>7.3f} {r['p99']:>7.3f} "
            f"{r['req_s'] / base:>11.2f}x"
        )


if __name__ == "__main__":
    main()
