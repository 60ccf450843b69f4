"""Decode attention straight from the paged KV pool with JAX's Pallas paged-attention kernels.

A decode step's query (one token per row) attends over the row's pages without gathering them into a
contiguous [B, S, H, K] copy first. Two kernels take the same pool layout, [H, pages, page_size, K]:

- "gpu": `jax.experimental.pallas.ops.gpu.paged_attention` (Triton); on a CPU it runs in Pallas'
  interpreter, which is how the tests check it against the gather path;
- "tpu": `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic). It reads keys and values as
  bfloat16, so it serves bfloat16 pools, and int8 pools with their scales (its `QuantizedTensor`); the
  tests run it in the TPU interpreter.

An int8 pool's scales (`kv_cache.KVCache`, [H, pages, page_size, 1], value = q * scale / 127.5) go to the
TPU kernel as they are and to the GPU kernel as the factors it multiplies by, [H, pages, page_size].

Under a mesh a kernel runs per shard: rows split over the batch axes, heads over `model`, the pool
(heads over `model`, every page on every batch shard) as it lies.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

from meshlm.sharding import spec_for, traced_backend

QUANT_MAX = MAX_INT8  # an int8 pool's scale unit, the TPU kernel's (127.5); `kv_cache` reads it from here
Array = jax.Array
Scale = jax.Array | None

BLOCK_H = 16  # the GPU kernel's query heads per block (its minimum; one KV head's queries are padded to it)
TPU_BLOCK_PAGES = 8  # pages the TPU kernel reads per block: fewer made a decode step 30x its bandwidth time


def _kernel(name: str, pages_per_row: int) -> Callable[..., jax.Array]:
    """kernel(q, k_pages, v_pages, table, lengths, k_scale, v_scale) for a table of `pages_per_row` pages
    (the scales None for a float pool)."""
    if name == "tpu":
        call = functools.partial(tpu_kernel, pages_per_compute_block=TPU_BLOCK_PAGES)

        def tpu(q: Array, k: Array, v: Array, table: Array, lengths: Array, k_scale: Scale, v_scale: Scale) -> Array:
            # the kernel multiplies float32 queries by a bfloat16 pool's keys, which Mosaic compiles only at the
            # default precision: a caller's "highest" (a parity test's) would stop the compile
            mixed = k.dtype == jnp.bfloat16
            if k_scale is not None:
                k, v = QuantizedTensor(k, k_scale), QuantizedTensor(v, v_scale)
            # whole blocks: the padding names page 0, and the kernel reads no block past a row's length
            table = jnp.pad(table, ((0, 0), (0, -pages_per_row % TPU_BLOCK_PAGES)))
            with jax.default_matmul_precision("default") if mixed else contextlib.nullcontext():
                return call(q, k, v, lengths, table)

        return tpu
    splits = math.gcd(pages_per_row, 16)  # the sequence is split over up to 16 partitions of whole blocks
    call = functools.partial(
        gpu_kernel.paged_attention,
        block_h=BLOCK_H,
        k_splits=splits,
        pages_per_compute_block=math.gcd(pages_per_row // splits, 8),
        interpret=traced_backend() == "cpu",
    )

    def gpu(q: Array, k: Array, v: Array, table: Array, lengths: Array, k_scale: Scale, v_scale: Scale) -> Array:
        if k_scale is not None:
            k_scale, v_scale = (s[..., 0] / QUANT_MAX for s in (k_scale, v_scale))
        return call(q, k, v, table, lengths, k_scale, v_scale)

    return gpu


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table: jax.Array,
    lengths: jax.Array,
    kernel: str,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T) v for q [B, H, K] (already scaled) over the first `lengths[b]` tokens of row b's
    pages `table[b]` in the pools [H, pages, page_size, K] (int8 ones with their scales), by the `kernel`
    ("gpu" or "tpu"): [B, H, K]."""
    call = _kernel(kernel, table.shape[1])
    if jax.sharding.get_abstract_mesh().empty:
        return call(q, k_pages, v_pages, table, lengths, k_scale, v_scale)
    rows = spec_for(("batch", "act_heads", None))
    pool = spec_for(("act_heads", None, None, None))
    scales = pool if k_scale is not None else None
    return jax.shard_map(
        call,
        in_specs=(rows, pool, pool, spec_for(("batch", None)), spec_for(("batch",)), scales, scales),
        out_specs=rows,
        check_vma=False,  # the kernels' outputs declare no varying axes; each shard's rows are its own
    )(q, k_pages, v_pages, table, lengths, k_scale, v_scale)
