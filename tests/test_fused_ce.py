"""The fused LM head and cross-entropy (`meshlm.fused_ce`) computes what the plain head does: logits, then
logsumexp and the target's logit. Its values and its gradients with respect to hidden states, head weight
and bias equal the plain head's, for untied, biased and tied heads, with z-loss and loss masks, in chunks
that do not divide the sequence, on a data x fsdp x model mesh; and a training step's gradients of every
objective (lm, DPO, ORPO, LoRA) equal those of the step with the plain head."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import fused_ce, model, train_step
from meshlm.config import ModelConfig, TrainConfig
from meshlm.lora import init_adapter
from meshlm.sharding import make_mesh, named_sharding, param_shardings

B, T, D, V = 4, 10, 16, 48
Z_LOSS = 1e-2
HEADS = {  # head kind -> (vocab_first, with a bias)
    "untied": (False, False),
    "untied with bias": (False, True),
    "tied": (True, False),
    "tied with bias": (True, True),
}


def plain_head(x, w, b, targets, vocab_first):
    """The oracle: whole logits, logsumexp, the target's logit."""
    logits = jnp.einsum("btd,vd->btv" if vocab_first else "btd,dv->btv", x, w)
    logits = logits if b is None else logits + b
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return log_z - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], log_z


def head_inputs(vocab_first: bool, bias: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    w = (0.3 * rng.normal(size=(V, D) if vocab_first else (D, V))).astype(np.float32)
    b = (0.3 * rng.normal(size=V)).astype(np.float32) if bias else None
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = (rng.random((B, T)) < 0.7).astype(np.float32)
    g_nll, g_z = rng.normal(size=(2, B, T)).astype(np.float32)
    return (x, w, b), targets, mask, (g_nll, g_z)


def losses(vocab_first, targets, mask, cotangents, chunk_tokens=None):
    """Two losses of (x, w, b) by the fused head and by the oracle: the lm objective's masked mean with
    z-loss (the gradient precomputed in the forward pass) and a sum of nll and log Z times cotangents that
    the forward pass does not know (the recompute sweep), and the per-target values."""
    g_nll, g_z = cotangents

    def fused(x, w, b):
        out = fused_ce.cross_entropy(
            x, w, b, targets, mask, z_loss=Z_LOSS, vocab_first=vocab_first, chunk_tokens=chunk_tokens
        )
        return out.total / mask.sum(), (g_nll * out.nll + g_z * out.log_z).sum(), out.nll, out.log_z

    def plain(x, w, b):
        nll, log_z = plain_head(x, w, b, targets, vocab_first)
        return (mask * (nll + Z_LOSS * log_z**2)).sum() / mask.sum(), (g_nll * nll + g_z * log_z).sum(), nll, log_z

    return fused, plain


def values_and_gradients(f, head, argnums):
    """Each of f's four outputs, and the gradients of its two losses (and of both at once)."""
    grad = lambda i: jax.grad(lambda *a: f(*a)[i] if i < 2 else f(*a)[0] + f(*a)[1], argnums)
    return jax.jit(lambda *a: (f(*a), grad(0)(*a), grad(1)(*a), grad(2)(*a)))(*head)


def assert_close(got, want):
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", HEADS)
def test_values_and_gradients_equal_the_plain_head_in_chunks_that_do_not_divide_the_sequence(kind):
    vocab_first, bias = HEADS[kind]
    head, targets, mask, cotangents = head_inputs(vocab_first, bias)
    argnums = (0, 1, 2) if bias else (0, 1)
    # 12 tokens a chunk: 3 positions of each of the 4 rows, so the 10 positions are padded to 12
    fused, plain = losses(vocab_first, targets, mask, cotangents, chunk_tokens=12)
    assert_close(values_and_gradients(fused, head, argnums), values_and_gradients(plain, head, argnums))


def test_a_frozen_head_passes_gradients_to_the_hidden_states_alone():
    """As in a LoRA run: only x is differentiated, and the backward pass needs no logits."""
    head, targets, mask, cotangents = head_inputs(False, True)
    fused, plain = losses(False, targets, mask, cotangents, chunk_tokens=8)
    assert_close(values_and_gradients(fused, head, 0), values_and_gradients(plain, head, 0))


@pytest.mark.slow
def test_values_and_gradients_on_a_data_fsdp_model_mesh_equal_one_device():
    mesh = make_mesh("data=2,fsdp=2,model=2")
    head, targets, mask, cotangents = head_inputs(False, True, seed=1)
    fused, plain = losses(False, targets, mask, cotangents, chunk_tokens=8)
    want = values_and_gradients(plain, head, (0, 1, 2))
    axes = (("batch", "seq", "act_embed"), ("embed", "vocab"), ("vocab",))
    with jax.set_mesh(mesh):
        sharded = [jax.device_put(a, named_sharding(mesh, ax)) for a, ax in zip(head, axes, strict=True)]
        got = values_and_gradients(fused, sharded, (0, 1, 2))
    assert_close(got, want)


@pytest.mark.parametrize("weighted", [True, False], ids=["lm", "per-target"])
def test_on_a_mesh_the_vocabulary_stays_split_and_only_small_sums_cross_devices(weighted):
    """Compiled on data=2,fsdp=2,model=2 with the head split over `model` on the vocabulary: no collective
    carries a whole vocabulary (no logits, softmax or head gathered); the vocabulary's reductions cross
    `model` as [tokens] sums and the hidden states' gradient as [tokens, d_model] partial sums."""
    import re

    mesh = make_mesh("data=2,fsdp=2,model=2")
    (x, w, b), targets, mask, _ = head_inputs(False, True, seed=2)

    def loss(x, w, b):
        out = fused_ce.cross_entropy(x, w, b, targets, mask if weighted else None, chunk_tokens=8)
        return out.total if weighted else out.nll.sum()

    axes = (("batch", "seq", "act_embed"), ("embed", "vocab"), ("vocab",))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, named_sharding(mesh, ax)) for a, ax in zip((x, w, b), axes, strict=True)]
        hlo = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(*args).compile().as_text()
    collectives = re.findall(r"= \w+\[([\d,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|all-to-all)", hlo)
    assert any(op == "all-reduce" for _, op in collectives)
    for dims, op in collectives:
        assert V not in [int(d) for d in dims.split(",") if d], (op, dims)


