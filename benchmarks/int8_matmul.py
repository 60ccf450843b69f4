"""An int8 model's projections two ways, on this machine's first device: the int8 weight dequantized to bfloat16
and multiplied in bfloat16 (meshlm's path, `quant.Int8Weight.dense`), or the activations quantized too, per token,
and multiplied int8 x int8 into int32 (a TPU v5e's matrix unit does twice the int8 operations of bfloat16 ones). Runs
GPT-J-6B's MLP (d_model 4096 -> 16,384 -> 4096, gelu) over a scan of `--layers` layers at each token count, bfloat16
weights beside them as the hardware's reference, and prints each way's time, TFLOP/s and the int8 x int8 output's
error relative to the dequantized path's.

    python benchmarks/int8_matmul.py [--tokens 16,272,1024,4096 --layers 8 --d-model 4096 --d-ff 16384]

The JAX version, the device and the load are printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from benchmarks.timing import best_times, load_average


def quantized(key: jax.Array, layers: int, d_in: int, d_out: int) -> tuple[jax.Array, jax.Array]:
    """Random weights [layers, d_in, d_out], int8 codes and scales per output channel as `meshlm.quant` makes them."""
    w = jax.random.normal(key, (layers, d_in, d_out), jnp.float32) / d_in**0.5
    scale = jnp.max(jnp.abs(w), axis=1) / 127
    return jnp.rint(w / scale[:, None]).astype(jnp.int8), scale


def dequantized(codes: jax.Array, scale: jax.Array) -> jax.Array:
    return (codes.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)


def product(way: str, x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x [T, in] bfloat16 times one layer's weight, by `way`."""
    if way == "bfloat16":
        return x @ w
    if way == "int8, dequantized":
        return x @ (w.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    top = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)  # int8 x int8: per token absmax
    xq = jnp.rint(x.astype(jnp.float32) * (127 / jnp.where(top > 0, top, 1.0))).astype(jnp.int8)
    acc = jax.lax.dot(xq, w, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * (top / 127) * scale).astype(jnp.bfloat16)


def mlp_stack(way: str, x: jax.Array, weights: tuple[jax.Array, ...]) -> jax.Array:
    def layer(x: jax.Array, p: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        w_in, s_in, w_out, s_out = p
        up = jax.nn.gelu(product(way, x, w_in, s_in))
        return x + product(way, up, w_out, s_out), None

    return jax.lax.scan(layer, x, weights)[0]


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
    (c_in, s_in), (c_out, s_out) = quantized(k_in, L, D, F), quantized(k_out, L, F, D)
    codes = (c_in, s_in, c_out, s_out)
    as_bf16 = (dequantized(c_in, s_in), s_in, dequantized(c_out, s_out), s_out)
    weights = {"bfloat16": as_bf16, "int8, dequantized": codes, "int8 x int8": codes}
    print(f"MLP {D} -> {F} -> {D}, {L} layers in a scan; best of {args.repeats}")
    print("| tokens | way | ms | TFLOP/s | speed / int8 dequantized | relative error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T in (int(t) for t in args.tokens.split(",")):
        x = (jax.random.normal(k_x, (T, D), jnp.float32)).astype(jnp.bfloat16)
        fns = {way: jax.jit(lambda x, w, way=way: mlp_stack(way, x, w)) for way in weights}
        outs = {way: fn(x, weights[way]) for way, fn in fns.items()}
        times = best_times({way: lambda fn=fn, way=way, x=x: fn(x, weights[way]).block_until_ready()
                            for way, fn in fns.items()}, args.repeats)  # fmt: skip
        flops = 2 * 2 * T * D * F * L
        ref = outs["int8, dequantized"].astype(jnp.float32)
        for way, t in times.items():
            err = jnp.linalg.norm(outs[way].astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
            ratio = times["int8, dequantized"] / t
            print(f"| {T} | {way} | {1e3 * t:.2f} | {flops / t / 1e12:.1f} | {ratio:.2f}x | {float(err):.2e} |")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
