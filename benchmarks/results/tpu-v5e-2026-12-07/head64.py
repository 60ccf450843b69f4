"""Heads of 64 through meshlm's TPU paged kernel (`meshlm.paged_attention._tpu`) against the gather path.

Kernel level, one program of L layers over a pool [H, L * P, 128, K] (pages of 128, rows of `--context`
tokens each, the last page partial): per layer either
  kernel: paged_attention(q, k, v, table + l * P, lengths, "tpu", scales)      (what CacheView.attend calls)
  gather: CacheView.read (the DMA page reads on a TPU) + attention.dense(xla)   (the engine's xla decode path)
Reference: the pool dequantized to float32, gathered, einsum-softmax-einsum at HIGHEST precision.
    python .tpu/head64.py --heads 16 --head-dim 64 --layers 8 --rows 16,64 --pools bfloat16,int8,float32
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import kv_cache, quant
from meshlm.attention import Kernel, dense
from meshlm.paged_attention import paged_attention

import os
KERNEL = os.environ.get("KERNEL", "tpu")  # "gpu" (interpreted) only for a CPU smoke of this script


def best(fn, repeats):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return min(ts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="16,64")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--pools", default="bfloat16,int8,float32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-pool-gb", type=float, default=6.0)
    a = p.parse_args()
    d = jax.devices()[0]
    print(f"JAX {jax.__version__}, {d.device_kind} ({d.platform}); heads {a.heads} x {a.head_dim}, {a.layers} layers, "
          f"pages of {a.page}, context {a.context} (lengths context - [0, page)), best of {a.repeats}", flush=True)
    H, K, L, size = a.heads, a.head_dim, a.layers, a.page
    print(f"{'pool':>8} {'rows':>4} {'kernel-ref':>10} {'gather-ref':>10} {'kern-gath':>10} {'|ref| max':>9} "
          f"{'kernel us/layer':>15} {'gather us/layer':>15} {'gather/kernel':>13} {'pool GB/s (kernel)':>18}", flush=True)
    for pool_dtype in a.pools.split(","):
        compute = jnp.float32 if pool_dtype == "float32" else jnp.bfloat16
        for B in (int(r) for r in a.rows.split(",")):
            n = -(-a.context // size)
            P = B * n + 1
            el = 1 if pool_dtype == "int8" else jnp.dtype(compute).itemsize
            gb = 2 * H * L * P * size * K * el / 1e9
            if gb > a.max_pool_gb:
                print(f"{pool_dtype:>8} {B:>4} skipped: pool {gb:.1f} GB", flush=True)
                continue
            key = jax.random.key(B)
            kk, kv, kq, kl = jax.random.split(key, 4)

            @jax.jit
            def make(kk, kv):
                shape = (H, L, P, size, K)
                k = jax.random.normal(kk, shape, jnp.float32)
                v = jax.random.normal(kv, shape, jnp.float32)
                if pool_dtype == "int8":
                    (qk, sk), (qv, sv) = quant.absmax_int8(k), quant.absmax_int8(v)
                    # scales [H, L, P, size] -> page-major [L, P, H, size]
                    return kv_cache.KVCache(qk, qv, jnp.moveaxis(sk, 0, 2), jnp.moveaxis(sv, 0, 2))
                return kv_cache.KVCache(k.astype(compute), v.astype(compute))

            cache = make(kk, kv)
            q = (jax.random.normal(kq, (B, H, K), jnp.float32) / np.sqrt(K)).astype(compute)
            table = 1 + jnp.arange(B * n, dtype=jnp.int32).reshape(B, n)
            lengths = a.context - jax.random.randint(kl, (B,), 0, size, jnp.int32)

            @jax.jit
            def kernel(cache, q, table, lengths):
                Hh, Ll, Pp, s, Kk = cache.k.shape
                k, v = (x.reshape(Hh, Ll * Pp, s, Kk) for x in cache[:2])
                ks, vs = (None if x is None else x.reshape(Ll * Pp, Hh, s) for x in cache[2:])
                return jnp.stack([paged_attention(q, k, v, table + l * Pp, lengths, KERNEL, ks, vs) for l in range(Ll)])

            @jax.jit
            def gather(cache, q, table, lengths):
                view = kv_cache.CacheView(cache, table, jnp.zeros((B, 1), jnp.int32), lengths)
                S = table.shape[1] * cache.page_size
                allowed = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, :]
                outs = []
                for l in range(L):
                    keys, values = view.read(jnp.int32(l), compute)
                    outs.append(dense(Kernel("xla", "gather"), q[:, None], keys, values, allowed, None, 1.0)[:, 0])
                return jnp.stack(outs)

            @jax.jit
            def reference(cache, q, table, lengths, l):
                def pages(pool, scale):
                    x = pool[:, l][:, table].astype(jnp.float32)  # [H, B, n, size, K]
                    if scale is not None:
                        x = x * jnp.moveaxis(scale[l][table], 2, 0)[..., None]  # [B, n, H, size] -> [H, B, n, size]
                    return x.reshape(H, B, n * size, K)
                k, v = pages(cache.k, cache.k_scale), pages(cache.v, cache.v_scale)
                s = jnp.einsum("bhk,hbsk->bhs", q.astype(jnp.float32), k, precision="highest")
                s = jnp.where(jnp.arange(n * size)[None, None] < lengths[:, None, None], s, -jnp.inf)
                return jnp.einsum("bhs,hbsk->bhk", jax.nn.softmax(s, -1), v, precision="highest")

            try:
                ko = kernel(cache, q, table, lengths).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001
                print(f"{pool_dtype:>8} {B:>4} kernel failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                continue
            go = gather(cache, q, table, lengths).astype(jnp.float32)
            diffs = [0.0, 0.0]
            top = 0.0
            for l in sorted({0, L - 1}):
                r = reference(cache, q, table, lengths, jnp.int32(l))
                diffs[0] = max(diffs[0], float(jnp.max(jnp.abs(ko[l] - r))))
                diffs[1] = max(diffs[1], float(jnp.max(jnp.abs(go[l] - r))))
                top = max(top, float(jnp.max(jnp.abs(r))))
            kg = float(jnp.max(jnp.abs(ko - go)))
            tk = best(lambda: kernel(cache, q, table, lengths), a.repeats) / L
            tg = best(lambda: gather(cache, q, table, lengths), a.repeats) / L
            bytes_read = 2 * H * B * n * size * K * el + (2 * B * n * H * size * 4 if pool_dtype == "int8" else 0)
            print(f"{pool_dtype:>8} {B:>4} {diffs[0]:>10.2e} {diffs[1]:>10.2e} {kg:>10.2e} {top:>9.3f} "
                  f"{1e6 * tk:>15.1f} {1e6 * tg:>15.1f} {tg / tk:>13.2f} {bytes_read / tk / 1e9:>18.0f}", flush=True)
            del cache, ko, go
            jax.clear_caches()


if __name__ == "__main__":
    main()
