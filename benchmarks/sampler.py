"""Sampling filters per decode step: top-k and top-p read off each row's 256 largest logits (today's
`filter_logits`) against the exact bisection filters they replace (32 masked passes over the vocabulary
each), on the same logits, in one run.

    python benchmarks/sampler.py [--rows 16 --vocab 50400 --repeats 20]

Settings: top-k 50 with top-p 0.9, top-p 0.95 alone, top-k 40 alone, all at temperature 0.8, on confident
rows (normal logits, standard deviation 6: a nucleus of about 10 tokens) and on uncertain ones (deviation 3:
a nucleus of 500-1,200 tokens, beyond the candidates, so top-p falls back to the bisection). Both sides keep
the same tokens (checked here too).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_time  # benchmarks/timing.py, beside this script

from meshlm import generate as gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50400)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    load = os.getloadavg()[0]

    temperature = jnp.full(args.rows, 0.8, jnp.float32)
    candidates = jax.jit(gen.filter_logits)

    @jax.jit
    def bisection(x: jax.Array, t: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
        return gen.top_p_filter(gen.top_k_filter(gen.apply_temperature(x, t), k), p)

    print(f"{args.rows} rows x {args.vocab} logits, jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"load {load:.2f} before")  # fmt: skip
    settings = (("top-k 50, top-p 0.9", 50, 0.9), ("top-p 0.95", 0, 0.95), ("top-k 40", 40, 1.0))
    for spread, std in (("confident", 6.0), ("uncertain", 3.0)):
        logits = jnp.asarray(np.random.default_rng(0).normal(0, std, (args.rows, args.vocab)).astype(np.float32))
        for name, k, p in settings:
            args_ = (logits, temperature, jnp.full(args.rows, k, jnp.int32), jnp.full(args.rows, p, jnp.float32))
            same = np.array_equal(np.isfinite(candidates(*args_)), np.isfinite(bisection(*args_)))
            new = best_time(lambda a=args_: jax.block_until_ready(candidates(*a)), args.repeats)
            old = best_time(lambda a=args_: jax.block_until_ready(bisection(*a)), args.repeats)
            print(f"{spread:>9} {name:>20}: candidates {new * 1e3:6.2f} ms, bisection {old * 1e3:6.2f} ms: "
                  f"{old / new:4.1f}x (same tokens kept: {same})")  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
