"""Where a decode call's wall time goes: 16 (and 1) rows of a preset (int8 projections and pool) decoding, each
call split into putting its inputs, dispatching, the device running it and taking its outputs back; chunk 1 and 4,
so the per-call part shows beside the per-token part. Then one 16-row chunk-4 call profiled into FOLDER.

    python decode_phases.py PRESET FOLDER
"""

import sys
import time

import jax
import numpy as np

import meshlm
from meshlm.config import preset
from meshlm.serve import runner as runner_module
from meshlm.serve.batch import Decode
from meshlm.sharding import make_mesh, to_host

name, folder = sys.argv[1], sys.argv[2]
quantize = None if name.startswith("test") else "int8"
lm = meshlm.from_config(preset(name), make_mesh(None), "bfloat16", seed=0, quantize=quantize)
L = min(512, lm.config.max_seq_len)
engine = lm.engine(max_batch=16, max_len=L, prefix_caching=False, kv_cache_dtype="int8", mixed_steps=False)
runner = engine.runner
seen: list[Decode] = []
run = runner.run


def keep(batch):
    if isinstance(batch, Decode):
        seen.append(batch)
    return run(batch)


runner.run = keep
rng = np.random.default_rng(0)
V = lm.config.n_vocab_used
rows = engine.add_requests([rng.integers(1, V, L // 2).tolist() for _ in range(16)],
                           [lm.sampling(L // 2 - 16, temperature=0.0, ignore_eos=True)] * 16)
while min(len(r.output.tokens) for r in rows) == 0:
    engine.step(1)
seen.clear()
engine.step(1)
full = seen[-1]
one = Decode(full.slots[:1], full.table[:1], 1, full.allowed[:1])


def phases(batch: Decode) -> list[float]:
    t0 = time.perf_counter()
    dev = runner._from_host(runner_module._scalar_chunk(batch))
    jax.block_until_ready(dev)
    t1 = time.perf_counter()
    out = runner._call(runner_module._decode, dev)
    t2 = time.perf_counter()
    jax.block_until_ready(out)
    t3 = time.perf_counter()
    to_host(out)
    t4 = time.perf_counter()
    return [1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), 1e3 * (t4 - t3)]


def whole(batch: Decode) -> float:
    t0 = time.perf_counter()
    runner.decode(batch)
    return 1e3 * (time.perf_counter() - t0)


print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {name}, int8 projections and pool, 16 slots, "
      "prompts of 256")
print(f"{'rows':>4} {'chunk':>5} {'whole ms':>9} {'put':>7} {'dispatch':>9} {'device':>8} {'take':>7}")
for batch in (full, one):
    for chunk in (1, 2, 4):
        b = batch._replace(chunk=chunk)
        for _ in range(2):
            whole(b), phases(b)  # compiles
        w = min(whole(b) for _ in range(5))
        p = np.min([phases(b) for _ in range(5)], axis=0)
        print(f"{len(b.slots):>4} {chunk:>5} {w:>9.2f} " + " ".join(f"{x:>7.2f}" for x in p))
b = full._replace(chunk=4)
jax.profiler.start_trace(folder)
for _ in range(2):
    whole(b)
jax.profiler.stop_trace()
print("profiled: two 16-row chunk-4 calls")
