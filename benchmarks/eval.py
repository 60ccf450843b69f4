"""Loglikelihood requests/s: meshlm's lm-eval model in-process, `meshlm serve` through lm-eval's own
`local-completions` client (prompt scoring: echo with logprobs), and lm-eval's `hf` backend; same model,
same requests.

A random GPT-J (a preset, e.g. gptj-tiny) is saved as a Hugging Face folder with a tokenizer.json; every
backend scores the same LAMBADA/HellaSwag-like requests (contexts of 20-400 tokens, continuations of
1-12 tokens) through lm-eval's `loglikelihood`. Each backend scores other requests of the same kind once
to warm up (meshlm compiles its few length buckets; the server compiled before it listened), then the
timed ones. With `--choices 4` each context has 4 continuations, as a multiple-choice task's requests do.

    python benchmarks/eval.py --preset gptj-tiny --requests 512 --batch-size 16 [--choices 4] [--no-server]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")


WORDS = """the a of and to in is was he she it they river mountain city light ship storm house garden old new
morning evening bright dark quickly slowly walked opened built found carried across under over through before
after because while children keeper window stone water fire bread salt glass"""


def make_requests(n: int, seed: int, choices: int = 1) -> list:
    """n requests: n / choices contexts, each with `choices` continuations (a multiple-choice task's shape)."""
    import numpy as np
    from lm_eval.api.instance import Instance

    rng = np.random.default_rng(seed)
    words = np.array(WORDS.split())
    requests = []
    for i in range(n):
        if i % choices == 0:
            context = " ".join(rng.choice(words, int(rng.integers(15, 300)))).capitalize()
        continuation = " " + " ".join(rng.choice(words, int(rng.integers(1, 9))))
        requests.append(Instance("loglikelihood", doc={}, arguments=(context, continuation), idx=i))
    return requests


@contextlib.contextmanager
def server(folder: str, batch_size: int, kv_tokens: int) -> Iterator[str]:
    """`meshlm serve` on a free local port, ready: its completions URL."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "meshlm", "serve", folder, "--port", str(port), "--max-batch", str(batch_size)]
    cmd += ["--model-name", "meshlm", "--kv-tokens", str(kv_tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError("meshlm serve exited before it listened")
            time.sleep(0.5)
        yield f"{url}/v1/completions"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gptj-tiny")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--choices", type=int, default=1, help="continuations per context (4: a multiple-choice task)")
    parser.add_argument("--kv-tokens", type=int, default=32768, help="the server's KV pool (its prefix cache)")
    parser.add_argument("--mesh", default=None, help="meshlm mesh spec (default: one device)")
    parser.add_argument("--no-server", action="store_true", help="skip `meshlm serve` (the in-process pair only)")
    args = parser.parse_args()

    import jax
    import torch
    from lm_eval.models.huggingface import HFLM

    import meshlm
    from meshlm import evaluate, tokenizer

    cfg = meshlm.preset(args.preset)
    # the warm-up pass scores other requests: the server's prefix cache must not hold the timed ones
    warm_up, requests = (make_requests(args.requests, seed, args.choices) for seed in (1, 0))
    with tempfile.TemporaryDirectory() as tmp:
        meshlm.from_config(cfg, seed=0).save(tmp, format="hf")
        tokenizer.save_hf_tokenizer(tmp)
        lm = evaluate.MeshLM(tmp, mesh=args.mesh, batch_size=args.batch_size)
        hf = HFLM(pretrained=tmp, device="cpu", batch_size=args.batch_size, dtype="float32")

        backends = [("meshlm", lm), ("hf", hf)]
        with contextlib.ExitStack() as stack:
            if not args.no_server:
                from lm_eval.models.openai_completions import LocalCompletionsAPI

                url = stack.enter_context(server(tmp, args.batch_size, args.kv_tokens))
                client = LocalCompletionsAPI(base_url=url, model="meshlm", tokenizer_backend="remote",
                                             batch_size=args.batch_size, max_length=cfg.max_seq_len)  # fmt: skip
                backends.append(("server", client))
            results = {}
            for name, backend in backends:
                first = timed(backend.loglikelihood, warm_up)
                again = timed(backend.loglikelihood, requests)
                results[name] = (first, again)

    mesh = lm.lm.mesh
    print(
        f"model {args.preset} ({meshlm.model.count_params(cfg):,} params, context {cfg.max_seq_len}), "
        f"{args.requests} loglikelihood requests ({args.choices} per context), batch {args.batch_size}; "
        f"meshlm on {meshlm.sharding.describe(mesh)}, hf on torch "
        f"{torch.__version__} CPU ({torch.get_num_threads()} threads); jax {jax.__version__}"
    )
    for name, (first, again) in results.items():
        print(f"{name:>7}: {args.requests / again:8.1f} requests/s warm ({again:.2f}s); first pass {first:.2f}s")
    warm, first = (results["hf"][i] / results["meshlm"][i] for i in (1, 0))
    print(f"meshlm / hf: {warm:.2f}x warm, {first:.2f}x on the first pass (meshlm compiling)")
    if "server" in results:
        served = results["server"][1]
        vs_meshlm, vs_hf = results["meshlm"][1] / served, results["hf"][1] / served
        print(f"server / meshlm in-process: {vs_meshlm:.2f}x; server / hf: {vs_hf:.2f}x")


if __name__ == "__main__":
    main()
