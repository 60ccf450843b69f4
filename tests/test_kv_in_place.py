"""A decode step writes its keys and values into the paged pool in place (issue 38).

A step that copied the pool would cost in proportion to the pool, so to its rows. These tests read the
program XLA compiles, not a timing: the pool is donated and aliased to the step's output, and where a
decode step writes by the kernel of `meshlm.kv_dma` (on a TPU, see `CacheView.write`), it writes with
no scatter, storing what the scatter stores (the kernel run in Pallas' TPU interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from meshlm import config, kv_cache, kv_dma, model, quant

CFG = config.preset("test-tiny")
ROWS, PAGES_PER_ROW, PAGE = 4, 4, 16


def step(params: model.Params, cache: kv_cache.KVCache, table: jax.Array, token: jax.Array, length: jax.Array):
    return model.decode(params, token[:, None], cache, table, length, CFG)


def jitted(**options) -> Any:
    """A decode step traced afresh: the write path is chosen when it is traced."""
    return jax.jit(lambda *args: step(*args), **options)


def arguments(kv: str = "float32") -> tuple:
    """A decode step's arguments over a pool of random keys and values (`kv` "int8": quantized, with their scales)."""
    params = jax.jit(model.init, static_argnums=0)(CFG, jax.random.key(0))
    shape = kv_cache.init_cache(CFG, ROWS * PAGES_PER_ROW + 1, PAGE).k.shape
    k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(2))
    if kv == "int8":
        (k, k_scale), (v, v_scale) = quant.absmax_int8(k), quant.absmax_int8(v)
        cache = kv_cache.KVCache(k, v, *(jnp.transpose(s, (1, 2, 0, 3)) for s in (k_scale, v_scale)))  # page-major
    else:
        cache = kv_cache.KVCache(k, v)
    table = 1 + jnp.arange(ROWS * PAGES_PER_ROW, dtype=jnp.int32).reshape(ROWS, PAGES_PER_ROW)
    token = jnp.array([3, 1, 4, 1], jnp.int32)
    length = jnp.array([0, 7, 16, 40], jnp.int32)  # a first token, mid-page, a page boundary, a later page
    return params, cache, table, token, length


@pytest.fixture
def kernel_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Write a decode step by the TPU kernel here, as on a TPU (in Pallas' TPU interpreter)."""
    monkeypatch.setattr(kv_cache, "DMA_BACKENDS", (jax.default_backend(),))
    with pltpu.force_tpu_interpret_mode():
        yield


def test_a_decode_step_donates_the_pool_and_aliases_it_to_its_output():
    args = arguments()
    compiled = jitted(donate_argnums=1).lower(*args).compile()
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(args[1]))
    assert compiled.memory_analysis().alias_size_in_bytes >= pool_bytes


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_a_decode_step_written_by_the_kernel_stores_what_the_scatter_stores(monkeypatch: pytest.MonkeyPatch, kv):
    """Keys and values (an int8 pool's scales too) stored by the DMA kernels, read back by them: the logits and
    every pool equal the scatter's and the gather's."""
    logits, cache = jitted()(*arguments(kv))
    monkeypatch.setattr(kv_cache, "DMA_BACKENDS", (jax.default_backend(),))
    with pltpu.force_tpu_interpret_mode():
        lowered = jitted(donate_argnums=1).lower(*arguments(kv))
        assert "scatter" not in lowered.as_text()  # the layout a TPU gives a scatter into the pool copies it
        kernel_logits, kernel_cache = jitted()(*arguments(kv))
    np.testing.assert_array_equal(kernel_logits, logits)
    assert len(kernel_cache) == len(cache) and kernel_cache.quantized == (kv == "int8")
    for kernel_pool, pool in zip(kernel_cache, cache, strict=True):
        np.testing.assert_array_equal(kernel_pool, pool)