# ---------------------------------------------------------------------------------------------------
# The training step: every objective's gradients with the fused head equal those with the plain head

CFG = ModelConfig(
    n_layer=1, d_model=32, n_head=4, d_ff=64, rotary_dim=8, vocab_size=64, n_vocab_used=64, max_seq_len=16
)
NEO = dataclasses.replace(
    CFG, rotary_dim=0, residual="sequential", position="learned", scale_attn=False, tie_embeddings=True, head_bias=False
)
SEQ = 12


def plain_target_nll(params, tokens, cfg, policy=model.DEFAULT_POLICY, *, segments=None, dropout_key=None, **_):
    """`model.target_nll` as it was before the head was fused: whole logits, and no `total`."""
    segments = None if segments is None else segments[:, :-1]
    x = model.hidden_states(params, tokens[:, :-1], cfg, policy, segments=segments, dropout_key=dropout_key)
    logits = model.unembed(params, x, cfg)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    nll = log_z - jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return fused_ce.Losses(nll, log_z, None)


def step_batch(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Rows of two packed documents each, with random loss weights (DPO's reference comes from the base)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (rows, SEQ + 1)).astype(np.int32)
    weights = (rng.random((rows, SEQ + 1)) < 0.6).astype(np.float32)
    segments = np.where(np.arange(SEQ + 1) < 7, 1, 2)[None].repeat(rows, 0).astype(np.int32)
    return {"tokens": tokens, "weights": weights, "segments": segments}


def step_gradients(cfg: TrainConfig, params, frozen, batch):
    """The step's loss and its gradients of the trained parameters (weighted by the unit count, as the step)."""
    forward = train_step.objective_forward(cfg, cfg.model, cfg.policy)

    def weighted(p):
        result = forward(p, frozen, batch)
        return result.loss * result.count

    return jax.jit(jax.value_and_grad(weighted))(params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes,mesh",
    [
        ({"z_loss": Z_LOSS}, "data=2,fsdp=2,model=2"),
        ({"model": NEO, "objective": "orpo"}, None),
        ({"objective": "dpo", "lora": {"rank": 4, "targets": ["q", "v", "fc_in"]}}, None),
    ],
    ids=["gptj-lm-z-loss-on-a-mesh", "neo-tied-orpo", "gptj-lora-dpo"],
)
def test_train_step_gradients_equal_those_of_the_plain_head_on_one_device(changes, mesh, monkeypatch):
    cfg = TrainConfig(**{"model": CFG, "batch_size": 4, **changes})
    params = model.init(cfg.model, jax.random.key(0))
    frozen = None
    if cfg.lora is not None:  # the adapter's B starts at zero: make it random, so every gradient counts
        adapter = init_adapter(model.projections(cfg.model), cfg.lora, jax.random.key(1))
        noise = lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape)
        frozen, params = params, jax.tree.map(noise, adapter)
    batch = step_batch(4, seed=3)
    if mesh is None:
        got = step_gradients(cfg, params, frozen, batch)
    else:  # parameters laid out by the sharding rules, rows split over data x fsdp
        mesh = make_mesh(mesh)
        with jax.set_mesh(mesh):
            sharded = jax.device_put(params, param_shardings(model.logical_axes(cfg.model), mesh))
            rows = {k: jax.device_put(v, named_sharding(mesh, ("batch", "seq"))) for k, v in batch.items()}
            got = step_gradients(cfg, sharded, frozen, rows)
    monkeypatch.setattr(model, "target_nll", plain_target_nll)
    assert_close(got, step_gradients(cfg, params, frozen, batch))
