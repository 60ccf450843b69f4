"""A long prompt arriving while rows decode: how long it stalls them, prefilled whole or a chunk a step, with and
without mixed steps (a one-row prefill call and the rows' decode step in one pass over the weights).

    python benchmarks/prefill_stall.py --model gptj-tiny --rows 4 --prompt 448 --budgets 512,128,32        # a CPU
    python benchmarks/prefill_stall.py --model gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 15 \\
        --prompt 1792 --budgets 2048,512,256                                                             # a v5e

`--rows` rows of `--context` prompt tokens decode (greedy, `ignore_eos`) through `LanguageModel.engine`, stepped
`--chunk` tokens a step as a server's loop steps it. Once every row decodes, `--before` plain steps are timed; then
one prompt of `--prompt` tokens arrives, and the steps are timed until it has its first token. A running row waits
a whole engine step for its next tokens, so the longest such step is the stall the prompt causes. For each
`--prefill-tokens` budget (`--budgets`): that longest step against the plain step of the same run, how many steps
the prompt took, and its time to first token, for each `--mixed` setting ("off,on": both, in the same run). A
budget of at least the prompt's length prefills it whole, in one call (the baseline, in the same run); best of
`--repeats` after a first pass that compiles. Random weights made in
place (`meshlm.from_config`); the JAX version, the device and the load average are printed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import load_average


def scenario(lm: Any, engine: Any, args: argparse.Namespace, rng: Any) -> dict[str, float]:
    """One pass: rows decoding, `--before` plain steps, then the prompt's arrival until its first token."""
    vocab = lm.config.n_vocab_used
    params = lm.sampling(args.new, ignore_eos=True, temperature=0.0)
    rows = engine.add_requests([rng.integers(1, vocab, args.context).tolist() for _ in range(args.rows)],
                               [params] * args.rows)  # fmt: skip
    while min(len(r.output.tokens) for r in rows) == 0:
        engine.step(args.chunk)

    def timed() -> float:
        start = time.perf_counter()
        engine.step(args.chunk)
        return time.perf_counter() - start

    plain = min(timed() for _ in range(args.before))
    arrived = time.perf_counter()
    prompt = engine.add_request(rng.integers(1, vocab, args.prompt).tolist(), lm.sampling(1, temperature=0.0))
    steps = []
    while not prompt.output.tokens:
        steps.append(timed())
    ttft = time.perf_counter() - arrived
    if any(r.output.finished for r in rows):
        raise SystemExit("a running row finished while the prompt was prefilled")
    for r in rows:
        engine.abort(r.id)
    engine.step(args.chunk)  # frees their slots and pages
    return {"plain_ms": 1e3 * plain, "longest_ms": 1e3 * max(steps), "steps": len(steps), "ttft_s": ttft}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gptj-tiny", help="a preset (random weights made in place)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", default=None, help="int8, w8a8 or nf4 projections")
    p.add_argument("--kv-cache-dtype", default=None, help="int8, or the compute dtype when not given")
    p.add_argument("--rows", type=int, default=4, help="rows decoding when the prompt arrives")
    p.add_argument("--context", type=int, default=64, help="prompt tokens of each decoding row")
    p.add_argument("--prompt", type=int, default=448, help="tokens of the prompt that arrives")
    p.add_argument("--budgets", default="512,128,32", help="prefill_tokens values, comma-separated")
    p.add_argument("--chunk", type=int, default=4, help="decode steps a step")
    p.add_argument("--before", type=int, default=4, help="plain steps timed before the prompt arrives")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mixed", default="off,on", help="mixed_steps settings to run, comma-separated (off, on)")
    args = p.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    settings = [{"off": False, "on": True}[m] for m in args.mixed.split(",")]

    import jax
    import numpy as np

    import meshlm
    from meshlm.config import preset
    from meshlm.sharding import make_mesh

    device = jax.devices()[0]
    print(f"JAX {jax.__version__} on {device.device_kind} ({device.platform}); load average {load_average()}")
    lm = meshlm.from_config(preset(args.model), make_mesh(None), args.dtype, seed=0, quantize=args.quantize)
    # every row's budget holds the steps of the rows' own prefills, the plain ones and the prompt's (a chunk a step at
    # the least budget, 16 tokens a chunk at least)
    args.new = args.chunk * (args.before + 4 + args.rows + (args.prompt + args.rows * args.context) // 16)
    max_len = max(args.context + args.new, args.prompt + 1)
    out = []
    for budget in budgets:
        for mixed in settings:
            engine = lm.engine(max_batch=args.rows + 1, max_len=max_len, prefill_tokens=budget, prefix_caching=False,
                               kv_cache_dtype=args.kv_cache_dtype, mixed_steps=mixed)  # fmt: skip
            rng = np.random.default_rng(0)
            scenario(lm, engine, args, rng)  # compiles what the passes run
            runs = [scenario(lm, engine, args, rng) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["longest_ms"])
            best |= {key: min(r[key] for r in runs) for key in ("ttft_s", "plain_ms")}
            chunk = "whole" if args.prompt <= budget else engine.scheduler.prompt_chunk  # the scheduler's rule
            out.append({"budget": budget, "mixed": "on" if mixed else "off", "chunk": chunk, **best})
            del engine
            gc.collect()  # its pool, before the next engine's
    weights = args.dtype + (f", {args.quantize}" if args.quantize else "")
    weights += f", KV {args.kv_cache_dtype}" if args.kv_cache_dtype else ""
    print(f"\n{args.rows} rows decoding ({args.context}-token prompts, {args.chunk} tokens a step), a "
          f"{args.prompt}-token prompt arriving; {args.model} {weights}; best of {args.repeats}\n")  # fmt: skip
    print(
        "| prefill_tokens | mixed steps | prompt chunk | steps to its first token | plain step "
        "| longest step while it prefilled | longest / plain | its time to first token |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out:
        print(
            f"| {r['budget']} | {r['mixed']} | {r['chunk']} | {r['steps']} | {r['plain_ms']:.1f} ms | "
            f"{r['longest_ms']:.1f} ms | {r['longest_ms'] / r['plain_ms']:.2f}x | {r['ttft_s']:.3f} s |"
        )
    print(f"\nload average after: {load_average()}")
    return out


if __name__ == "__main__":
    main()
