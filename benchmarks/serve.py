"""Serving benchmark: meshlm's engine against the engine before it and transformers' continuous batching.

    python benchmarks/serve.py [CHECKPOINT] [--requests 64 --rates 2 8 --time-limit 120 --repeats 1
                                --max-batch 32 --max-len 1280 --old-ref 900bac2 --skip old,transformers,prefix]

Without CHECKPOINT a random GPT-J (`--d-model` 256, `--layers` 4, heads of 64, vocab 50400, context
2048) is written to a temporary folder. Everything runs on loopback, in one run, on the same model
and the same requests:

1. **Mixed workload.** `--requests` requests whose prompt and output lengths are drawn from long-tailed
   (log-normal) distributions (seeded), sent with Poisson arrivals at each `--rates` (requests/s),
   streamed, to `meshlm serve` from this tree and from `--old-ref` (a git ref, default 900bac2, checked out
   into a temporary worktree: the engine with a dense `max_batch x max_len` cache). Throughput (generated
   tokens/s over the whole run), time to first token and latency (p50/p99), and new/old ratios.
2. **Cold burst.** The first thing each fresh server sees: 8 concurrent requests of assorted lengths;
   then a burst of the same lengths with other prompts, warm. Worst latency cold / warm.
3. **KV memory.** /health is sampled during the mixed workload: cache bytes held per live token (pages
   are whole, so slightly above 1 token's bytes), against the old engine's preallocation divided by the
   same live tokens.
4. **Prefix caching.** 8 requests sharing a 1,000-token prefix (distinct 16-token suffixes, 1 new token
   each), one after another, after one request has written the prefix: time to first token with prefix
   caching and with `--no-prefix-caching`.
5. **transformers.** The mixed workload's prompts all at once through `generate_batch` (transformers'
   continuous batching, CPU) and through meshlm's engine in this process: tokens/s, best of two.
(Speculative decoding at batch 1 has its own script: benchmarks/speculative.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_random_model(folder: str, d_model: int, layers: int) -> None:
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    heads = d_model // 64
    config = GPTJConfig(n_embd=d_model, n_layer=layers, n_head=heads, rotary_dim=32, vocab_size=50400,
                        n_positions=2048)  # fmt: skip
    GPTJForCausalLM(config).eval().save_pretrained(folder)


def workload(n: int, max_len: int, seed: int = 0, vocab: int = 50000) -> list[tuple[list[int], int]]:
    """(prompt tokens, max_tokens) pairs: log-normal lengths, median 48 prompt and 24 output tokens, long tails;
    tokens drawn from [1, vocab)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = int(np.clip(rng.lognormal(np.log(48), 1.0), 1, max_len // 2))
        new = int(np.clip(rng.lognormal(np.log(24), 0.8), 1, min(256, max_len - prompt)))
        out.append((rng.integers(1, vocab, prompt).tolist(), new))
    return out


class Server:
    """`meshlm serve` from a source tree, as its own process, on a free loopback port or on the unix socket
    `uds` (a host that forbids TCP)."""

    def __init__(self, checkpoint: str, source: Path, *args: str, uds: str | None = None):
        self.uds = uds
        self.url = "http://meshlm" if uds else f"http://127.0.0.1:{free_port()}"
        where = ["--uds", uds] if uds else ["--port", self.url.rsplit(":", 1)[1]]
        path = os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))  # the source tree first
        env = {**os.environ, "PYTHONPATH": path}
        cmd = [sys.executable, "-m", "meshlm", "serve", checkpoint, *where, *args]
        began = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.get("/health", timeout=1).status_code == 200:
                    self.start_seconds = time.perf_counter() - began
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.proc.kill()
        raise SystemExit(f"the server did not start:\n{self.proc.stdout.read()}")

    def get(self, path: str, timeout: float) -> httpx.Response:
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        with httpx.Client(transport=transport, timeout=timeout) as c:
            return c.get(f"{self.url}{path}")

    def client(self, timeout: float) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else None
        return httpx.AsyncClient(transport=transport, timeout=timeout)

    def health(self) -> dict:
        return self.get("/health", timeout=30).json()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


