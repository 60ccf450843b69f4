"""Where a serving engine's device time goes: requests arriving in-process, each device call timed.

    python benchmarks/engine_calls.py [CHECKPOINT] [--requests 64 --rate 32 --chunk 4 --max-batch 32 --max-len 1280]
    python benchmarks/engine_calls.py --preset gptj-6b --quantize int8 --kv-cache-dtype int8 --max-batch 16 \
        --max-len 512 --requests 128 --mixed off,on                                           # a v5e

`serve.py`'s mixed workload (log-normal prompt and output lengths) arrives with Poisson gaps into the
loop thread `Engine.start` runs, as a server's requests do, but without HTTP: a run after a warm-up run
(other prompts, so the prefix cache does not flatter it) times every prefill, decode, speculation and mixed call
and prints the calls by kind and shape (rows, prompt bucket or chunk, page-table width), with the
generated tokens per second, for each `--mixed` setting (`mixed_steps`: "off,on" runs both, one engine each, in
this process). Without CHECKPOINT, serve.py's random GPT-J (d_model 256, 4 layers), or `--preset`'s random weights
made in place (`meshlm.from_config`, quantized as they are made). The JAX version, the device and the load are
printed.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import meshlm
from benchmarks.serve import workload, write_random_model
from benchmarks.timing import load_average
from meshlm.serve.batch import Decode, Prefill, Speculate, Step
from meshlm.serve.engine import Engine
from meshlm.serve.params import SamplingParams


def arrivals(engine: Engine, requests: list[tuple[list[int], int]], rate: float) -> float:
    """Send the requests with exponential gaps of mean 1/rate; generated tokens per second until all finish."""
    rng = np.random.default_rng(1)
    began = time.perf_counter()
    rows = []
    for prompt, new in requests:
        sampling = SamplingParams(max_new_tokens=new, temperature=0, stop_token_ids=(), logprobs=0)
        rows.append(engine.add_request(prompt, sampling))
        time.sleep(rng.exponential(1 / rate))
    while not all(r.finished for r in rows):
        time.sleep(0.005)
    return sum(len(r.output.tokens) for r in rows) / (time.perf_counter() - began)


def size_of(batch: Prefill | Decode | Speculate) -> int:
    """A prefill's prompt bucket, a decode's chunk, a speculation's proposals per row."""
    if isinstance(batch, Prefill):
        return batch.tokens.shape[1]
    return batch.chunk if isinstance(batch, Decode) else batch.proposals.shape[1]


def measure(engine: Engine, args: argparse.Namespace) -> None:
    """Warm the engine up, run the warm-up arrivals and the timed ones, and print the timed run's calls."""
    shapes, seconds = engine.warm_up()
    print(f"\nmixed steps {'on' if engine.runner.mixing else 'off'}; warm-up: {shapes} shapes in {seconds:.0f} s")
    calls: list[tuple[str, tuple[int, ...], int, float]] = []
    run, run_mixed, rows = engine.runner.run, engine.runner.run_mixed, engine.runner.max_batch

    def timed(batch: Prefill | Decode | Speculate) -> Step:
        began = time.perf_counter()
        out = run(batch)
        calls.append((type(batch).__name__, (len(batch.slots), size_of(batch), batch.table.shape[1]),
                      int((batch.slots < rows).sum()), time.perf_counter() - began))  # fmt: skip
        return out

    def timed_mixed(prefill: Prefill, decode: Decode) -> tuple[Step, Step]:  # shaped as its prefill, live its decode's
        began = time.perf_counter()
        out = run_mixed(prefill, decode)
        calls.append(("Mixed", (len(prefill.slots), size_of(prefill), prefill.table.shape[1]),
                      int((decode.slots < rows).sum()), time.perf_counter() - began))  # fmt: skip
        return out

    engine.runner.run, engine.runner.run_mixed = timed, timed_mixed
    engine.start(chunk=args.chunk)
    try:
        arrivals(engine, workload(args.requests, args.max_len, seed=7), args.rate)
        calls.clear()
        tokens_per_second = arrivals(engine, workload(args.requests, args.max_len, seed=5), args.rate)
    finally:
        engine.stop()
    by_shape: dict[tuple, list[float]] = collections.defaultdict(list)
    live: dict[tuple, int] = collections.Counter()
    for kind, shape, n, seconds in calls:
        by_shape[kind, shape].append(seconds)
        live[kind, shape] += n
    total = sum(sum(t) for t in by_shape.values())
    print(
        f"{args.requests} requests at {args.rate:g}/s: {tokens_per_second:.1f} tokens/s; "
        f"{len(calls)} device calls, {total:.2f} s; compiled while serving: {engine.runner.compiles_since_warm_up}"
    )
    for kind in ("Prefill", "Mixed", "Decode", "Speculate"):
        spent = sum(sum(t) for (k, _), t in by_shape.items() if k == kind)
        if spent:
            print(f"  {kind.lower()}: {spent:.2f} s ({spent / total:.0%})")
    print("\n(size: a prefill's (and a mixed call's) prompt bucket, a decode's chunk, a speculation's proposals; live:")
    print("rows not padding, a mixed call's decoding rows)")
    print(f"{'call':>9} {'rows':>5} {'size':>5} {'pages':>6} {'calls':>6} {'total s':>8} {'mean ms':>8} {'live':>5}")
    for (kind, (n, size, width)), times in sorted(by_shape.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind:>9} {n:>5} {size:>5} {width:>6} {len(times):>6} {sum(times):>8.2f} "
              f"{1e3 * np.mean(times):>8.1f} {live[kind, (n, size, width)] / len(times):>5.1f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", default=None)
    ap.add_argument("--preset", help="random weights of this preset made in place (no checkpoint)")
    ap.add_argument("--dtype", default="bfloat16", help="with --preset")
    ap.add_argument("--quantize", default=None, help="with --preset: int8, w8a8 or nf4 projections")
    ap.add_argument("--kv-cache-dtype", default=None, help="int8, or the compute dtype when not given")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=32.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--chunk", type=int, default=4, help="decode steps per call (the server's default)")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1280)
    ap.add_argument("--mixed", default="off", help="mixed_steps settings, comma-separated (off, on)")
    args = ap.parse_args()
    import jax

    from meshlm.config import preset
    from meshlm.sharding import make_mesh

    device = jax.devices()[0]
    print(f"JAX {jax.__version__} on {device.device_kind} ({device.platform}); load average {load_average()}")
    if args.preset:
        lm = meshlm.from_config(preset(args.preset), make_mesh(None), args.dtype, seed=0, quantize=args.quantize)
    else:
        with tempfile.TemporaryDirectory() as folder:
            if args.checkpoint is None:
                write_random_model(folder, 256, 4)
            lm = meshlm.load(args.checkpoint or folder)
    for mixed in args.mixed.split(","):
        engine = lm.engine(max_batch=args.max_batch, max_len=args.max_len, kv_cache_dtype=args.kv_cache_dtype,
                           mixed_steps={"off": False, "on": True}[mixed])  # fmt: skip
        measure(engine, args)
        del engine
        gc.collect()  # its pool, before the next engine's
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
