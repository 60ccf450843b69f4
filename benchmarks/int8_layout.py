"""Int8 codes in the weight's order or heads first (`quant.heads_first_here`), on this machine's devices: one decode
step of 8 rows (4 tokens a call) through the engine, each layout's engine in turn (best of `--repeats`).

    python benchmarks/int8_layout.py [--d-model 1024 --heads 16 --layers 4 --repeats 25]

A TPU stores them heads first (a v5e otherwise copies GPT-J-6B's q, k and v at every decode call:
benchmarks/results/tpu-v5e-2026-12-07/, section 13); this measures what heads first would cost elsewhere.
The JAX version, the device and the load are printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

import meshlm
from benchmarks.timing import best_times, load_average
from meshlm import quant
from meshlm.config import preset
from meshlm.sharding import make_mesh


def engine(cfg, heads_first: bool):
    """An engine on random int8 weights stored `heads_first` or not, its 8 rows decoding."""
    chosen = quant.heads_first_here
    quant.heads_first_here = lambda: heads_first
    try:
        lm = meshlm.from_config(cfg, make_mesh(None), "float32", seed=0, quantize="int8")
    finally:
        quant.heads_first_here = chosen
    assert lm.params["layers"]["attn"]["q"].heads_first == heads_first
    eng = lm.engine(max_batch=8, max_len=512, prefix_caching=False)
    eng.add_requests([[1, 2, 3, 4]] * 8, [lm.sampling(480, temperature=0.0, ignore_eos=True)] * 8)
    for _ in range(3):
        eng.step(4)
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    device = jax.devices()[0]
    print(f"JAX {jax.__version__} on {device.device_kind} ({device.platform}); load average {load_average()}")
    cfg = preset("gptj-tiny").replace(d_model=args.d_model, n_head=args.heads, n_layer=args.layers)
    engines = {"weight's order": engine(cfg, False), "heads first": engine(cfg, True)}
    times = best_times({name: (lambda e=e: e.step(4)) for name, e in engines.items()}, args.repeats)
    base = times["weight's order"]
    print(f"d_model {args.d_model}, {args.heads} heads, {args.layers} layers, 8 rows, 4 tokens a call:")
    for name, t in times.items():
        print(f"  {name:>15}: {1e3 * t:7.1f} ms a call ({t / base:.2f}x)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
