"""An int8 KV pool (issue 38): keys and values stored as int8 with a float32 scale per token and head, half a
bfloat16 pool's bytes. Each vector rounds to half a step of its largest entry, both paged kernels read the
pool as the gather path does, and a model decodes over it as over a float pool, to within the rounding's
stated effect on the log-probabilities."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import config, kv_cache, model, quant
from meshlm.serve.config import EngineConfig
from tests.helpers.quantized import drift


def test_quantize_rounds_each_vector_to_half_a_step():
    x = jax.random.normal(jax.random.key(0), (3, 5, 64)) * jnp.asarray([0.01, 1.0, 300.0])[:, None, None]
    x = x.at[0, 0].set(0.0)  # a zero vector: scale 0, and no NaN
    q, scale = quant.absmax_int8(x)
    assert q.dtype == jnp.int8 and int(jnp.abs(q.astype(jnp.int32)).max()) == 127 and scale.shape == (3, 5)
    back = kv_cache.dequantize(q, scale, jnp.float32)
    step = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    assert bool(jnp.all(jnp.abs(back - x) <= step / 2 * (1 + 1e-6)))
    np.testing.assert_allclose(back, q.astype(np.float32) * np.asarray(scale)[..., None], rtol=1e-6, atol=0)
    assert not np.asarray(back[0, 0]).any()


def bytes_per_token(cfg: config.ModelConfig, dtype: str) -> int:
    """One token's keys and values over all layers and heads: `dtype`'s bytes each, or one byte each and a
    float32 scale per head for int8."""
    vectors = 2 * cfg.n_layer * cfg.n_head
    return vectors * (cfg.d_head + 4) if dtype == "int8" else vectors * cfg.d_head * np.dtype(dtype).itemsize


def test_an_int8_pool_takes_half_the_bytes_of_bfloat16_and_a_scale():
    cfg = config.preset("gptj-6b")
    pool_bytes = lambda dtype: sum(x.nbytes for x in jax.tree.leaves(kv_cache.init_cache(cfg, 1, 1, dtype)))
    int8, bf16 = pool_bytes("int8"), pool_bytes("bfloat16")
    assert bf16 == bytes_per_token(cfg, "bfloat16") == 2 * 28 * 16 * 256 * 2
    assert int8 == bytes_per_token(cfg, "int8") == bf16 // 2 + 2 * 28 * 16 * 4


def test_zeroing_pages_zeroes_their_keys_values_and_scales_in_every_layer():
    """A failed row's pages are zeroed before they are handed out again (`Runner.zero_pages`): in an int8 pool their
    scales too, which lie page-major; an id past the pool is dropped."""
    cache = kv_cache.init_cache(config.preset("test-tiny"), 6, 4, "int8")
    cache = kv_cache.KVCache(*(jnp.ones_like(x) for x in cache)).zero_pages(jnp.asarray([2, 4, 6]))
    for pool in cache[:2]:  # [H, L, pages, page_size, K]
        assert not np.asarray(pool[:, :, [2, 4]]).any() and np.asarray(pool[:, :, [0, 1, 3, 5]]).all()
    for scales in cache[2:]:  # [L, pages, H, page_size]
        assert not np.asarray(scales[:, [2, 4]]).any() and np.asarray(scales[:, [0, 1, 3, 5]]).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel, mesh, dtype, head_group",
    [("gpu", None, "float32", None), ("tpu", None, "float32", None), ("tpu", None, "bfloat16", None),
     ("tpu", None, "float32", 3),  # the TPU kernel's heads in groups of 3 and 1
     ("gpu", "data=2,fsdp=2,model=2", "float32", None), ("tpu", "data=2,fsdp=2,model=2", "float32", None)],
)  # fmt: skip
def test_the_paged_kernels_read_an_int8_pool_as_the_gather_path(kernel, mesh, dtype, head_group, monkeypatch):
    """Rows of one token, a whole page, a page and one, two pages, none: each kernel's output equals softmax(q k) v over
    the dequantized pages gathered in table order (float32 queries: to rounding; bfloat16: to its 8 bits). A table's
    entries past its row's length name page 0, whose scales are NaN here (a failed row's page may hold NaN): no kernel
    may let it through. meshlm's TPU kernel gives a row of no tokens zeros, and keeps out NaN scales past a row's length
    inside its last page too."""
    from jax.experimental.pallas import tpu as pltpu

    from meshlm import paged_attention as module
    from meshlm.paged_attention import paged_attention
    from meshlm.sharding import make_mesh

    if head_group:
        monkeypatch.setattr(module, "HEAD_GROUP", head_group)

    B, H, K, pages, size = 8, 4, 128, 20, 16
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (B, H, K)) / np.sqrt(K)
    (k, ks), (v, vs) = (quant.absmax_int8(jax.random.normal(key, (H, pages, size, K))) for key in keys[1:])
    ks, vs = (s.at[:, 0].set(jnp.nan) for s in (ks, vs))
    lengths = jnp.asarray([1, 16, 17, 32, 0, 5, 20, 31], jnp.int32)
    table = np.random.default_rng(1).permutation(np.arange(1, pages))[: B * 2].reshape(B, 2)
    table[np.arange(2)[None] * size >= np.asarray(lengths)[:, None]] = 0  # past the row's length: page 0
    if kernel == "tpu":  # meshlm's kernel also keeps out a NaN past the length inside a row's last page
        for row, length in enumerate(np.asarray(lengths)):
            if length % size:
                ks, vs = (s.at[:, table[row, length // size], length % size :].set(jnp.nan) for s in (ks, vs))
    table = jnp.asarray(table, jnp.int32)
    held = jnp.arange(2 * size)[None, :, None, None] < lengths[:, None, None, None]
    gathered = [jnp.moveaxis(kv_cache.dequantize(x[:, table], s[:, table], jnp.float32).reshape(H, B, 2 * size, K),
                             0, 2) for x, s in ((k, ks), (v, vs))]  # fmt: skip
    scores = jnp.einsum("bhk,bshk->bhs", q, jnp.where(held, gathered[0], 0))
    scores = jnp.where(jnp.arange(2 * size) < lengths[:, None, None], scores, -jnp.inf)
    expected = jnp.einsum("bhs,bshk->bhk", jax.nn.softmax(scores, -1), jnp.where(held, gathered[1], 0))
    ks, vs = (jnp.swapaxes(s, 0, 1) for s in (ks, vs))  # as the pool keeps them: [pages, H, page_size]
    attend = jax.jit(lambda q, k, v, table, lengths, ks, vs: paged_attention(q, k, v, table, lengths, kernel, ks, vs))
    interpreted = pltpu.force_tpu_interpret_mode() if kernel == "tpu" else contextlib.nullcontext()
    with interpreted, jax.set_mesh(make_mesh(mesh)) if mesh else contextlib.nullcontext():
        got = attend(q.astype(dtype), k, v, table, lengths, ks, vs)
    tolerance = 2e-2 if dtype == "bfloat16" else 2e-5
    rows = np.asarray(lengths) > 0
    got = np.asarray(got, np.float32)
    np.testing.assert_allclose(got[rows], np.asarray(expected)[rows], atol=tolerance, rtol=0)
    if kernel == "tpu":
        assert not got[~rows].any()


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_a_model_decodes_over_an_int8_pool_as_over_a_float_pool(attention):
    """A fixed text's log-probabilities, prompt by prefill then token by token, differ from the float32
    pool's by less than LOGPROB_TOLERANCE: int8 keeps each key and value to 0.4% of its vector's largest
    entry (measured: 5.6e-4 at most, with either kernel)."""
    cfg = config.preset("test-tiny")
    policy = config.Policy(attention=attention)
    params = jax.jit(model.init, static_argnums=0)(cfg, jax.random.key(3))
    text = jnp.asarray(np.random.default_rng(3).integers(0, cfg.n_vocab_used, (2, 40)), jnp.int32)
    table = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)

    def logprobs(dtype: str) -> np.ndarray:
        cache = kv_cache.init_cache(cfg, 7, 16, dtype)
        logits, cache = model.decode(params, text[:, :24], cache, table, jnp.zeros(2, jnp.int32), cfg, policy)
        steps = [logits]
        for t in range(24, 39):
            logits, cache = model.decode(params, text[:, t : t + 1], cache, table, jnp.full(2, t), cfg, policy)
            steps.append(logits)
        lp = jax.nn.log_softmax(jnp.concatenate(steps, axis=1)[..., : cfg.n_vocab_used], -1)
        return np.asarray(jnp.take_along_axis(lp, text[:, 1:, None], -1)[..., 0])

    exact, int8 = logprobs("float32"), logprobs("int8")
    assert np.abs(exact - int8).max() < LOGPROB_TOLERANCE
    assert np.abs(exact - int8).max() > 0  # it is the int8 pool that was read


LOGPROB_TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def lm(hf_tiny):
    import meshlm

    return meshlm.load(hf_tiny.path)


ENGINE_TOLERANCE = 3e-2
TOKEN_AGREEMENT = 0.5  # measured 0.75: once one greedy token differs, the rest of that row follows another text


@pytest.mark.slow
def test_an_engine_on_an_int8_cache_serves_what_a_float_cache_serves(lm):
    """`lm.engine(kv_cache_dtype="int8")` (`meshlm serve --kv-cache-dtype int8`): its pool takes a quarter of the
    float32 pool's bytes plus a scale per head and token. Over the float32 cache's greedy texts, its prompt
    logprobs are within ENGINE_TOLERANCE (this model's heads are 16 wide, so each vector's rounding weighs
    more than at test-tiny's 64), and its own greedy tokens agree at TOKEN_AGREEMENT of the positions."""
    float_engine, int8_engine = lm.engine(max_batch=4), lm.engine(max_batch=4, kv_cache_dtype="int8")
    cfg = lm.config
    assert int8_engine.kv_bytes_per_token() == bytes_per_token(cfg, "int8")
    assert float_engine.kv_bytes_per_token() == bytes_per_token(cfg, "float32")
    [(agreement, gap)] = drift(float_engine, int8_engine)
    assert int8_engine.runner.cache.k.dtype == jnp.int8
    print(f"greedy agreement {agreement:.3f}, largest logprob gap {gap:.4f}")
    assert 0 < gap < ENGINE_TOLERANCE
    assert agreement >= TOKEN_AGREEMENT


def test_the_planner_counts_an_int8_cache():
    """`meshlm plan --serve --kv-cache-dtype int8`: each row's cache is a quarter of float32's, plus its scales.
    The planner counts the cache from the shapes before it compiles anything: the CPU target here is made an
    estimated one (as a GPU's, without its devices), which skips the four compiles whose footprints this test
    never read. (int8 pools' programs are compiled by the engine test above on the CPU, and by `runner.lower` for
    a TPU in tests/test_kv_in_place.py.)"""
    import dataclasses

    from meshlm import planner

    cfg, cpu = config.preset("test-tiny"), planner.target("cpu")
    mesh = cpu.mesh("data=1")
    tgt = dataclasses.replace(cpu, devices=None)
    assert tgt.estimated and tgt.platform == "cpu"  # the CPU's page size, the shapes' count
    engine = EngineConfig(max_len=128)
    fits = {d: [planner.fit_serve(cfg, tgt, mesh, engine.replace(max_batch=n, kv_cache_dtype=d), "float32", None)
                for n in (1, 3)] for d in (None, "int8")}  # fmt: skip
    per_row = {d: (three.cache - one.cache) / 2 for d, (one, three) in fits.items()}
    values = 128 * 2 * cfg.n_layer * cfg.n_head * cfg.d_head  # a row's keys and values
    scales = values // cfg.d_head * 4
    assert per_row[None] - per_row["int8"] == pytest.approx(values * 3 - scales, rel=0.02)
