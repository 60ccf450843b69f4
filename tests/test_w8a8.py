"""w8a8 projections (`meshlm.quant`): int8's codes, and each product's activations quantized per token, multiplied
int8 by int8 into int32. The product is checked exactly against integer arithmetic in numpy, and a served model
against its float model, the oracle the float path itself is held to (transformers, in test_family)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm import quant
from meshlm.config import ConfigError, TrainConfig
from tests.helpers.quantized import drift


@pytest.mark.parametrize("shape, n_in", [((64, 4, 8), 1), ((4, 16, 32), 2)])  # q's [in, heads, K]; out's [heads, K, d]
@pytest.mark.parametrize("heads_first", [False, True])
def test_a_w8a8_product_is_exact_integer_arithmetic_on_per_token_codes(shape, n_in, heads_first):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(1, *shape)).astype(np.float32)
    sizes = np.asarray([0.01, 1.0, 50.0]).reshape(3, *[1] * n_in)  # tokens of very different magnitudes
    x = rng.normal(size=(2, 3, *shape[:n_in])).astype(np.float32) * sizes
    x[0, 1] = 0  # a zero token: scale 0, no NaN
    weight = quant.quantize(jnp.asarray(w), "w8a8", n_in, heads_first=heads_first)
    assert quant.kind_of(weight) == "w8a8" and weight.heads_first == heads_first
    one = jax.tree.map(lambda a: a[0], weight)  # the layer the model's scan hands `times`
    got = np.asarray(quant.times(jnp.asarray(x), one, n_in))

    codes = np.asarray(quant.quantize(jnp.asarray(w), "int8", n_in, heads_first=False).codes[0]).astype(np.int64)
    scale = np.asarray(weight.scale[0], np.float64)
    top = np.abs(x).reshape(2, 3, -1).max(-1).astype(np.float64)
    xq = np.rint(x * (127 / np.where(top > 0, top, 1)).reshape(2, 3, *[1] * n_in).astype(np.float32))
    exact = np.tensordot(xq.astype(np.int64), codes, n_in)  # integers: no rounding at all
    want = exact * (top / 127).reshape(2, 3, *[1] * (len(shape) - n_in)) * scale
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert not got[0, 1].any()
    # the activations' rounding is the only difference from int8's weight-only product, and it is small
    weight_only = np.tensordot(x, np.asarray(one.dense(jnp.float32)), n_in)
    assert 0 < np.abs(got - weight_only).max() < 0.02 * np.abs(weight_only).max()


# prompt logprobs against the float model's: measured 0.101, int8's weight-only 0.045 (hf_tiny's rows are 64 wide, so
# each token's rounding weighs more than across GPT-J's 4,096)
TOLERANCE = 0.15
TOKEN_AGREEMENT = 0.5  # measured 0.85: once one greedy token differs, the rest of that row follows another text


@pytest.mark.slow
def test_an_engine_on_w8a8_projections_serves_near_its_float_model(hf_tiny):
    """`meshlm.load(..., quantize="w8a8")` (`meshlm serve --quantize w8a8`): over the float model's greedy texts its
    prompt logprobs are within TOLERANCE, further than int8's weight-only ones (its activations are rounded too),
    and its own greedy tokens agree at TOKEN_AGREEMENT of the positions."""
    models = {kind: meshlm.load(hf_tiny.path, quantize=kind) for kind in (None, "int8", "w8a8")}
    assert models["w8a8"].params["layers"]["mlp"]["fc_in"]["w"].activations
    engines = {kind: lm.engine(max_batch=4) for kind, lm in models.items()}
    (agreement, gap), (_, weight_only_gap) = drift(engines[None], engines["w8a8"], engines["int8"])
    print(f"greedy agreement {agreement:.3f}, largest logprob gap {gap:.4f} (int8 {weight_only_gap:.4f})")
    assert weight_only_gap < gap < TOLERANCE
    assert agreement >= TOKEN_AGREEMENT


def test_a_trained_base_cannot_be_w8a8():
    with pytest.raises(ConfigError, match="no gradient"):
        TrainConfig(base_dtype="w8a8", lora={"rank": 4})
