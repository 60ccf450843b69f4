"""The sampler per decode step, in one run on the same logits:

1. Sampling filters: top-k and top-p read off each row's 256 largest logits (today's `filter_logits`)
   against the exact bisection filters they replace (32 masked passes over the vocabulary each).
2. The whole choice of a token (`sampler.choose`: penalties, filters, the draw, logprobs) against the
   same function at an earlier revision (`--before`, its `meshlm/serve/sampler.py` read with `git show`):
   the two-level inverse-CDF draw against the Gumbel-max draw it replaced.

    python benchmarks/sampler.py [--rows 16 --vocab 50400 --repeats 20 --before 5074e56]

Settings: top-k 50 with top-p 0.9, top-p 0.95 alone, top-k 40 alone, all at temperature 0.8, on confident
rows (normal logits, standard deviation 6: a nucleus of about 10 tokens) and on uncertain ones (deviation 3:
a nucleus of 500-1,200 tokens, beyond the candidates, so top-p falls back to the bisection). Both sides keep
the same tokens (checked here too).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_time, best_times  # benchmarks/timing.py, beside this script

from meshlm.serve import batch
from meshlm.serve import sampler as gen
from meshlm.serve.params import SamplingParams


def sampler_at(revision: str) -> ModuleType:
    """meshlm/serve/sampler.py as it was at `revision`, imported as a module."""
    source = subprocess.run(["git", "show", f"{revision}:meshlm/serve/sampler.py"], capture_output=True, text=True,
                            check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout  # fmt: skip
    spec = importlib.util.spec_from_loader("sampler_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:meshlm/serve/sampler.py", "exec"), module.__dict__)
    return module


def choose_steps(rows: int, vocab: int, repeats: int, before: str) -> None:
    """Per-step cost of `choose` now and at `before`, for each kind of row a server sees."""
    old = sampler_at(before)
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 4, (rows, vocab)).astype(np.float32))
    seen = jnp.asarray(rng.random((rows, vocab)) < 0.01)
    counts = jnp.asarray((rng.random((rows, vocab)) < 0.005).astype(np.int32))
    count = jnp.full(rows, 8, jnp.int32)
    settings = {
        "greedy": dict(temperature=0.0),
        "temperature 0.8": dict(temperature=0.8),
        "top-p 0.9": dict(temperature=0.8, top_p=0.9),
        "penalties + bias": dict(
            temperature=0.8,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            repetition_penalty=1.1,
            logit_bias={5: 1.0, 9: -2.0},
        ),
    }
    for name, kw in settings.items():
        steps = {}
        params = [SamplingParams(**kw, seed=i) for i in range(rows)]
        s = jax.tree.map(jnp.asarray, batch.settings_for(params, rows))
        for side, module in (("now", gen), ("before", old)):
            step = jax.jit(lambda x, s, m=module: m.choose(x, seen, count, s, vocab, counts=counts)[0])
            steps[side] = lambda step=step, s=s: jax.block_until_ready(step(logits, s))
        t = best_times(steps, repeats)
        print(f"choose, {name:>16}: now {t['now'] * 1e3:6.2f} ms, before {t['before'] * 1e3:6.2f} ms: "
              f"{t['before'] / t['now']:4.2f}x")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50400)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--before", default="5074e56", help="the revision whose choose is the peer")
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
    choose_steps(args.rows, args.vocab, args.repeats, args.before)
    print(f"load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
