"""A decode step writes its keys and values into the paged pool in place (issue 38).

A step that copied the pool would cost in proportion to the pool, so to its rows. These tests read the
program XLA compiles, not a timing: the pool is donated and aliased to the step's output, and where a
decode step writes by the kernel of `meshlm.kv_write` (on a TPU, see `CacheView.write`), it writes with
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

from meshlm import config, kv_cache, kv_write, model

CFG = config.preset("test-tiny")
ROWS, PAGES_PER_ROW, PAGE = 4, 4, 16


def step(params: model.Params, cache: kv_cache.KVCache, table: jax.Array, token: jax.Array, length: jax.Array):
    return model.decode(params, token[:, None], cache, table, length, CFG)


def jitted(**options) -> Any:
    """A decode step traced afresh: the write path is chosen when it is traced."""
    return jax.jit(lambda *args: step(*args), **options)


def arguments() -> tuple:
    params = jax.jit(model.init, static_argnums=0)(CFG, jax.random.key(0))
    cache = kv_cache.init_cache(CFG, ROWS * PAGES_PER_ROW + 1, PAGE)
    cache = kv_cache.KVCache(*(jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(cache[:2])))
    table = 1 + jnp.arange(ROWS * PAGES_PER_ROW, dtype=jnp.int32).reshape(ROWS, PAGES_PER_ROW)
    token = jnp.array([3, 1, 4, 1], jnp.int32)
    length = jnp.array([0, 7, 16, 40], jnp.int32)  # a first token, mid-page, a page boundary, a later page
    return params, cache, table, token, length


@pytest.fixture
def kernel_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Write a decode step by the TPU kernel here, as on a TPU (in Pallas' TPU interpreter)."""
    monkeypatch.setattr(kv_cache, "KERNEL_WRITE_BACKENDS", (jax.default_backend(),))
    with pltpu.force_tpu_interpret_mode():
        yield


def test_a_decode_step_donates_the_pool_and_aliases_it_to_its_output():
    args = arguments()
    compiled = jitted(donate_argnums=1).lower(*args).compile()
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(args[1]))
    assert compiled.memory_analysis().alias_size_in_bytes >= pool_bytes


def test_a_decode_step_written_by_the_kernel_stores_what_the_scatter_stores(monkeypatch: pytest.MonkeyPatch):
    logits, cache = jitted()(*arguments())
    monkeypatch.setattr(kv_cache, "KERNEL_WRITE_BACKENDS", (jax.default_backend(),))
    with pltpu.force_tpu_interpret_mode():
        lowered = jitted(donate_argnums=1).lower(*arguments())
        assert "scatter" not in lowered.as_text()  # the layout a TPU gives a scatter into the pool copies it
        kernel_logits, kernel_cache = jitted()(*arguments())
    np.testing.assert_array_equal(kernel_logits, logits)
    for kernel_pool, pool in zip(kernel_cache, cache, strict=True):
        np.testing.assert_array_equal(kernel_pool, pool)


# pages of one DMA tile (bfloat16; int8's tile is larger than the page) and of several (float32: an int8
# pool's scales; bfloat16 pages of three tiles)
@pytest.mark.parametrize(
    "dtype, K, S", [("bfloat16", 128, 16), ("int8", 128, 16), ("float32", 1, 16), ("bfloat16", 128, 48)]
)
def test_the_write_kernel_stores_the_written_rows_and_nothing_else(kernel_writes: None, dtype: str, K: int, S: int):
    """Rows in two groups of the kernel's grid (`kv_write.GROUP`), one not written, slots at a page's first
    and last token and between, in each of its tiles, against numpy."""
    H, L, P, B = 2, 3, 12, 10
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(H, L, P, S, K)).astype(dtype) if dtype != "int8" else rng.integers(-9, 9, (H, L, P, S, K))
    pool = jnp.asarray(pool, dtype)
    new = jnp.asarray(rng.normal(size=(B, H, K)) * 9, dtype)
    pages = jnp.asarray(rng.permutation(np.arange(1, P))[:B], jnp.int32)  # each row its own page, never page 0
    offsets = jnp.asarray([0, S - 1, 7, S // 2, 9, 1, 14, 8, 2, S - 5], jnp.int32)
    written = jnp.asarray([True] * 4 + [False] + [True] * 5)
    out = jax.jit(kv_write.write_tokens)(pool, new, jnp.int32(1), pages, offsets, written)
    expected = np.array(pool)
    for b in np.flatnonzero(written):
        expected[:, 1, pages[b], offsets[b]] = new[b]
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.slow
def test_the_engines_decode_program_for_a_tpu_never_copies_the_pool(monkeypatch: pytest.MonkeyPatch):
    """Ahead of time, without a chip: the engine's decode program (a loop of steps over the layer scan, the
    paged kernel reading the pool) compiled for a TPU v5e holds no copy of the pool, whose layout the writes
    could otherwise set apart from the kernel's (a copy per layer and step: a step's cost grew with its rows).
    The mesh's TPU devices decide the write path and the decode kernel (`sharding.traced_backend`), as
    `meshlm plan --serve --target tpu:...` compiles it."""
    pytest.importorskip("libtpu", reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
    import re

    from meshlm import planner
    from meshlm.serve import runner
    from meshlm.serve.config import EngineConfig
    from meshlm.sharding import SERVING, plan, with_shardings

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # not the lock of a libtpu in another test process
    cfg = config.preset("gptj-tiny").replace(n_head=2)  # heads of 128: the TPU paged kernel's lane width
    mesh = planner.target("tpu:v5e:2x2").mesh("data=1")
    policy = model.Policy(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = model.abstract_params(cfg, "bfloat16")
    params = with_shardings(params, plan(params, model.logical_axes(cfg), mesh, SERVING))
    rows, width, page = 4, 4, EngineConfig().tokens_per_page("tpu")
    pages = rows * width + 1
    with jax.set_mesh(mesh):
        lowered = runner.lower("decode", cfg, policy, mesh, rows=rows, pages=pages, width=width, params=params,
                               page_size=page)  # fmt: skip
        text = lowered.compile().as_text()
    # in the layer's scan: the paged kernel reads the pool, the write kernel stores its keys and values
    assert text.count('custom_call_target="tpu_custom_call"') == 3
    pool = rf"\[{cfg.n_head},{cfg.n_layer},{pages},{page},{cfg.d_head}\]"
    moved = re.compile(pool + r"\{(?!4,3,2,1,0:)[^}]*\} copy(-start)?\(")  # to a layout not the kernel's
    copies = [line.strip()[:120] for line in text.splitlines() if moved.search(line)]
    assert not copies, copies[:2]
