"""Rematerialisation policies (`remat` in a train config): each gives the loss and gradients of no remat
at all, and the policies by name keep on the device exactly the activations they name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

from meshlm import model
from meshlm.config import REMAT_NAMES, ConfigError, Policy, preset, remat_names

CFG = preset("test-tiny")
T = 12  # differs from every model dimension, so a T x T shape means attention scores


def loss_and_grads(remat: str):
    params = model.init(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, T + 1), 0, CFG.n_vocab_used)
    policy = Policy(remat=remat)
    return jax.jit(jax.value_and_grad(lambda p: model.loss(p, tokens, CFG, policy)[0]))(params)


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads("none")


QUICK = ("full", "minimal", "offload")  # the rest compile alike: the full suite runs them (slow tier)
POLICIES = [name if name in QUICK else pytest.param(name, marks=pytest.mark.slow) for name in REMAT_NAMES[1:]]


@pytest.mark.parametrize("remat", [*POLICIES, "save:q,v;offload:mlp"])
def test_every_policy_gives_the_loss_and_gradients_of_no_remat(remat, reference):
    loss, grads = loss_and_grads(remat)
    want_loss, want_grads = reference
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=model.param_name(path))


def saved(remat: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, memory space: "Device" or "Host") of each float activation the backward pass keeps
    (traced, not run)."""
    tokens = jnp.zeros((2, T + 1), jnp.int32)
    policy = Policy(remat=remat)
    kept = saved_residuals(lambda p: model.loss(p, tokens, CFG, policy)[0], model.abstract_params(CFG))
    return [(a.shape, a.memory_space.name) for a, _ in kept if jnp.issubdtype(a.dtype, jnp.floating)]


def test_policies_by_name_keep_what_they_name():
    L, H, K, F = CFG.n_layer, CFG.n_head, CFG.d_head, CFG.d_ff
    heads, up = (L, 2, T, H, K), (L, 2, T, F)
    qkv_out = [s for s, _ in saved("save_qkv_out")]
    assert qkv_out.count(heads) == 4 and up not in qkv_out  # q, k, v and the attention's output
    minimal = [s for s, _ in saved("minimal")]
    assert minimal.count(heads) == 4 and up in minimal  # ... and the MLP's GELU(fc_in)
    for policy in ("save_qkv_out", "minimal", "full"):  # never the T x T attention scores
        assert not [s for s, _ in saved(policy) if s.count(T) >= 2], policy
    offloaded = saved("offload")  # the same five, in host memory
    assert offloaded.count((heads, "Host")) == 4 and (up, "Host") in offloaded
    assert not [s for s, where in offloaded if where != "Host" and s in (heads, up)]


def test_remat_names_read_and_refuse():
    assert remat_names("full") is None
    assert remat_names("save_qkv") == (("q", "k", "v"), ())
    assert remat_names("save:q,k;offload:attn") == (("q", "k"), ("attn",))
    for bad in ("everything", "save:q,x", "save:q;offload:q", "keep:q"):
        with pytest.raises(ConfigError):
            Policy(remat=bad)
