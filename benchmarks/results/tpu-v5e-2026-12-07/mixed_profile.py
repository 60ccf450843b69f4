"""Where a mixed step's time goes on the chip: 15 rows of a preset (int8 projections and pool) decode 4 tokens a
step when a 1,024-token prompt arrives, prefilled 256 tokens a step, each chunk in one pass with the rows' first
token. Prints each call kind's times (ms) over the prompt's steps, twice (after a pass that compiles), then
profiles one mixed call into FOLDER (read it with benchmarks/profile_ops.py).

    python mixed_profile.py PRESET FOLDER [QUANTIZE]
"""

import sys
import time

import jax
import numpy as np

import meshlm
from meshlm.config import preset
from meshlm.sharding import make_mesh

name, folder = sys.argv[1], sys.argv[2]
quantize = sys.argv[3] if len(sys.argv) > 3 else "int8"
lm = meshlm.from_config(preset(name), make_mesh(None), "bfloat16", seed=0, quantize=quantize)
engine = lm.engine(
    max_batch=16,
    max_len=min(1280, lm.config.max_seq_len),
    prefill_tokens=256,
    prefix_caching=False,
    kv_cache_dtype="int8",
    mixed_steps=True,
)
times: dict[str, list[float]] = {}
profile = {"next": False}
run, run_mixed = engine.runner.run, engine.runner.run_mixed


def timed_run(batch):
    began = time.perf_counter()
    out = run(batch)
    times.setdefault(type(batch).__name__, []).append(round(1e3 * (time.perf_counter() - began), 1))
    return out


def timed_mixed(prefill, decode):
    tracing = profile["next"]
    if tracing:
        jax.profiler.start_trace(folder)
    began = time.perf_counter()
    out = run_mixed(prefill, decode)
    times.setdefault("Mixed", []).append(round(1e3 * (time.perf_counter() - began), 1))
    if tracing:
        jax.profiler.stop_trace()
        profile["next"] = False
    return out


engine.runner.run, engine.runner.run_mixed = timed_run, timed_mixed
rng = np.random.default_rng(0)
V = lm.config.n_vocab_used


def arrival(traced: bool = False) -> dict:
    rows = engine.add_requests(
        [rng.integers(1, V, 64).tolist() for _ in range(15)],
        [lm.sampling(min(400, lm.config.max_seq_len - 64), temperature=0.0, ignore_eos=True)] * 15,
    )
    while min(len(r.output.tokens) for r in rows) == 0:
        engine.step(4)
    for _ in range(2):
        engine.step(4)
    times.clear()
    prompt = engine.add_request(
        rng.integers(1, V, min(1024, lm.config.max_seq_len - 1)).tolist(), lm.sampling(1, temperature=0.0)
    )
    engine.step(4)
    profile["next"] = traced  # the prompt's second chunk
    while not prompt.output.tokens:
        engine.step(4)
    for r in rows:
        engine.abort(r.id)
    engine.step(4)
    return dict(times)


began = time.perf_counter()
arrival()
print(f"compiled in {time.perf_counter() - began:.0f} s", flush=True)
print("times (ms):", arrival(), flush=True)
print("profiled:", arrival(traced=True), flush=True)
