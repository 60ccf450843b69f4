"""The attention resolver (`meshlm.attention.resolve`) and the TPU splash kernel, which runs here in
Pallas' interpreter and must give what XLA's attention gives, forward and gradient: causal, packed
documents apart by segment ids, and GPT-Neo's local windows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import model
from meshlm.attention import dense, mesh_shards, resolve, splash
from meshlm.config import ModelConfig, Policy

# Shapes the splash kernel tiles (128 tokens is its smallest block), kept tiny otherwise: the interpreter is slow.
T = 128
BASE = dict(n_layer=2, d_model=32, n_head=2, d_ff=64, rotary_dim=8, vocab_size=64, n_vocab_used=64, max_seq_len=T)
CONFIGS = {
    "causal": ModelConfig(**BASE),
    # GPT-Neo's layout: sequential blocks, learned positions, global and local layers, no score scaling
    "local": ModelConfig(
        **{**BASE, "rotary_dim": 0},
        residual="sequential",
        position="learned",
        attention_layers=("global", "local"),
        local_window=24,
        scale_attn=False,
        tie_embeddings=True,
        head_bias=False,
    ),
}


def shape(**overrides):
    return dict(phase="train", kind="global", batch=2, q_len=2048, kv_len=2048, heads=16, head_dim=128) | overrides


def test_the_resolver_picks_xla_on_a_cpu_and_splash_on_a_tpu():
    cpu = resolve(**shape(), dtype="float32", backend="cpu")
    assert cpu.name == "xla"
    tpu = resolve(**shape(), dtype="bfloat16", backend="tpu")
    assert (tpu.name, tpu.interpret, tpu.block) == ("splash", False, 512)
    assert resolve(**shape(kind="local"), dtype="bfloat16", backend="tpu").name == "splash"
    forced = resolve(**shape(), dtype="float32", backend="cpu", impl="splash")
    assert (forced.name, forced.interpret) == ("splash", True)


def test_a_tpu_decode_step_reads_the_pool_in_place_only_for_heads_of_whole_lanes():
    """The TPU paged kernel serves head sizes of a multiple of 128 (GPT-J's 256, Pythia-1b's 256), the ones
    measured on a chip: a head of 64 (Pythia-70m, GPT-Neo-125m) compiles alone, but a pool of them (bf16 or int8)
    takes a layout of XLA's own that the kernel's call copies whole, so its pool is gathered instead."""
    decode = dict(phase="decode", kind="global", q_len=1, kv_len=512, heads=16, dtype="bfloat16", backend="tpu")
    assert resolve(**decode, head_dim=256).name == "paged_tpu"
    small = resolve(**decode, head_dim=64)
    assert small.name == "xla" and "multiple of 128" in small.reason


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (dict(biased=True), "additive bias"),
        (dict(q_len=100, kv_len=100), "not a multiple of 128"),
        (dict(shards=(1, 3)), "do not split evenly"),
        (dict(phase="prefill", kv_len=4096), "each row's own length"),
    ],
)
def test_where_splash_cannot_serve_the_resolver_falls_back_to_xla_and_says_why(overrides, why):
    kernel = resolve(**shape(**overrides), dtype="bfloat16", backend="tpu")
    assert kernel.name == "xla"
    assert why in kernel.reason


def test_decode_steps_take_the_paged_kernels_where_they_serve():
    decode = shape(phase="decode", q_len=1, kv_len=4096)
    assert resolve(**decode, dtype="bfloat16", backend="tpu").name == "paged_tpu"
    assert "bfloat16 and int8 pools" in resolve(**decode, dtype="float32", backend="tpu").reason
    assert resolve(**decode, dtype="int8", backend="tpu").name == "paged_tpu"
    assert resolve(**decode, dtype="bfloat16", backend="gpu").name == "paged_gpu"
    assert resolve(**decode, dtype="float32", backend="cpu").name == "xla"
    assert resolve(**decode, dtype="float32", backend="cpu", impl="pallas").interpret
    assert resolve(**{**decode, "kind": "local"}, dtype="bfloat16", backend="tpu").name == "xla"
    assert resolve(**decode, dtype="bfloat16", backend="gpu", biased=True).name == "cudnn"


def test_a_t5_model_runs_on_xla_even_where_splash_is_asked():
    cfg = ModelConfig(**{**BASE, "rotary_dim": 0}, position="t5")
    kernels = model.attention_kernels(cfg, Policy(attention="splash"), (2, T), T, biased=True, cached=False)
    assert kernels["global"].name == "xla"
    assert "t5" in kernels["global"].reason


@pytest.mark.parametrize("case", ["causal", "segments", "local", "local_segments"])
def test_splash_in_the_interpreter_equals_xla_forward_and_gradient(case):
    """The kernel alone: splash (interpreted) against XLA's attention over the same mask, its output and
    the gradients of q, k and v; segments: three documents per row, which must never see each other."""
    B, H, K, window = 2, 2, 16, (24 if case.startswith("local") else 0)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cotangent = (jax.random.normal(key, (B, T, H, K)) for key in keys)
    segments = None
    if case.endswith("segments"):
        segments = jnp.asarray([[1] * 40 + [2] * 50 + [3] * 38, [1] * 100 + [2] * 28], jnp.int32)
    allowed = model.causal_mask(None, B, T, segments)
    if window:
        allowed &= jnp.arange(T)[:, None] - jnp.arange(T)[None, :] < window
    splash_kernel = resolve(**shape(batch=B, q_len=T, kv_len=T, heads=H), dtype="float32", impl="splash")
    xla_kernel = resolve(**shape(batch=B, q_len=T, kv_len=T, heads=H), dtype="float32", impl="xla")

    def run(kernel):
        def f(q, k, v):
            if kernel.name == "splash":
                out = splash(kernel, q, k, v, segments, 0.25, window)
            else:
                out = dense(kernel, q, k, v, allowed, None, 0.25)
            return (out * cotangent).sum(), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, got), got_grads = run(splash_kernel)
    (_, want), want_grads = run(xla_kernel)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.slow
def test_a_packed_gpt_neo_trains_alike_under_splash_and_xla():
    """The whole model (GPT-Neo's global and local layers, documents packed in rows): loss and every
    parameter's gradient, splash (interpreted) against XLA."""
    cfg = CONFIGS["local"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T + 1)), jnp.int32)
    segments = jnp.asarray([[1] * 40 + [2] * 50 + [3] * 39, [1] * 100 + [2] * 29], jnp.int32)
    kernels = model.attention_kernels(cfg, Policy(attention="splash"), (2, T), T, biased=False, cached=False)
    assert {k.name for k in kernels.values()} == {"splash"}
    params = model.init(cfg, jax.random.key(0))

    def loss_and_grads(attention):
        policy = Policy(attention=attention)
        return jax.jit(jax.value_and_grad(lambda p: model.loss(p, tokens, cfg, policy, segments=segments)[0]))(params)

    want, want_grads = loss_and_grads("xla")
    got, got_grads = loss_and_grads("splash")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=model.param_name(path))


