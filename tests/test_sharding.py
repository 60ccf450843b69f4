"""Every mesh of 8 simulated devices gives the single-device numbers, with parameters really sharded."""

import jax
import numpy as np
import pytest

import meshlm
from meshlm import ConfigError, model, sharding
from meshlm.serve.params import SamplingParams

MESHES = [
    "data=8",
    "fsdp=8",
    "data=2,model=4",
    "model=4,fsdp=2",  # axes in another order than the mesh's
    "data=2,fsdp=2,model=2",
    "fsdp=4,model=2",
    "data=4,fsdp=2",
]
CFG = meshlm.ModelConfig(
    n_layer=2, d_model=64, n_head=4, d_ff=128, rotary_dim=8, vocab_size=256, n_vocab_used=250, max_seq_len=64
)
TOKENS = np.random.default_rng(0).integers(0, 250, (8, 33))


def logits_and_grads(mesh_spec):
    lm = meshlm.from_config(CFG, mesh=mesh_spec, seed=3)
    grad_fn = jax.jit(jax.grad(lambda p, t: model.loss(p, t, CFG)[0]))
    with jax.set_mesh(lm.mesh):
        grads = grad_fn(lm.params, TOKENS)
    return lm, lm.logits(TOKENS[:, :-1]), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def single_device():
    return logits_and_grads(None)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_mesh_gives_single_device_logits_and_gradients(mesh_spec, single_device):
    _, ref_logits, ref_grads = single_device
    lm, logits, grads = logits_and_grads(mesh_spec)
    assert lm.mesh.devices.size == 8
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5 * np.abs(ref_logits).max(), rtol=0)
    flat_ref = jax.tree.leaves(ref_grads)
    for g, r in zip(jax.tree.leaves(grads), flat_ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5 * np.abs(r).max(), rtol=0)


def test_parameters_are_sharded_as_the_rules_say():
    lm = meshlm.from_config(CFG, mesh="data=2,fsdp=2,model=2")
    p = lm.params
    expect = {
        "embed.w": ("model", "fsdp"),
        "layers.attn.q": (None, "fsdp", "model", None),
        "layers.attn.out": (None, "model", None, "fsdp"),
        "layers.mlp.fc_in.w": (None, "fsdp", "model"),
        "layers.mlp.fc_in.b": (None, "model"),
        "layers.mlp.fc_out.w": (None, "model", "fsdp"),
        "head.w": ("fsdp", "model"),
        "head.b": ("model",),
        "ln_f.scale": (None,),
    }
    flat = {
        jax.tree_util.keystr(k, simple=True, separator="."): v for k, v in jax.tree_util.tree_flatten_with_path(p)[0]
    }
    for name, spec in expect.items():
        assert tuple(flat[name].sharding.spec) == spec, name
    q = p["layers"]["attn"]["q"]  # [L, D, H, K] = [2, 64, 4, 16]: D split 2 ways (fsdp), H split 2 ways (model)
    assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 2, 16)}
    assert len({str(s.index) for s in q.addressable_shards}) == 4  # 4 distinct pieces, each held by the 2 data replicas


def test_the_rule_sets_differ_only_where_parameters_lie():
    """Activations lie alike under both sets (the model's own constraints name no set); serving keeps
    every parameter axis off the batch axes, so a decode step gathers no weights."""
    batch = set(sharding.ACTIVATIONS["batch"])
    assert {k: v for k, v in sharding.SERVING.items() if k in sharding.ACTIVATIONS} == sharding.ACTIVATIONS
    assert {k: v for k, v in sharding.TRAINING.items() if k in sharding.ACTIVATIONS} == sharding.ACTIVATIONS
    params = tuple(set(sharding.SERVING) - set(sharding.ACTIVATIONS))
    assert set(params) == set(sharding.TRAINING) - set(sharding.ACTIVATIONS)
    assert not batch & set(jax.tree.leaves(tuple(sharding.spec_for(params, sharding.SERVING))))


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8", "w8a8"])
def test_an_engine_on_an_fsdp_mesh_holds_its_weights_whole_over_the_batch_axes(quantize):
    """The model is laid out for training (ZeRO-3 over fsdp); its engine lays the weights out by the
    serving rules, split over `model` only, and generates the one-device model's greedy tokens (w8a8: each token's
    largest activation and the int32 sums of products reduced over `model`, exactly)."""
    lm = meshlm.from_config(CFG, mesh="data=2,fsdp=2,model=2", seed=3, quantize=quantize)
    engine = lm.engine(max_batch=2, max_len=32, kv_tokens=64)
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]:
        used = {a for part in leaf.sharding.spec if part for a in ((part,) if isinstance(part, str) else part)}
        assert not used & {"data", "fsdp"}, jax.tree_util.keystr(path)
    heads = jax.tree.leaves(engine.runner.params["layers"]["attn"]["q"])[0].sharding.spec[2]
    assert heads == "model"  # still split over the model axis
    prompts = [TOKENS[0, :5].tolist(), TOKENS[1, :9].tolist()]
    greedy = [SamplingParams(max_new_tokens=6, temperature=0.0)] * 2
    one = meshlm.from_config(CFG, seed=3, quantize=quantize).engine(max_batch=2, max_len=32, kv_tokens=64)
    assert [c.tokens for c in engine.generate(prompts, greedy)] == [c.tokens for c in one.generate(prompts, greedy)]


def test_shape_a_mesh_does_not_divide_is_named_at_configuration_time():
    with pytest.raises(
        ConfigError,
        match=r"parameter layers.attn.k dimension 2 \(heads=4\) is not divisible by mesh "
        r"axis model \(size 8\)",
    ):
        meshlm.from_config(CFG, mesh="model=8")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("data=2,fsdp=2", "uses 4 devices; 8 are visible"),
        ("data=3", "needs a multiple of 3 devices; 8 are visible"),
        ("tensor=8", "unknown axis 'tensor'"),
        ("model=3,data=-1", "needs a multiple of 3 devices"),
        ("model", "cannot read 'model'"),
        ("data=-1,fsdp=-1", "at most one axis may be -1"),
    ],
)
def test_bad_mesh_spec(spec, message):
    with pytest.raises(ConfigError, match=message):
        sharding.make_mesh(spec)


def test_omitted_data_axis_takes_the_remaining_devices():
    assert dict(sharding.make_mesh("model=2").shape) == {"data": 4, "fsdp": 1, "model": 2}


@pytest.mark.slow
def test_bf16_compute_is_close_to_fp32():
    lm = meshlm.from_config(CFG, seed=3)
    fp32 = lm.logits(TOKENS)
    policy = model.Policy(param_dtype="float32", compute_dtype="bfloat16")
    bf16 = np.asarray(jax.jit(lambda p, t: model.forward(p, t, CFG, policy))(lm.params, TOKENS))
    err = np.abs(bf16 - fp32).max() / np.abs(fp32).max()
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3); two layers of matmuls stay within 2%.
    assert err < 2e-2, err
    assert (bf16.argmax(-1) == fp32.argmax(-1)).mean() > 0.9
