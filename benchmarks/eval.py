"""Loglikelihood requests/s: meshlm's lm-eval model vs lm-eval's own `hf` backend, same model, same requests.

A random GPT-J (a preset, e.g. gptj-tiny) is saved as a Hugging Face folder with a tokenizer.json; both
backends score the same LAMBADA/HellaSwag-like requests (contexts of 20-400 tokens, continuations of
1-12 tokens) through lm-eval's `loglikelihood`. Each backend runs the requests once to warm up
(meshlm compiles its few length buckets), then is timed.

    python benchmarks/eval.py --preset gptj-tiny --requests 512 --batch-size 16
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


WORDS = """the a of and to in is was he she it they river mountain city light ship storm house garden old new
morning evening bright dark quickly slowly walked opened built found carried across under over through before
after because while children keeper window stone water fire bread salt glass"""


def make_requests(n: int, seed: int) -> list:
    import numpy as np
    from lm_eval.api.instance import Instance

    rng = np.random.default_rng(seed)
    words = np.array(WORDS.split())
    requests = []
    for i in range(n):
        context = " ".join(rng.choice(words, int(rng.integers(15, 300))))
        continuation = " " + " ".join(rng.choice(words, int(rng.integers(1, 9))))
        requests.append(Instance("loglikelihood", doc={}, arguments=(context.capitalize(), continuation), idx=i))
    return requests


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gptj-tiny")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--mesh", default=None, help="meshlm mesh spec (default: one device)")
    args = parser.parse_args()

    import jax
    import torch
    from lm_eval.models.huggingface import HFLM

    import meshlm
    from meshlm import evaluate, tokenizer

    cfg = meshlm.preset(args.preset)
    requests = make_requests(args.requests, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        meshlm.from_config(cfg, seed=0).save(tmp, format="hf")
        tokenizer.save_hf_tokenizer(tmp)
        lm = evaluate.MeshLM(tmp, mesh=args.mesh, batch_size=args.batch_size)
        hf = HFLM(pretrained=tmp, device="cpu", batch_size=args.batch_size, dtype="float32")

        results = {}
        for name, backend in (("meshlm", lm), ("hf", hf)):
            first = timed(backend.loglikelihood, requests)
            again = timed(backend.loglikelihood, requests)
            results[name] = (first, again)

    mesh = lm.lm.mesh
    print(
        f"model {args.preset} ({meshlm.model.count_params(cfg):,} params, context {cfg.max_seq_len}), "
        f"{args.requests} loglikelihood "
        f"requests, batch {args.batch_size}; meshlm on {meshlm.sharding.describe(mesh)}, hf on torch "
        f"{torch.__version__} CPU ({torch.get_num_threads()} threads); jax {jax.__version__}"
    )
    for name, (first, again) in results.items():
        print(f"{name:>7}: {args.requests / again:8.1f} requests/s warm ({again:.2f}s); first pass {first:.2f}s")
    warm, first = (results["hf"][i] / results["meshlm"][i] for i in (1, 0))
    print(f"meshlm / hf: {warm:.2f}x warm, {first:.2f}x on the first pass (meshlm compiling)")


if __name__ == "__main__":
    main()