@pytest.mark.bitwise_across_programs  # `slow` in a process of its own (conftest.py)
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_a_prompt_written_by_the_page_kernel_reads_back_as_the_scattered_one(monkeypatch: pytest.MonkeyPatch, kv):
    """A prefill (rows of 3, 16 and 21 tokens from slot 0, and a padding row) by `kv_dma.write_pages`, then a
    decode step over what it stored: the logits of both equal those of the scatter's."""
    params, cache, table, _, _ = arguments(kv)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (ROWS, 21)), jnp.int32)
    mask = jnp.arange(21)[None] < jnp.array([3, 16, 21, 0])[:, None]
    start = jnp.zeros(ROWS, jnp.int32)

    def prompt_then_step() -> tuple[jax.Array, jax.Array]:
        run = jax.jit(lambda *a: model.decode(*a, CFG, mask=mask, whole_pages=True))
        logits, pool = run(params, tokens, cache, table, start)
        step, _ = step_fn(params, pool, table, tokens[:, 0], mask.sum(1, dtype=jnp.int32))
        return logits, step

    step_fn = jitted()
    expected = prompt_then_step()
    monkeypatch.setattr(kv_cache, "DMA_BACKENDS", (jax.default_backend(),))
    calls = []
    monkeypatch.setattr(kv_cache, "write_pages", lambda *a: calls.append("write") or kv_dma.write_pages(*a))
    monkeypatch.setattr(kv_cache, "read_pages", lambda *a: calls.append("read") or kv_dma.read_pages(*a))
    with pltpu.force_tpu_interpret_mode():
        step_fn = jitted()
        got = prompt_then_step()
    assert {"write", "read"} <= set(calls)  # the prompt went through the page kernels, not the scatter or gather
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)


def test_a_call_that_scatters_its_keys_reads_them_back_by_the_gather(monkeypatch: pytest.MonkeyPatch):
    """Speculated tokens (a few a row, not from a page's first slot) are scattered into the pool, in a layout of
    XLA's own; reading them back by the DMA kernel, which needs the pool's, would copy the whole pool in every
    layer (found compiled for a v5e), so such a call gathers. A decode step and a whole-pages prompt use the
    kernels both ways (the tests above)."""
    params, cache, table, _, length = arguments()
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, CFG.vocab_size, (ROWS, 3)), jnp.int32)
    monkeypatch.setattr(kv_cache, "DMA_BACKENDS", (jax.default_backend(),))
    calls = []
    for name in ("read_pages", "write_pages", "write_tokens"):
        monkeypatch.setattr(kv_cache, name, lambda *a, name=name: calls.append(name) or getattr(kv_dma, name)(*a))
    with pltpu.force_tpu_interpret_mode():
        jax.jit(lambda *a: model.decode(*a, CFG)).lower(params, tokens, cache, table, length)
    assert calls == []


SCALES = 0  # `K` of a case that moves an int8 pool's scales: a pool [L, pages, H, page_size] float32


def make_pool(rng: np.random.Generator, H: int, L: int, P: int, S: int, K: int, dtype: str) -> jax.Array:
    """Keys or values [H, L, P, S, K] in `dtype` (int8: small integers), or scales [L, P, H, S] (K = SCALES)."""
    if K == SCALES:
        return jnp.asarray(rng.normal(size=(L, P, H, S)), jnp.float32)
    pool = rng.normal(size=(H, L, P, S, K)) if dtype != "int8" else rng.integers(-9, 9, (H, L, P, S, K))
    return jnp.asarray(pool, dtype)


def page_of(pool: np.ndarray, layer: int, page: Any) -> tuple:
    """numpy's index of a page of `layer` (`page` may be a list): [H, S, K] of keys or values, [H, S] of scales."""
    return (slice(None), layer, page) if pool.ndim == 5 else (layer, page)


def slot_of(pool: np.ndarray, layer: int, page: int, offset: int) -> tuple:
    """numpy's index of a token's keys [H, K] or scales [H]."""
    return (slice(None), layer, page, offset) if pool.ndim == 5 else (layer, page, slice(None), offset)


