"""Does a decode step's cost grow with its rows? One greedy decode step over the paged KV pool, timed at
each row count, against the bandwidth roofline measured in the same run.

A decode step reads every weight once and each row's cached keys and values once, so until the chip is
compute-bound it should cost about the same at 1 row as at 16 or 64 (issue 38). Each row holds
`--context` tokens in its own pages (of a pool sized for `--context + 2 * --steps` slots a row, as in
`benchmarks/gpu.py`), and `--steps` greedy steps are timed, one program call each with the pool donated, as
the engine's runner calls its step (a device-side loop of steps would carry the pool through a while loop,
whose layout XLA may choose apart from the paged kernel's, copying the pool in every layer).
The roofline is (weight bytes + the KV bytes the rows hold) / the GB/s of a large array copy timed here;
on a TPU with a bfloat16 pool the attention reads the pages in place (the paged kernel), elsewhere it
gathers the rows' pages (see `meshlm.attention.resolve`). Best of `--repeats` calls per row count.

`--new N` runs N tokens a row a step instead of one: a prefill chunk's step (the same chunk again each
step, written as whole pages after `--context` tokens, as the engine writes its chunks). Its `compute` column
is the projections' FLOPs (2 x the layers' weights a token, and the LM head for each row's last token;
attention left out) over a bfloat16 matmul's FLOP/s timed here. A decode step bound by reading its weights
leaves the matrix unit idle: how many tokens a step takes before it costs more than one says how many prompt
tokens a decode step could carry for nothing (issue 38).

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/decode_rows.py --preset gptj-tiny --rows 1,4,16
    PYTHONPATH=. python benchmarks/decode_rows.py --preset gptj-1b --rows 1,16,64      # on a TPU
    PYTHONPATH=. python benchmarks/decode_rows.py --preset gptj-6b --quantize int8 --kv-cache-dtype int8 \
        --rows 1 --new 1,16,64,128,256 --context 128                                 # on a TPU
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

import meshlm
from meshlm import config, kv_cache, model
from meshlm.attention import resolve
from meshlm.serve.config import EngineConfig


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def best_of(fn: Any, repeats: int) -> float:
    """The fastest of `repeats` calls (seconds), after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def copy_gbs(megabytes: int, repeats: int) -> float:
    """Achievable device memory bandwidth: bytes read plus written by copying a large array, per second."""
    x = jnp.ones((megabytes << 20) // 4, jnp.float32)
    copy = jax.jit(lambda x: x + 1)  # one read and one write of every byte; a plain copy may be elided
    return 2 * x.nbytes / best_of(lambda: copy(x), repeats) / 1e9


def matmul_tflops(n: int, repeats: int) -> float:
    """Achievable bfloat16 matrix-unit throughput: an [n, n] x [n, n] product's FLOPs per second, in TFLOP/s."""
    a = jnp.ones((n, n), jnp.bfloat16)
    product = jax.jit(lambda a: a @ a)
    return 2 * n**3 / best_of(lambda: product(a), repeats) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gptj-tiny")
    parser.add_argument("--rows", default="1,4,16", help="comma-separated row counts")
    parser.add_argument("--context", default="512", help="tokens each row already holds (comma-separated: each)")
    parser.add_argument("--new", default="1", help="tokens a row runs a step (comma-separated: each; above 1: a chunk)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps (one program call each) per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row count (best kept)")
    parser.add_argument("--dtype", default="bfloat16", help="weights, compute and the pool")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the array whose copy gives the GB/s")
    parser.add_argument("--matmul", type=int, default=4096, help="side of the bfloat16 product that gives the FLOP/s")
    parser.add_argument("--quantize", choices=["int8"], default=None, help="the projections' weights stored in int8")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="auto: --dtype")
    parser.add_argument("--profile", default="", help="a folder for a profile of the last case's call")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default: the engine's)")
    args = parser.parse_args()
    args.page_size = EngineConfig(page_size=args.page_size).tokens_per_page(jax.default_backend())
    news = [int(n) for n in args.new.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    if max(news) > 1 and any(c % args.page_size for c in contexts):
        parser.error(f"--new above 1 writes whole pages: each --context must be a multiple of {args.page_size}")

    cfg = config.preset(args.preset)
    policy = config.Policy(param_dtype=args.dtype, compute_dtype=args.dtype, attention=args.attention)
    device = jax.devices()[0]
    pool_dtype = args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    kernel = resolve(
        phase="decode",
        kind="global",
        impl=args.attention,
        q_len=1,
        kv_len=max(contexts),
        heads=cfg.n_head,
        head_dim=cfg.d_head,
        dtype=pool_dtype,
    )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"jax {jax.__version__}; device {device.device_kind} ({device.platform}) x {jax.device_count()}")
    print(
        f"preset {args.preset}, {args.dtype}, weights {args.quantize or args.dtype}, pool {pool_dtype}, "
        f"context {args.context}, pages of {args.page_size}, {args.steps} steps timed, best of "
        f"{args.repeats}; decode attention (one token a row) {kernel.name}; load average before: {load}"
    )
    gbs = copy_gbs(args.copy_mb, args.repeats)
    print(f"copy: {gbs:.1f} GB/s (read + write of {args.copy_mb} MiB)")
    tflops = matmul_tflops(args.matmul, args.repeats) if max(news) > 1 else math.nan  # the compute column's
    if max(news) > 1:
        print(f"matmul: {tflops:.1f} TFLOP/s ({args.matmul} x {args.matmul} bfloat16)")

    params = meshlm.from_config(cfg, None, args.dtype, seed=0, quantize=args.quantize).params
    weight_bytes = tree_bytes(params)
    per_token = tree_bytes(jax.eval_shape(lambda: kv_cache.init_cache(cfg, 1, 1, pool_dtype)))  # K, V (and scales)
    shapes = model.param_shapes(cfg)
    layer_weights = sum(math.prod(shape) for name, shape in shapes.items() if name.startswith("layers."))
    head_weights = cfg.d_model * cfg.vocab_size

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params: model.Params, cache: kv_cache.KVCache, table: jax.Array, tokens: jax.Array, length: jax.Array):
        """One greedy step of tokens [rows, new], one program call, the pool donated: as the engine's runner calls
        it. A decode step (new 1) moves on a token; a chunk's runs again over the same whole pages."""
        new = tokens.shape[1]
        at = jnp.full(length.shape, new - 1)
        logits, cache = model.decode(params, tokens, cache, table, length, cfg, policy, at=at, whole_pages=new > 1)
        token = jnp.argmax(logits[:, -1, : cfg.n_vocab_used], -1).astype(jnp.int32)
        return cache, jnp.broadcast_to(token[:, None], tokens.shape), length + 1 if new == 1 else length

    def steps(params: model.Params, cache: kv_cache.KVCache, table: jax.Array, tokens: jax.Array, length: jax.Array):
        for _ in range(args.steps):
            cache, tokens, length = step(params, cache, table, tokens, length)
        return cache, tokens, length

    print(
        f"{'context':>7} {'rows':>5} {'new':>4} {'step ms':>9} {'x 1st':>6} {'tokens/s':>9} {'GB read':>8} "
        f"{'roofline':>9} {'compute':>8}"
    )
    firsts: dict[int, float] = {}  # each context's first step
    for context, rows, new in ((c, int(r), n) for c in contexts for r in args.rows.split(",") for n in news):
        per_row = -(-(context + max(2 * args.steps, new)) // args.page_size)
        table = 1 + jnp.arange(rows * per_row, dtype=jnp.int32).reshape(rows, per_row)  # page 0: padding
        state = [kv_cache.init_cache(cfg, rows * per_row + 1, args.page_size, pool_dtype)]
        start = jnp.full((rows,), context, jnp.int32)
        token = jnp.zeros((rows, new), jnp.int32)

        def call(
            state: list = state, table: jax.Array = table, start: jax.Array = start, token: jax.Array = token
        ) -> jax.Array:
            state[0], out, _ = steps(params, state[0], table, token, start)  # every call the same steps
            return out

        step_s = best_of(call, args.repeats) / args.steps
        if args.profile and (context, rows, new) == (contexts[-1], int(args.rows.split(",")[-1]), news[-1]):
            with jax.profiler.trace(args.profile):
                jax.block_until_ready(call())
        first = firsts.setdefault(context, step_s)
        held = context + args.steps / 2 if new == 1 else per_row * args.page_size  # a chunk reads its whole table
        read = weight_bytes + rows * held * per_token
        flops = 2 * (rows * new * layer_weights + rows * head_weights)
        bound = read / (gbs * 1e9), flops / (tflops * 1e12)  # seconds at the copy's GB/s, at the matmul's FLOP/s
        print(
            f"{context:>7} {rows:>5} {new:>4} {1e3 * step_s:>9.2f} {step_s / first:>6.2f} {rows * new / step_s:>9.0f} "
            f"{read / 1e9:>8.3f} {100 * bound[0] / step_s:>8.1f}% {100 * bound[1] / step_s:>7.1f}%"
        )


if __name__ == "__main__":
    main()
