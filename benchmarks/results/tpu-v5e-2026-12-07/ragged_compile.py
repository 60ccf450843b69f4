"""How long JAX's ragged paged attention kernel takes to compile and run on this chip, at one small shape."""
import sys, time
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as r
heads, dim, rows, pages_per_row, page = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 128
blocks = tuple(int(b) for b in sys.argv[5].split(","))
P = 1 + rows * pages_per_row
q = jnp.ones((rows, heads, dim), jnp.bfloat16)
kv = jnp.ones((P, page, 2 * heads, dim), jnp.bfloat16)
lens = jnp.full((rows,), pages_per_row * page, jnp.int32)
table = 1 + jnp.arange(rows * pages_per_row, dtype=jnp.int32).reshape(rows, pages_per_row)
starts = jnp.arange(rows + 1, dtype=jnp.int32)
n = jnp.array([rows], jnp.int32)
f = jax.jit(lambda *a: r.ragged_paged_attention(*a, num_kv_pages_per_block=blocks[0], num_queries_per_block=blocks[1]))
t = time.perf_counter(); c = f.lower(q, kv, lens, table, starts, n).compile(); print(f"compiled in {time.perf_counter() - t:.1f} s", flush=True)
c(q, kv, lens, table, starts, n).block_until_ready()
t = time.perf_counter()
for _ in range(10):
    out = c(q, kv, lens, table, starts, n)
out.block_until_ready(); s = (time.perf_counter() - t) / 10
print(f"heads {heads} x {dim}, {rows} rows of {pages_per_row * page} tokens: {s * 1e6:.1f} us a call, {kv[1:].nbytes / s / 1e9:.1f} GB/s of KV", flush=True)
