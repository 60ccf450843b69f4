"""The paged KV cache: keys and values of every layer in fixed-size pages of one pool, and a decode
call's view of it (where its new tokens are written, what each row reads back).

`meshlm.serve.pages` decides which pages a row holds; this module only stores into and reads from them, for
the attention in `meshlm.model`. A decode step reads the pool either gathered into a contiguous copy
(`CacheView.read`) or in place by a Pallas kernel (`CacheView.attend`), as `meshlm.attention.resolve` chooses.
Its keys and values are written into the pool in place (`CacheView.write`): the pool is donated to
the engine's programs and aliased to their output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig, dtype_of
from meshlm.kv_dma import MAX_PAGE_COPIES, read_pages, write_pages, write_tokens
from meshlm.paged_attention import paged_attention
from meshlm.quant import absmax_int8
from meshlm.sharding import constrain, traced_backend


class KVCache(NamedTuple):
    """Keys and values of every layer, in fixed-size pages of one pool that every row draws from.

    A row holds pages only for the tokens it has; its page table lists them in order, so its token at
    position p lives in slot p % page_size of page table[p // page_size]. Rows that share a prompt
    prefix can share its (full) pages. Page 0 is never handed to a row and never written: a table's
    unused entries point at it. What a row reads past its length is zeroed before it is used (see
    `CacheView.read`): a page's earlier holder may have left NaN there (a row that failed), and a masked
    score's zero weight times NaN is NaN.

    An int8 pool (`KV_QUANTIZED`) keeps each token's keys and values per head as int8 with one float32
    scale: the value is q * scale, q in [-127, 127] from the vector's largest magnitude. It holds half a
    bfloat16 pool's bytes (plus 4 per head and token), so twice the rows. The scales lie page-major,
    [L, pages, H, page_size]: a page's scales are whole [H, page_size] tiles, one lane a token, which the TPU
    kernel (`meshlm.paged_attention`) reads beside the page and applies to the scores and the probabilities.
    """

    # Heads first: reshaped to [H, L * pages, page_size, K] (no copy), every layer's pages are one pool
    # that the paged-attention kernels read in place (`CacheView.attend`).
    k: jax.Array  # [H, L, pages, page_size, K]
    v: jax.Array  # [H, L, pages, page_size, K]
    k_scale: jax.Array | None = None  # [L, pages, H, page_size] float32 for an int8 pool, else None
    v_scale: jax.Array | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def zero_pages(self, pages: jax.Array) -> KVCache:
        """The pool with `pages` zeroed in every layer: the ids before the first out of range one, a page at a
        time, in place where the pool is donated. (One scatter of every id made XLA a zero update larger than the pool:
        3.5 GB of temporaries for GPT-J-6B's 7 GB int8 pool on one v5e, which failed its server's start.)"""
        count = jnp.argmin(jnp.append(pages < self.k.shape[2], False))

        def zero(i: jax.Array, cache: KVCache) -> KVCache:
            def page(pool: jax.Array | None, axis: int) -> jax.Array | None:
                if pool is None:
                    return None
                start = [0] * pool.ndim
                start[axis] = pages[i]
                return jax.lax.dynamic_update_slice(pool, jnp.zeros((*pool.shape[:axis], 1, *pool.shape[axis + 1 :]),
                                                                    pool.dtype), start)  # fmt: skip

            return KVCache(page(cache.k, 2), page(cache.v, 2), page(cache.k_scale, 1), page(cache.v_scale, 1))

        return jax.lax.fori_loop(0, count, zero, self)


CACHE_AXES = ("act_heads", "layers", None, None, "head_dim")
SCALE_AXES = ("layers", None, "act_heads", None)
KV_QUANTIZED = "int8"  # the pool dtype stored with scales; any float dtype is stored as it is
NOT_WRITTEN = -1  # a `CacheView.slots` entry of a token that is not stored
DMA_BACKENDS = ("tpu",)  # where the pool is written and read by the DMA kernels (`CacheView.write`, `.read`)


def init_cache(cfg: ModelConfig, pages: int, page_size: int, dtype: str = "float32") -> KVCache:
    """An empty pool of `pages` pages (page 0 included) of `page_size` tokens each, stored in `dtype` (a
    float dtype, or KV_QUANTIZED)."""
    shape = (cfg.n_head, cfg.n_layer, pages, page_size, cfg.d_head)
    if dtype != KV_QUANTIZED:
        return KVCache(*(constrain(jnp.zeros(shape, dtype_of(dtype)), CACHE_AXES) for _ in range(2)))
    pools = [constrain(jnp.zeros(shape, jnp.int8), CACHE_AXES) for _ in range(2)]
    scale_shape = (cfg.n_layer, pages, cfg.n_head, page_size)
    scales = [constrain(jnp.zeros(scale_shape, jnp.float32), SCALE_AXES) for _ in range(2)]
    return KVCache(*pools, *scales)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """q [..., K] int8 with its scales [...] as `dtype`."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


class CacheView(NamedTuple):
    """The pool as one call of `decode` sees it: rows' page tables [B, n], where each new token of [B, T]
    is written (a flat slot, page * page_size + offset; `NOT_WRITTEN` for padding and tokens already
    cached) and how many tokens each row holds once the last of them is written."""

    cache: KVCache
    table: jax.Array  # [B, n] int32
    slots: jax.Array  # [B, T] int32
    lengths: jax.Array  # [B] int32

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array, whole_pages: bool = False) -> CacheView:
        """Store this layer's new keys and values [B, T, H, K] at the rows' slots, in place.

        On a backend of `DMA_BACKENDS` a decode step (one token per row), and a prompt whose
        written tokens start a page (`whole_pages`), write by the Pallas kernels of `meshlm.kv_dma`, on
        the pool as it lies: XLA's scatter into it made the TPU's layout assignment copy the pool whole to
        and from the paged kernel's layout (in every layer of every decode step; around every prefill), and
        one dynamic-update-slice per row and head grew the step by B * H ops a layer (see that module).
        tests/test_kv_in_place.py compiles the engine's decode and prefill programs for a v5e and finds no
        copy of the pool. Elsewhere, and for speculated tokens, one scatter: on a CPU the scatter of a
        float32 pool is in place; a bfloat16 one XLA widens to float32 and back around it."""
        written = self.slots != NOT_WRITTEN
        pages, offsets = self.slots // self.cache.page_size, self.slots % self.cache.page_size
        by_dma = self.by_dma(whole_pages)

        pages_by_dma = by_dma and self.slots.shape[1] > 1
        if pages_by_dma:  # heads major from here, as a page holds them: [B, H, T, K]
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

        # new keys or values [B, T, H, K] and scales [B, T, H]; by pages heads major, [B, H, T, K] and [B, H, T]
        def put(pool: jax.Array, new: jax.Array) -> jax.Array:
            new = new.astype(pool.dtype)
            if pages_by_dma:
                return write_pages(pool, new, layer, self.slots, written)
            if by_dma:
                return write_tokens(pool, new[:, 0], layer, pages[:, 0], offsets[:, 0], written[:, 0])
            dropped = jnp.where(written, pages, self.cache.k.shape[2])  # out of range: the scatter drops it
            if pool.ndim == 4:  # scales, page-major
                return pool.at[layer, dropped, :, offsets].set(new, mode="drop")
            return pool.at[:, layer, dropped, offsets].set(jnp.moveaxis(new, 2, 0), mode="drop")

        if not self.cache.quantized:
            return self._replace(cache=KVCache(put(self.cache.k, k), put(self.cache.v, v)))
        (qk, sk), (qv, sv) = absmax_int8(k), absmax_int8(v)
        c = self.cache
        return self._replace(cache=KVCache(put(c.k, qk), put(c.v, qv), put(c.k_scale, sk), put(c.v_scale, sv)))

    def by_dma(self, whole_pages: bool) -> bool:
        """Whether this call's writes and reads move the pool's tokens by the DMA kernels of `meshlm.kv_dma`: on a
        backend of `DMA_BACKENDS`, for a decode step or a prompt of whole pages (`whole_pages`) within
        MAX_PAGE_COPIES. Reads follow the writes: a scatter leaves the pool in a layout of XLA's own, which a
        kernel's read would copy the whole pool out of in every layer (a speculative step's, a long prompt's)."""
        T = self.slots.shape[1]
        fits = T == 1 or (whole_pages and T <= MAX_PAGE_COPIES * self.cache.page_size)
        return fits and traced_backend() in DMA_BACKENDS

    def read(self, layer: jax.Array, dtype: Any, whole_pages: bool = False) -> tuple[jax.Array, jax.Array]:
        """This layer's keys and values of every row, [B, n * page_size, H, K] in table order: a page per DMA
        (`kv_dma.read_pages`) where the call writes by DMA (`by_dma`), else one gather."""
        by_dma = self.by_dma(whole_pages)

        def pages_of(pool: jax.Array) -> jax.Array:  # [B, H, n, page_size, K], or [B, H, n, page_size] of scales
            if by_dma:
                return read_pages(pool, layer, self.table)
            if pool.ndim == 4:  # scales, page-major
                return jnp.moveaxis(pool[layer, self.table], 2, 1)
            return jnp.moveaxis(pool[:, layer, self.table], 0, 1)

        def gather(pool: jax.Array, scale: jax.Array | None) -> jax.Array:
            pages = pages_of(pool)
            if scale is not None:
                pages = dequantize(pages, pages_of(scale), dtype)
            B, H, n, size, K = pages.shape
            held = jnp.arange(n * size)[None, None, :, None] < self.lengths[:, None, None, None]
            keys = jnp.where(held, pages.reshape(B, H, n * size, K).astype(dtype), 0)
            # [B, S, H, K] as attention takes them, heads major as read: a layout its products take (laid out token
            # major, each layer's pages were copied over on a TPU, and a CPU's decode ran 1.25-1.49x slower)
            return constrain(jnp.swapaxes(keys, 1, 2), ("batch", "cache_seq", "act_heads", None))

        c = self.cache
        return gather(c.k, c.k_scale), gather(c.v, c.v_scale)

    def attend(self, layer: jax.Array, q: jax.Array, scale: float, kernel: str) -> jax.Array:
        """One query per row, q [B, 1, H, K], over the row's cached tokens by a paged-attention kernel,
        reading the pool in place: layer l's page p is page l * pages + p of the [H, L * pages, ...] view."""
        H, L, P, size, K = self.cache.k.shape
        k, v = (x.reshape(H, L * P, size, K) for x in self.cache[:2])
        k_scale, v_scale = (None if x is None else x.reshape(L * P, H, size) for x in self.cache[2:])
        query = (q[:, 0] * scale).astype(q.dtype if self.cache.quantized else k.dtype)
        out = paged_attention(query, k, v, self.table + layer * P, self.lengths, kernel, k_scale, v_scale)
        return out[:, None].astype(q.dtype)