@pytest.mark.parametrize("dtype, K", [("bfloat16", 128), ("int8", 128), ("float32", SCALES)])
def test_the_read_kernel_gathers_each_rows_pages_in_table_order(kernel_writes: None, dtype: str, K: int):
    """`kv_dma.read_pages` against numpy's gather: rows whose tables repeat a page, hold page 0 (a table's unused
    entries) and list pages out of order, from a layer past the first (int8: a pool; float32: its scales).
    One device: Pallas' TPU interpreter hangs on these DMA kernels under shard_map (the write kernels' too)."""
    H, L, P, S = 2, 3, 9, 16
    pool = make_pool(np.random.default_rng(3), H, L, P, S, K, dtype)
    table = jnp.asarray([[4, 1, 8], [2, 2, 0], [0, 0, 0]], jnp.int32)
    out = jax.jit(kv_dma.read_pages)(pool, jnp.int32(2), table)
    expected = np.asarray(pool)[page_of(pool, 2, np.asarray(table))]  # [B, n, H, ...] of scales, [H, B, n, ...] else
    expected = np.moveaxis(expected, 2, 1) if K == SCALES else np.moveaxis(expected, 0, 1)
    np.testing.assert_array_equal(np.asarray(out), expected)  # [B, H, n, ...]: heads major


