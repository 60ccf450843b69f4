"""Int8 projections stored where their products read them (issue 38).

On a TPU `quant.Int8Weight` keeps a projection to heads [in, heads, head_dim] as codes [heads, in, head_dim], each
head's matrix whole: stored [in, 16 heads, 256], GPT-J-6B's q, k and v fell in the TPU's 8-row int8 tiles, and XLA
copied all their layers into 32-row tiles at every decode call (4.2 of a 16-row call's 17 ms on a v5e). Elsewhere
they keep the weight's order. The layout is the store's alone: a weight rebuilt by `dense` is the weight quantized,
in its own dimension order.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import config, model, quant


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("shape, n_in", [((2, 64, 4, 32), 1), ((2, 4, 32, 64), 2), ((2, 64, 96), 1)])
def test_int8_codes_rebuild_each_weight_in_its_own_order(shape, n_in, heads_first):
    """q/k/v ([layers, in, heads, head_dim]), out ([layers, heads, head_dim, out]) and an MLP weight, their codes
    stored in either order: each rebuilt entry lies within half a step of its output channel's scale, and the axis
    names that shard the codes follow their order."""
    w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.1, 3.0, shape[-1])
    q = quant.quantize(w, "int8", n_in, heads_first)
    rebuilt = jax.vmap(lambda one: one.dense(jnp.float32))(q)
    assert rebuilt.shape == w.shape
    out_dims = shape[1 + n_in :]
    assert q.codes.shape == ((shape[0], *out_dims[:-1], *shape[1 : 1 + n_in], out_dims[-1]) if heads_first else shape)
    half_step = np.asarray(q.scale).reshape(shape[:1] + (1,) * n_in + out_dims) / 2
    assert np.all(np.abs(np.asarray(rebuilt) - np.asarray(w)) <= half_step * (1 + 1e-6))
    names = tuple("abc"[: len(shape) - 1])  # the float weight's axis names
    inputs, outputs = names[:n_in], names[n_in:]
    axes = quant.quantized_axes(("layers", *names), shape, "int8", n_in, heads_first)
    assert axes.codes == (("layers", *outputs[:-1], *inputs, outputs[-1]) if heads_first else ("layers", *names))


def test_int8_codes_are_stored_heads_first_only_for_a_tpu():
    """A CPU's products read [in, heads x head_dim] as one matrix: heads first would transpose every layer's codes
    at every step there. A mesh of TPU chips (here a topology's, ahead of time) stores them heads first."""
    pytest.importorskip("libtpu", reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
    from meshlm import planner
    from meshlm.sharding import make_mesh

    cfg = config.preset("test-tiny")
    with jax.set_mesh(make_mesh("data=1", jax.devices("cpu")[:1])):  # a CPU mesh, whatever the default backend
        assert not model.projection(model.abstract_params(cfg, "float32", "int8"), "q").heads_first
    with jax.set_mesh(planner.target("tpu:v5e:2x2").mesh("data=1")):
        assert model.projection(model.abstract_params(cfg, "float32", "int8"), "q").heads_first


@pytest.mark.slow
def test_a_tpus_decode_reads_int8_projections_where_they_lie(monkeypatch: pytest.MonkeyPatch):
    """Ahead of time for a v5e, GPT-J-6B's 16 heads of 256 over 4 layers with int8 projections: the engine's decode
    program copies no projection's codes (a stacked [layers, 4096, 16, 256] q, k and v were each copied to another
    layout before the loop of steps), nor with w8a8's, whose int8 by int8 products take the codes as they lie."""
    pytest.importorskip("libtpu", reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
    from meshlm import planner
    from meshlm.serve import runner
    from meshlm.serve.config import EngineConfig
    from meshlm.sharding import SERVING, plan, with_shardings

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    cfg = config.preset("gptj-tiny").replace(n_head=16, d_model=4096, n_layer=4, vocab_size=1024, n_vocab_used=1000)
    mesh = planner.target("tpu:v5e:2x2").mesh("data=1")
    policy = model.Policy(param_dtype="bfloat16", compute_dtype="bfloat16", kv_cache_dtype="int8")
    page = EngineConfig().tokens_per_page("tpu")

    def copies_of_codes(heads_first: bool, kind: str = "int8") -> list[str]:
        with jax.set_mesh(mesh):
            params = model.abstract_params(cfg, "bfloat16", kind, heads_first)
            axes = model.logical_axes(cfg, kind, heads_first)
            params = with_shardings(params, plan(params, axes, mesh, SERVING))
            lowered = runner.lower("decode", cfg, policy, mesh, rows=16, pages=65, width=4, params=params,
                                   page_size=page, length=2 * page)  # fmt: skip
            text = lowered.compile().as_text()
        return re.findall(r"copy(?:-start)?\(%weights_params__layers\w+codes", text)

    assert len(copies_of_codes(False)) == 3  # q, k and v in the weight's order: what the check finds
    assert not copies_of_codes(True)
    assert not copies_of_codes(True, "w8a8")
