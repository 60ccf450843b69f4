"""Decode on an fsdp mesh with the weights laid out by the training rules (today's layout before the
serving set) against the serving rules (`meshlm.sharding.TRAINING` vs `SERVING`).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python benchmarks/serve_rules.py [--mesh data=2,fsdp=4 --rows 8 --new 32 --repeats 5]

One random model (`--d-model` 256, `--layers` 4, heads of 64, `--vocab` 16384), laid out for training, and
two engines made from it, one per rule set, in the same process. For each: the weights' bytes on one
device, the all-gathers in its compiled decode program (XLA's HLO text after optimisation: those of
weights, and the rest, which gather rows' state split over the batch axes, counted apart) and greedy
decode throughput: `--rows` prompts of 8 tokens, `--new` tokens each, tokens/s over the whole
`generate` (prefill included; one warm-up call first), best of `--repeats`, the two sides alternating.
The 1-minute load average is printed before and after: other work on the machine slows both sides.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import jax
import numpy as np

import meshlm
from meshlm import model, sharding
from meshlm.serve import runner
from meshlm.serve.engine import Engine
from meshlm.serve.params import SamplingParams

ALL_GATHER = re.compile(r"= \(?\w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(")


def decode_all_gathers(engine: Engine) -> tuple[int, int]:
    """All-gather instructions in the engine's compiled decode program for all its rows: (of weights, of
    anything else). A gather is a weight's when its result has the shape of a weight or of one layer's slice
    of one; the others gather the rows' state (split over the batch axes) and the new keys and values."""
    r = engine.runner
    lowered = runner.lower(
        "decode",
        r.cfg,
        r.policy,
        r.mesh,
        rows=r.max_batch,
        pages=r.n_pages,
        width=r.shapes.max_pages,
        params=r.params,
        page_size=r.page_size,
    )
    shapes = {s for w in jax.tree.leaves(r.params) for s in (w.shape, w.shape[1:])}
    gathered = [tuple(int(d) for d in dims.split(",") if d) for dims in ALL_GATHER.findall(lowered.compile().as_text())]
    weights = sum(shape in shapes for shape in gathered)
    return weights, len(gathered) - weights


def tokens_per_second(engine: Engine, prompts: list[list[int]], new: int) -> float:
    greedy = [SamplingParams(max_new_tokens=new, temperature=0.0)] * len(prompts)
    began = time.perf_counter()
    out = engine.generate(prompts, greedy)
    seconds = time.perf_counter() - began
    return sum(len(c.tokens) for c in out) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", default="data=2,fsdp=4")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    print(f"load average (1 min) before: {os.getloadavg()[0]:.2f}", flush=True)
    cfg = meshlm.ModelConfig(
        n_layer=args.layers, d_model=args.d_model, n_head=args.d_model // 64, d_ff=4 * args.d_model,
        rotary_dim=32, vocab_size=args.vocab, n_vocab_used=args.vocab, max_seq_len=128,
    )  # fmt: skip
    lm = meshlm.from_config(cfg, mesh=args.mesh)
    print(f"{model.count_params(cfg):,} parameters on {sharding.describe(lm.mesh)}", flush=True)
    sides = {"training rules": sharding.TRAINING, "serving rules": sharding.SERVING}
    options = dict(max_batch=args.rows, max_len=64, kv_tokens=args.rows * 64)
    engines = {name: lm.engine(rules=rules, **options) for name, rules in sides.items()}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, 8).tolist() for _ in range(args.rows)]

    for name, engine in engines.items():
        weights = sharding.shard_bytes(engine.runner.params)
        of_weights, others = decode_all_gathers(engine)
        print(
            f"{name}: weights {weights / 2**20:.2f} MiB per device; the decode program's all-gathers: "
            f"{of_weights + others} ({of_weights} of weights, {others} of rows' state and new keys/values)",
            flush=True,
        )
        tokens_per_second(engine, prompts, args.new)  # compiles the shapes it uses

    best = {name: 0.0 for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            best[name] = max(best[name], tokens_per_second(engine, prompts, args.new))
    for name, rate in best.items():
        print(f"{name}: {rate:,.0f} tokens/s (best of {args.repeats}; {args.rows} rows x {args.new} tokens)")
    print(f"serving / training: {best['serving rules'] / best['training rules']:.2f}x")
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