async def one(c: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """A streamed greedy completion: time to first token, latency and tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0}
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            n = len((choice.get("logprobs") or {}).get("tokens") or [])
            if n and first is None:
                first = time.perf_counter() - t0
            tokens += n
    latency = time.perf_counter() - t0
    return {"ttft": latency if first is None else first, "latency": latency, "tokens": tokens}


async def poisson(
    server: Server, requests: list[tuple[list[int], int]], rate: float, time_limit: float, samples: list[dict]
) -> dict[str, float]:
    """Send the requests with exponential gaps of mean 1/rate; sample /health while they run."""
    rng = np.random.default_rng(1)
    results: list[dict] = []
    start = time.perf_counter()

    async def watch() -> None:
        async with server.client(30) as c:
            while True:
                h = (await c.get(f"{server.url}/health")).json()
                if h.get("kv_live_tokens"):
                    samples.append(h)
                await asyncio.sleep(0.2)

    async with server.client(time_limit + 600) as c:
        watcher = asyncio.create_task(watch())
        tasks = []
        for prompt, new in requests:
            if time.perf_counter() - start > time_limit:
                break
            tasks.append(asyncio.create_task(one(c, server.url, prompt, new)))
            await asyncio.sleep(rng.exponential(1 / rate))
        results = await asyncio.gather(*tasks)
        watcher.cancel()
    elapsed = time.perf_counter() - start
    ttft = np.array([r["ttft"] for r in results])
    lat = np.array([r["latency"] for r in results])
    return {
        "requests": len(results),
        "tok_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
    }


async def burst(server: Server, max_len: int, seed: int) -> float:
    """The worst latency of 8 concurrent requests of assorted lengths (prompts drawn with `seed`: the warm
    burst sends new prompts, so prefix caching does not flatter it)."""
    rng = np.random.default_rng(seed)
    lengths = (3, 9, 17, 30, 60, 100, 200, 400)
    async with server.client(600) as c:
        results = await asyncio.gather(
            *(one(c, server.url, rng.integers(1, 50000, min(n, max_len - 16)).tolist(), 16) for n in lengths)
        )
    return max(r["latency"] for r in results)


async def shared_prefix(server: Server) -> float:
    """Mean time to first token of 8 requests sharing a 1,000-token prefix, after one has written it."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(1, 50000, 1000).tolist()
    async with server.client(600) as c:
        await one(c, server.url, prefix + rng.integers(1, 50000, 16).tolist(), 1)
        ttft = [(await one(c, server.url, prefix + rng.integers(1, 50000, 16).tolist(), 1))["ttft"] for _ in range(8)]
    return float(np.mean(ttft))


def offline(checkpoint: str, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    """Tokens/s of the whole workload at once: transformers' generate_batch and meshlm's engine, best of two."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import meshlm
    from meshlm.serve.params import SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    prompts = [p for p, _ in requests]
    total = sum(n for _, n in requests)
    best_hf = 0.0
    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=max(n for _, n in requests))
    for _ in range(2):  # each request with its own max_new_tokens, through generate_batch's own manager
        t0 = time.perf_counter()
        with hf.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
            for prompt, n in requests:
                manager.add_request(prompt, max_new_tokens=n)
            produced = finished = 0
            while finished < len(requests):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    finished += 1
                    produced += len(result.generated_tokens)
        best_hf = max(best_hf, produced / (time.perf_counter() - t0))
    lm = meshlm.load(checkpoint)
    engine = lm.engine(max_batch=32)
    params = [SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=()) for _, n in requests]
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        engine.generate(prompts, params, chunk=8)
        best = max(best, total / (time.perf_counter() - t0))
    return {"transformers": best_hf, "meshlm": best}


def worktree(ref: str, folder: str) -> Path:
    path = Path(folder) / "old"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True)  # fmt: skip
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=256, help="the random model's width (heads of 64)")
    ap.add_argument("--layers", type=int, default=4, help="the random model's depth")
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0], help="Poisson arrival rates, requests/s")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds of arrivals per rate at most")
    ap.add_argument("--repeats", type=int, default=1, help="mixed-workload runs per rate and engine; the best counts")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1280)
    ap.add_argument(
        "--old-ref",
        default="900bac2",
        help="git ref of the engine to compare with (default: the last commit before the paged engine)",
    )
    ap.add_argument("--skip", default="", help="comma-separated: old, transformers, prefix")
    ap.add_argument("--uds", metavar="PATH", help="serve on a unix socket (a host without TCP); skips the old engine")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(","))) | ({"old"} if args.uds else set())
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs", flush=True)

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = args.checkpoint or folder
        if args.checkpoint is None:
            write_random_model(folder, args.d_model, args.layers)
        requests = workload(args.requests, args.max_len)
        sizes = ["--max-batch", str(args.max_batch), "--max-len", str(args.max_len)]
        engines = {"new": REPO} if "old" in skip else {"new": REPO, "old": worktree(args.old_ref, folder)}
        mixed: dict[str, dict[float, dict]] = {}
        cold: dict[str, tuple[float, float]] = {}
        live: dict[str, list[dict]] = {}
        started: dict[str, float] = {}
        try:
            for name, source in engines.items():
                server = Server(checkpoint, source, *sizes, uds=args.uds)
                started[name] = server.start_seconds
                try:
                    cold[name] = tuple(asyncio.run(burst(server, args.max_len, seed)) for seed in (2, 3))
                    live[name] = []
                    mixed[name] = {}
                    for rate in args.rates:
                        runs = [asyncio.run(poisson(server, requests, rate, args.time_limit, live[name]))
                                for _ in range(args.repeats)]  # fmt: skip
                        mixed[name][rate] = max(runs, key=lambda r: r["tok_s"])
                    if name == "new":
                        bytes_per_token = server.health()["kv_bytes_per_token"]
                finally:
                    server.close()
            prefix = {}
            if "prefix" not in skip:
                for label, extra in (("on", []), ("off", ["--no-prefix-caching"])):
                    server = Server(checkpoint, REPO, "--max-batch", "2", "--max-len", "1152", *extra, uds=args.uds)
                    try:
                        prefix[label] = asyncio.run(shared_prefix(server))
                    finally:
                        server.close()
            off = offline(checkpoint, requests) if "transformers" not in skip else {}
        finally:
            if "old" in engines:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(engines["old"])])

    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"random GPT-J d_model {args.d_model}, {args.layers} layers; "
          f"server --max-batch {args.max_batch} --max-len {args.max_len}, {'unix socket' if args.uds else 'loopback'}; "
          f"mixed workload: best of {args.repeats} per rate")  # fmt: skip
    print("server start (compiling included): " + ", ".join(f"{k} {v:.0f} s" for k, v in started.items()))
    n_out = [n for _, n in requests]
    n_in = [len(p) for p, _ in requests]
    print(f"workload: {len(requests)} requests, prompt tokens median {np.median(n_in):.0f} max {max(n_in)}, "
          f"output tokens median {np.median(n_out):.0f} max {max(n_out)}")  # fmt: skip
    print(f"\n{'engine':>6} {'rate/s':>7} {'reqs':>5} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'p50 s':>7} {'p99 s':>7}")  # fmt: skip
    for name, by_rate in mixed.items():
        for rate, r in by_rate.items():
            print(f"{name:>6} {rate:>7.1f} {r['requests']:>5} {r['tok_s']:>9.1f} {r['ttft_p50']:>9.3f} "
                  f"{r['ttft_p99']:>9.3f} {r['p50']:>7.3f} {r['p99']:>7.3f}")  # fmt: skip
    if "old" in mixed:
        for rate in args.rates:
            print(f"throughput new/old at {rate:g}/s: {mixed['new'][rate]['tok_s'] / mixed['old'][rate]['tok_s']:.2f}x")
    for name, (c, w) in cold.items():
        print(f"cold burst ({name}): worst latency {c:.2f} s cold, {w:.2f} s warm: {c / w:.2f}x")
    samples = live["new"]
    if samples:
        held = np.mean([s["kv_tokens_used"] / s["kv_live_tokens"] for s in samples])
        mean_live = np.mean([s["kv_live_tokens"] for s in samples])
        print(f"KV memory (new): {held * bytes_per_token:.0f} bytes held per live token ({held:.2f} tokens' worth, "
              f"{len(samples)} samples, {mean_live:.0f} live tokens on average)")  # fmt: skip
        old_bytes = args.max_batch * args.max_len * bytes_per_token
        print(f"KV memory (old): {old_bytes / mean_live:.0f} bytes per live token (a dense {args.max_batch} x "
              f"{args.max_len} cache over the same live tokens)")  # fmt: skip
    if prefix:
        print(f"shared 1,000-token prefix, time to first token: {prefix['on']:.3f} s with prefix caching, "
              f"{prefix['off']:.3f} s without: {prefix['off'] / prefix['on']:.2f}x")  # fmt: skip
    if off:
        print(f"offline, whole workload at once: meshlm {off['meshlm']:.1f} tokens/s, transformers generate_batch "
              f"{off['transformers']:.1f} tokens/s: {off['meshlm'] / off['transformers']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