# pages of one DMA tile (bfloat16; int8's tile is larger than the page) and of several (bfloat16 pages of
# three tiles); an int8 pool's scales, whose tile is the page (its tokens are lanes)
@pytest.mark.parametrize(
    "dtype, K, S", [("bfloat16", 128, 16), ("int8", 128, 16), ("float32", SCALES, 16), ("bfloat16", 128, 48)]
)
def test_the_write_kernel_stores_the_written_rows_and_nothing_else(kernel_writes: None, dtype: str, K: int, S: int):
    """Rows in two groups of the kernel's grid (`kv_dma.GROUP`), one not written, slots at a page's first
    and last token and between, in each of its tiles, against numpy."""
    H, L, P, B = 2, 3, 12, 10
    rng = np.random.default_rng(0)
    pool = make_pool(rng, H, L, P, S, K, dtype)
    new = jnp.asarray(rng.normal(size=(B, H, K) if K else (B, H)) * 9, pool.dtype)
    pages = jnp.asarray(rng.permutation(np.arange(1, P))[:B], jnp.int32)  # each row its own page, never page 0
    offsets = jnp.asarray([0, S - 1, 7, S // 2, 9, 1, 14, 8, 2, S - 5], jnp.int32)
    written = jnp.asarray([True] * 4 + [False] + [True] * 5)
    out = jax.jit(kv_dma.write_tokens)(pool, new, jnp.int32(1), pages, offsets, written)
    expected = np.array(pool)
    for b in np.flatnonzero(written):
        expected[slot_of(expected, 1, pages[b], offsets[b])] = new[b]
    np.testing.assert_array_equal(np.asarray(out), expected)


# pages of one DMA tile and of half a tile (int8's tile holds 32 tokens; the chunks lie on an untiled axis)
@pytest.mark.parametrize(
    "dtype, K, S", [("bfloat16", 128, 16), ("int8", 128, 32), ("int8", 128, 16), ("float32", SCALES, 16)]
)
def test_the_page_kernel_stores_each_rows_prompt_and_touches_no_other_page(
    kernel_writes: None, dtype: str, K: int, S: int
):
    """A prefill's rows written a page at a time (`kv_dma.write_pages`): from a page's first slot, after a
    run-again token that is not written (row 1), over one, two and three pages (the last one partly), and a
    padding row that writes nothing. Each written token lands at its slot; pages no row writes, page 0
    among them, keep what they held; what a row's last page holds past its tokens is padding, never read."""
    H, L, P, T = 2, 3, 12, 2 * S + 5
    rng = np.random.default_rng(1)
    pool = make_pool(rng, H, L, P, S, K, dtype)
    new = jnp.asarray(rng.normal(size=(4, T, H, K) if K else (4, T, H)) * 9, pool.dtype)
    tables = [[3, 7, 4], [9, 2, 0], [5, 0, 0], [0, 0, 0]]  # each row's pages in order
    first, count = [0, 1, 0, 0], [T, S + 3, 4, 0]  # the first written token and how many
    written = np.zeros((4, T), bool)
    slots = np.full((4, T), kv_cache.NOT_WRITTEN, np.int32)
    for b in range(4):
        for i in range(count[b]):
            written[b, first[b] + i] = True
            slots[b, first[b] + i] = tables[b][i // S] * S + i % S
    heads_major = jnp.swapaxes(new, 1, 2)  # [B, H, T(, K)], as the kernel takes them
    write = jax.jit(kv_dma.write_pages)
    out = np.array(write(pool, heads_major, jnp.int32(1), jnp.asarray(slots), jnp.asarray(written)))
    expected = np.array(pool)
    for b, t in zip(*np.nonzero(written), strict=True):
        page, offset = divmod(int(slots[b, t]), S)
        np.testing.assert_array_equal(out[slot_of(out, 1, page, offset)], np.asarray(new[b, t]))
        expected[slot_of(expected, 1, page, offset)] = new[b, t]
    full, partly = page_of(out, 1, [3, 7, 9]), page_of(out, 1, [4, 2, 5])
    np.testing.assert_array_equal(out[full], expected[full])  # the rows' full pages
    out[partly] = expected[partly]  # partly written: past the written slots, the row's padding
    np.testing.assert_array_equal(out, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "program, kernels, heads, kv",
    [("decode", 3, "2x128", None), ("prefill", 4, "2x128", None), ("prefill", 4, "16x256", None),
     ("decode", 5, "16x256", "int8"), ("prefill", 8, "2x128", "int8"), ("mixed", 13, "16x256", "int8")],
)  # fmt: skip
def test_the_engines_programs_for_a_tpu_never_copy_the_pool(
    monkeypatch: pytest.MonkeyPatch, program, kernels, heads, kv
):
    """Ahead of time, without a chip: the engine's decode program (a loop of steps over the layer scan, the
    paged kernel reading the pool) and its prefill program compiled for a TPU v5e hold no copy of the pool and
    no scatter into it, whose layout the writes could otherwise set apart from the kernel's (a copy per layer
    and step: a step's cost grew with its rows; a prefill's rewrote the pool in every layer: 7 s to the first
    token of 16 rows of 512 for GPT-J-6B on a v5e). The mesh's TPU devices decide the write path and the
    decode kernel (`sharding.traced_backend`), as `meshlm plan --serve --target tpu:...` compiles it. An int8
    pool's scales move by the same kernels (two more each way), and Mosaic compiles its paged kernel for the chip.
    A mixed step (a prompt's chunk and a decode step in one pass) holds both kinds: the prefill's page kernels and
    the decode's token writes and paged kernel."""
    pytest.importorskip("libtpu", reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
    import re

    from meshlm import planner
    from meshlm.serve import runner
    from meshlm.serve.config import EngineConfig
    from meshlm.sharding import SERVING

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # not the lock of a libtpu in another test process
    # heads of 128 lanes, the TPU paged kernel's width; and GPT-J-6B's 16 of 256, where XLA's gather of a
    # prefill's pages split the whole pool into 128-lane halves (2 x 6.5 ms a layer at 16 rows on the chip)
    sizes = {"2x128": dict(n_head=2), "16x256": dict(n_head=16, d_model=4096, n_layer=1)}[heads]
    # a vocabulary of 1,024: the LM head holds no pool, and at GPT-J's 50,400 it was most of the compile (31 -> 22 s)
    cfg = config.preset("gptj-tiny").replace(**sizes, vocab_size=1024, n_vocab_used=1000)
    mesh = planner.target("tpu:v5e:2x2").mesh("data=1")
    policy = model.Policy(param_dtype="bfloat16", compute_dtype="bfloat16", kv_cache_dtype=kv)
    params = model.placed_params(cfg, mesh, "bfloat16", rules=SERVING)
    rows, width, page = 4, 4, EngineConfig().tokens_per_page("tpu")
    pages = rows * width + 1
    # at the highest matmul precision (the tpu tier's parity tests set it), under which Mosaic refused JAX's paged
    # kernel's float32 x bfloat16 product: meshlm's kernel names its products' precision by the query's dtype
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        lowered = runner.lower(program, cfg, policy, mesh, rows=rows, pages=pages, width=width, params=params,
                               page_size=page, length=2 * page)  # fmt: skip
        text = lowered.compile().as_text()
    # in the layer's scan: a decode step's paged kernel reads the pool; the DMA kernels store keys and values,
    # and read a prefill's pages back
    assert text.count('custom_call_target="tpu_custom_call"') == kernels
    pool = rf"\[{cfg.n_head},{cfg.n_layer},{pages},{page},{cfg.d_head}\]"
    moved = re.compile(pool + r"\{(?!4,3,2,1,0:)[^}]*\} copy(-start)?\(")  # to a layout not the kernel's
    scale_pool = rf"\[{cfg.n_layer},{pages},{cfg.n_head},{page}\]"  # an int8 pool's scales
    scales = re.compile(scale_pool + r"\{(?!3,2,1,0:)[^}]*\} copy(-start)?\(")
    copies = [line.strip()[:120] for line in text.splitlines() if moved.search(line) or scales.search(line)]
    assert not copies, copies[:2]
    parts = re.compile(rf"= \w+\[{cfg.n_head},{cfg.n_layer},{pages},{page},(?!{cfg.d_head}\])\d+\]")  # its lanes split
    split = [line.strip()[:120] for line in text.splitlines() if parts.search(line)]
    assert not split, split[:2]
    pools = f"(?:{pool}|{scale_pool})"
    scatter = re.compile(r"%scatter\S* = \w+" + pools + r"|= \w+" + pools + r"\{[^}]*\} scatter\(")  # into the pool
    scatters = [line.strip()[:120] for line in text.splitlines() if scatter.search(line)]
    assert not scatters, scatters[:2]
    # a prompt's pages, read or written, move heads major as a page holds them: token major, XLA laid each layer's
    # pages out again around the DMAs (2 x 40 us a layer of a 10-page chunk's mixed step of GPT-J-6B on a v5e)
    H, K = cfg.n_head, cfg.d_head
    relaid = re.compile(rf"\[\d+,(?:\d+,{page},{H}|{H},\d+,{page}|\d+,{H},{page}),{K}\]\{{[^}}]*\}} copy(-start)?\(")
    pages_copied = [line.strip()[:120] for line in text.splitlines() if relaid.search(line)]
    assert not pages_copied, pages_copied[:2]
    # a mixed step's new keys and values, projected for its packed row [1, N, H, K], go to the prompt's page writes
    # heads major and to the decode rows' token writes token major: laid out for one, the whole row was copied for
    # the other (in every layer; with a slow quantization on the chip)
    if program == "mixed":
        packed = re.compile(rf"\[1,{2 * page + rows},{H},{K}\]\{{[^}}]*\}} copy(-start)?\(")
        row_copied = [line.strip()[:120] for line in text.splitlines() if packed.search(line)]
        assert not row_copied, row_copied[:2]


@pytest.mark.slow
def test_zeroing_pages_on_a_tpu_holds_no_copy_of_the_pool(monkeypatch: pytest.MonkeyPatch):
    """Ahead of time for a v5e: the engine's page-zeroing program (`Runner.zero_pages`, compiled at every server's
    start) zeroes a page at a time in the donated pool, its temporaries a sliver of it. One scatter of every id held
    the pool's keys again in temporaries, and GPT-J-6B's server (a 7 GB int8 pool beside 6 GB of weights on one v5e)
    failed its start."""
    pytest.importorskip("libtpu", reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
    from meshlm import planner
    from meshlm.serve import runner
    from meshlm.sharding import SERVING, named_sharding

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    cfg = config.preset("gptj-tiny").replace(n_head=16, d_model=4096, n_layer=2)  # GPT-J-6B's heads (at 2 x 128 the
    mesh = planner.target("tpu:v5e:2x2").mesh("data=1")  # scatter needed no temporaries)
    pages = 64 + 1
    with jax.set_mesh(mesh):
        pool = jax.eval_shape(lambda: kv_cache.init_cache(cfg, pages, 128, "int8"))
        axes = (kv_cache.CACHE_AXES,) * 2 + (kv_cache.SCALE_AXES,) * 2
        pool = kv_cache.KVCache(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named_sharding(mesh, a, SERVING))
                                  for x, a in zip(pool, axes, strict=True)))  # fmt: skip
        memory = runner._zero_pages.lower(pool, jax.ShapeDtypeStruct((pages,), jnp.int32)).compile().memory_analysis()
    side = np.prod(pool.k.shape)  # bytes of the int8 keys, all devices
    assert memory.temp_size_in_bytes < side / 64, (memory.temp_size_in_bytes, side)
