"""An int8 model's projections two ways, on this machine's first device, each by `meshlm.quant.times`: the int8
weight dequantized to bfloat16 and multiplied in bfloat16 (`--quantize int8`), or the activations quantized too, per
token, and multiplied int8 x int8 into int32 (`--quantize w8a8`; a TPU v5e's matrix unit does twice the int8
operations of bfloat16 ones). Runs GPT-J-6B's MLP (d_model 4096 -> 16,384 -> 4096, gelu) over a scan of `--layers`
layers at each token count, bfloat16 weights beside them as the hardware's reference, and prints each way's time,
TFLOP/s and the int8 x int8 output's error relative to the dequantized path's.

    python benchmarks/int8_matmul.py [--tokens 16,272,1024,4096 --layers 8 --d-model 4096 --d-ff 16384]

The JAX version, the device and the load are printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from benchmarks.timing import best_times, load_average
from meshlm import quant

WAYS = {"bfloat16": None, "int8, dequantized": "int8", "int8 x int8": "w8a8"}  # way -> meshlm's quantization


def weights(key: jax.Array, layers: int, d_in: int, d_out: int, kind: str | None) -> Any:
    """Random weights [layers, d_in, d_out], quantized by `meshlm.quant` to `kind` (None: bfloat16, from the int8
    codes, so that every way multiplies the same numbers)."""
    w = jax.random.normal(key, (layers, d_in, d_out), jnp.float32) / d_in**0.5
    stored = quant.quantize(w, kind or "int8", n_in=1, heads_first=False)
    return stored if kind else jax.vmap(lambda one: one.dense(jnp.bfloat16))(stored)


def mlp_stack(x: jax.Array, weights: tuple[Any, Any]) -> jax.Array:
    def layer(x: jax.Array, p: tuple[Any, Any]) -> tuple[jax.Array, None]:
        w_in, w_out = p
        up = jax.nn.gelu(quant.times(x, w_in, 1))
        return x + quant.times(up, w_out, 1), None

    return jax.lax.scan(layer, x, weights)[0]


RUN = jax.jit(mlp_stack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,272,1024,4096")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--d-ff", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    device = jax.devices()[0]
    print(f"JAX {jax.__version__} on {device.device_kind} ({device.platform}); load average {load_average()}")
    L, D, F = args.layers, args.d_model, args.d_ff
    k_in, k_out, k_x = jax.random.split(jax.random.key(0), 3)
    stacks = {way: (weights(k_in, L, D, F, kind), weights(k_out, L, F, D, kind)) for way, kind in WAYS.items()}
    print(f"MLP {D} -> {F} -> {D}, {L} layers in a scan; best of {args.repeats}")
    print("| tokens | way | ms | TFLOP/s | speed / int8 dequantized | relative error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T in (int(t) for t in args.tokens.split(",")):
        x = (jax.random.normal(k_x, (T, D), jnp.float32)).astype(jnp.bfloat16)
        outs = {way: RUN(x, stack) for way, stack in stacks.items()}
        times = best_times({way: lambda stack=stack, x=x: RUN(x, stack).block_until_ready()
                            for way, stack in stacks.items()}, args.repeats)  # fmt: skip
        flops = 2 * 2 * T * D * F * L
        ref = outs["int8, dequantized"].astype(jnp.float32)
        for way, t in times.items():
            err = jnp.linalg.norm(outs[way].astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
            ratio = times["int8, dequantized"] / t
            print(f"| {T} | {way} | {1e3 * t:.2f} | {flops / t / 1e12:.1f} | {ratio:.2f}x | {float(err):.2e} |")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
