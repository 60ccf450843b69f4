"""Splash attention against XLA's on the chip this runs on: the output and the q/k/v gradients, and the
time of a forward and backward pass, for GPT-J-family head sizes at sequence 2048 (bf16), causal, with
packed documents and with a local window. Prints the JAX version and the device first.

    python benchmarks/splash.py [--length 2048] [--head-dims 64,80,128,256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.attention import dense, resolve, splash


def compare(length: int, heads: int, head_dim: int, window: int, packed: bool, dtype=jnp.bfloat16, batch: int = 2):
    """(max |splash - xla| of the output and of each gradient, splash seconds, xla seconds) per fwd+bwd."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.random.normal(key, (batch, length, heads, head_dim)).astype(dtype) for key in keys)
    segments = None
    index = jnp.arange(length)
    allowed = jnp.broadcast_to(index[:, None] >= index[None, :], (batch, length, length))
    if packed:
        segments = jnp.broadcast_to((index >= length // 3).astype(jnp.int32) + (index >= length // 2), (batch, length))
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    if window:
        allowed = allowed & (index[:, None] - index[None, :] < window)
    scale = 1 / np.sqrt(head_dim)
    shape = dict(phase="train", kind="global", batch=batch, q_len=length, kv_len=length, heads=heads)
    name = "bfloat16" if dtype == jnp.bfloat16 else "float32"
    chosen = resolve(**shape, head_dim=head_dim, dtype=name)
    xla = resolve(**shape, head_dim=head_dim, dtype=name, impl="xla")

    def step(kernel):
        def f(q, k, v):
            if kernel.name == "splash":
                out = splash(kernel, q, k, v, segments, scale, window)
            else:
                out = dense(kernel, q, k, v, allowed, None, scale)
            return (out.astype(jnp.float32) * ct.astype(jnp.float32)).sum(), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    results, times = [], []
    for kernel in (chosen, xla):
        run = step(kernel)
        out = jax.block_until_ready(run(q, k, v))
        start = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(run(q, k, v))
        times.append((time.perf_counter() - start) / 5)
        results.append([np.asarray(x, np.float32) for x in (out[0][1], *out[1])])
    errors = [float(np.abs(a - b).max()) for a, b in zip(*results, strict=True)]
    return chosen, errors, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dims", default="64,80,128,256")
    args = p.parse_args()
    print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for window, packed in ((0, False), (0, True), (256, False)):
            case = f"head_dim {head_dim:3d} {'local 256' if window else 'packed' if packed else 'causal'}"
            try:
                kernel, errors, (t_kernel, t_xla) = compare(args.length, args.heads, head_dim, window, packed)
            except Exception as e:  # a shape the kernel refuses on this chip: say so, go on
                print(f"{case}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            err = " ".join(f"{n}={e:.3g}" for n, e in zip(("out", "dq", "dk", "dv"), errors, strict=True))
            print(
                f"{case}: {kernel.name} {t_kernel * 1e3:7.2f} ms, xla {t_xla * 1e3:7.2f} ms fwd+bwd; max |diff| {err}"
            )


if __name__ == "__main__":
    main()
