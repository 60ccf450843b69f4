"""Speculative decoding at batch 1: plain decoding against prompt lookup and a draft model, and what bounds them.

    PYTHONPATH=. python benchmarks/speculative.py [CHECKPOINT] [--draft DRAFT] [--d-model 256 --layers 4]
                                                  [--new-tokens 256 --speculate 4 --repeats 3]

Without CHECKPOINT a random GPT-J (`--d-model`, `--layers`, vocab 50400) is written to a temporary folder;
without `--draft` the model is its own draft, which keeps every proposal but costs as much as the model:
it shows the engine's overhead at full acceptance, not a useful speed-up. One greedy row of
`--new-tokens` after a 64-token prompt, best of `--repeats`, compiling excluded:

1. decode tokens/s: plain (chunks of 16 steps per device call), prompt lookup (`ngram=3`) and the draft,
   with each one's acceptance rate;
2. the bound: the time of one forward pass over k + 1 tokens (a verification) against one over 1 token
   (a plain step), and the speed-up a free draft that is always right would give, (k + 1) / that ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import meshlm
from benchmarks.serve import write_random_model
from meshlm import model
from meshlm.generate import SamplingParams


def decode_speed(lm, prompt: list[int], new_tokens: int, repeats: int, **options) -> tuple[float, float]:
    """Best tokens/s of one greedy row, and the share of proposals kept."""
    engine = lm.engine(max_batch=1, max_len=len(prompt) + new_tokens + 64, **options)
    engine.warm_up()
    params = [SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_token_ids=())]
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        (done,) = engine.generate([prompt], params, chunk=16)
        best = max(best, len(done.tokens) / (time.perf_counter() - t0))
    return best, engine.snapshot().accepted / max(engine.snapshot().proposed, 1)


def forward_ms(lm, tokens: int, repeats: int = 50) -> float:
    """Milliseconds of one paged forward pass over `tokens` new tokens of one row, 128 cached."""
    cfg = lm.config
    cache = model.init_cache(cfg, 16, 16, lm.policy.compute_dtype)
    step = jax.jit(lambda p, c, t, table, n: model.decode(p, t, c, table, n, cfg, lm.policy)[0])
    args = (jnp.zeros((1, tokens), jnp.int32), jnp.arange(1, 16, dtype=jnp.int32)[None], jnp.full(1, 128, jnp.int32))
    jax.block_until_ready(step(lm.params, cache, *args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = step(lm.params, cache, *args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / repeats * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", default=None)
    ap.add_argument("--draft", default=None, help="a draft model's checkpoint (default: the model itself)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--speculate", type=int, default=4, help="tokens proposed per step (k)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        if args.checkpoint is None:
            write_random_model(folder, args.d_model, args.layers)
        lm = meshlm.load(args.checkpoint or folder)
        draft = meshlm.load(args.draft, mesh=lm.mesh) if args.draft else lm
        prompt = np.random.default_rng(4).integers(1, lm.config.n_vocab_used, 64).tolist()
        run = lambda **options: decode_speed(lm, prompt, args.new_tokens, args.repeats, **options)
        plain, _ = run()
        ngram, ngram_kept = run(ngram=3, speculate=args.speculate)
        drafted, draft_kept = run(draft=draft, speculate=args.speculate)
        one, verify = forward_ms(lm, 1), forward_ms(lm, args.speculate + 1)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"model: {lm}; draft: {'the model itself' if draft is lm else draft}")
    print(f"batch 1, greedy, {args.new_tokens} new tokens, k = {args.speculate}, best of {args.repeats}:")
    print(f"  plain decoding     {plain:7.1f} tokens/s")
    print(f"  prompt lookup      {ngram:7.1f} tokens/s ({ngram / plain:.2f}x), {ngram_kept:.0%} of proposals kept")
    print(f"  draft model        {drafted:7.1f} tokens/s ({drafted / plain:.2f}x), {draft_kept:.0%} of proposals kept")
    ratio, k = verify / one, args.speculate
    print(f"a forward pass over {k + 1} tokens takes {verify:.2f} ms, over 1 token {one:.2f} ms: {ratio:.2f}x; "
          f"a free draft that is always right would give {(k + 1) / ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
