"""Int8 projections stored where their products read them (issue 38).

`quant.Int8Weight` keeps a projection to heads [in, heads, head_dim] as codes [heads, in, head_dim], each head's
matrix whole: stored [in, 16 heads, 256], GPT-J-6B's q, k and v fell in the TPU's 8-row int8 tiles, and XLA copied
all their layers into 32-row tiles at every decode call (4.2 of a 16-row call's 17 ms on a v5e). The layout is the
store's alone: a weight rebuilt by `dense` is the weight quantized, in its own dimension order.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import config, model, quant


@pytest.mark.parametrize("shape, n_in", [((2, 64, 4, 32), 1), ((2, 4, 32, 64), 2), ((2, 64, 96), 1)])
def test_int8_codes_rebuild_each_weight_in_its_own_order(shape, n_in):
    """q/k/v ([layers, in, heads, head_dim]), out ([layers, heads, head_dim, out]) and an MLP weight: each rebuilt
    entry lies within half a step of its output channel's scale; a projection to heads stores its heads first."""
    w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.1, 3.0, shape[-1])
    q = quant.quantize(w, "int8", n_in)
    rebuilt = jax.vmap(lambda one: one.dense(jnp.float32))(q)
    assert rebuilt.shape == w.shape
    out_dims = shape[1 + n_in :]
    stored = (shape[0], *out_dims[:-1], *shape[1 : 1 + n_in], out_dims[-1])
    assert q.codes.shape == stored
    half_step = np.asarray(q.scale).reshape(shape[:1] + (1,) * n_in + out_dims) / 2
    assert np.all(np.abs(np.asarray(rebuilt) - np.asarray(w)) <= half_step * (1 + 1e-6))
    names = tuple("abc"[: len(shape) - 1])  # the float weight's axis names, sharded as its codes are stored
    inputs, outputs = names[:n_in], names[n_in:]
    axes = quant.quantized_axes(("layers", *names), shape, "int8", n_in)
    assert axes.codes == ("layers", *outputs[:-1], *inputs, outputs[-1])


@pytest.mark.slow
def test_a_tpus_decode_reads_int8_projections_where_they_lie(monkeypatch: pytest.MonkeyPatch):
    """Ahead of time for a v5e, GPT-J-6B's 16 heads of 256 over 4 layers with int8 projections: the engine's decode
    program copies no projection's codes (a stacked [layers, 4096, 16, 256] q, k and v were each copied to another
    layout before the loop of steps)."""
    pytest.importorskip("libtpu", reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
    from meshlm import planner
    from meshlm.serve import runner
    from meshlm.serve.config import EngineConfig
    from meshlm.sharding import SERVING, plan, with_shardings

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    cfg = config.preset("gptj-tiny").replace(n_head=16, d_model=4096, n_layer=4, vocab_size=1024, n_vocab_used=1000)
    mesh = planner.target("tpu:v5e:2x2").mesh("data=1")
    policy = model.Policy(param_dtype="bfloat16", compute_dtype="bfloat16", kv_cache_dtype="int8")
    params = model.abstract_params(cfg, "bfloat16", "int8")
    params = with_shardings(params, plan(params, model.logical_axes(cfg, "int8"), mesh, SERVING))
    page = EngineConfig().tokens_per_page("tpu")
    with jax.set_mesh(mesh):
        lowered = runner.lower("decode", cfg, policy, mesh, rows=16, pages=65, width=4, params=params,
                               page_size=page, length=2 * page)  # fmt: skip
        text = lowered.compile().as_text()
    copies = re.findall(r"copy(?:-start)?\(%weights_params__layers\w+codes", text)
    assert not copies, copies