def test_packed_documents_never_see_each_other_under_splash():
    """Changing the first document of a packed row leaves the second's logits as they were."""
    cfg = CONFIGS["local"]
    policy = Policy(attention="splash")
    segments = jnp.asarray([[1] * 64 + [2] * 64], jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    params = model.init(cfg, jax.random.key(1))
    run = jax.jit(lambda t: model.hidden_states(params, t, cfg, policy, segments=segments))
    changed = tokens.at[:, :64].set((tokens[:, :64] + 1) % cfg.vocab_size)
    np.testing.assert_allclose(run(changed)[:, 64:], run(tokens)[:, 64:], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_splash_compiles_for_a_tpu_v5e_with_its_gradient(head_dim, monkeypatch):
    """Ahead of time, without a chip: the kernel, with segment ids and a local window, and its backward
    pass lower through Mosaic for a TPU v5e at sequence 2048, for the family's head sizes (Pythia's 64 and
    80, GPT-J's 256)."""
    pytest.importorskip("libtpu", reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from meshlm.attention import Kernel

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # not the lock of a libtpu in another test process
    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    kernel = Kernel("splash", "ahead of time", block=512)
    on_tpu = SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((2, 2048, 4, head_dim), jnp.bfloat16, sharding=on_tpu)
    ids = jax.ShapeDtypeStruct((2, 2048), jnp.int32, sharding=on_tpu)

    def grads(q, k, v, ids):
        loss = lambda q, k, v: splash(kernel, q, k, v, ids, 0.125, 256).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    compiled = jax.jit(grads).trace(x, x, x, ids).lower(lowering_platforms=("tpu",)).compile()
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.slow
def test_a_decode_step_of_global_and_local_layers_reads_the_pool_by_kernel_and_window():
    """GPT-Neo's layout with `attention: pallas`: global layers read the pool in place (the GPU paged kernel,
    interpreted), local ones a gathered copy within their window; the logits equal XLA's for both."""
    from meshlm import kv_cache

    cfg = CONFIGS["local"]
    params = model.init(cfg, jax.random.key(2))
    page, pages = 16, 4
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 40)), jnp.int32)
    kernels = model.attention_kernels(cfg, Policy(attention="pallas"), (1, 1), pages * page, False, cached=True)
    assert (kernels["global"].name, kernels["local"].name) == ("paged_gpu", "xla")

    def next_logits(attention):
        policy = Policy(attention=attention)
        cache = kv_cache.init_cache(cfg, pages + 1, page)
        _, cache = model.decode(params, prompt, cache, table, jnp.zeros((1,), jnp.int32), cfg, policy)
        token = prompt[:, -1:]
        logits, _ = model.decode(params, token, cache, table, jnp.full((1,), 40, jnp.int32), cfg, policy)
        return logits

    np.testing.assert_allclose(next_logits("pallas"), next_logits("xla"), atol=2e-5, rtol=1e-5)


def test_splash_runs_per_shard_under_a_mesh():
    """Rows split over data and fsdp, heads over model: each shard runs the kernel on its own rows and heads,
    and the whole equals XLA's attention."""
    from meshlm.sharding import make_mesh

    B, H, K, window = 4, 2, 16, 24
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (B, T, H, K)) for key in keys)
    segments = jnp.asarray(np.repeat([[1, 2], [1, 1], [2, 3], [1, 2]], T // 2, axis=1), jnp.int32)
    allowed = model.causal_mask(None, B, T, segments) & (jnp.arange(T)[:, None] - jnp.arange(T)[None, :] < window)
    want = dense(resolve(**shape(batch=B, q_len=T, kv_len=T, heads=H), dtype="float32", impl="xla"),
                 q, k, v, allowed, None, 0.25)  # fmt: skip
    with jax.set_mesh(make_mesh("data=2,fsdp=2,model=2")):
        assert mesh_shards() == (4, 2)
        kernel = resolve(**shape(batch=B, q_len=T, kv_len=T, heads=H), dtype="float32", impl="splash", shards=(4, 2))
        got = jax.jit(lambda q, k, v: splash(kernel, q, k, v, segments, 0.25, window))(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
