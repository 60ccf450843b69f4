"""Decode attention straight from the paged KV pool with JAX's Pallas paged-attention kernel.

A decode step's query (one token per row) attends over the row's pages without gathering them into a
contiguous [B, S, H, K] copy first. The kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, a
Triton kernel) runs on GPUs; on a CPU it runs in Pallas' interpreter, which is how the tests check it
against the gather path. Under a mesh it runs per shard: rows split over the batch axes, heads over
`model`, the pool (heads over `model`, every page on every batch shard) as it lies.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

from meshlm.sharding import spec_for

BLOCK_H = 16  # query heads per kernel block (the kernel's minimum; one KV head's queries are padded to it)


def paged_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, table: jax.Array, lengths: jax.Array
) -> jax.Array:
    """softmax(q k^T) v for q [B, H, K] (already scaled) over the first `lengths[b]` tokens of row b's
    pages `table[b]` in the pools [H, pages, page_size, K]: [B, H, K]."""
    n = table.shape[1]
    splits = math.gcd(n, 16)  # the sequence is split over up to 16 partitions, each a whole number of blocks
    kernel = functools.partial(
        pallas_paged.paged_attention,
        block_h=BLOCK_H,
        k_splits=splits,
        pages_per_compute_block=math.gcd(n // splits, 8),
        interpret=jax.default_backend() == "cpu",
    )
    if jax.sharding.get_abstract_mesh().empty:
        return kernel(q, k_pages, v_pages, table, lengths)
    rows = spec_for(("batch", "act_heads", None))
    pool = spec_for(("act_heads", None, None, None))
    return jax.shard_map(
        kernel,
        in_specs=(rows, pool, pool, spec_for(("batch", None)), spec_for(("batch",))),
        out_specs=rows,
        check_vma=False,  # the kernel's outputs declare no varying axes; each shard's rows are its own
    )(q, k_pages, v_pages, table, lengths)
