"""What one row leaves in the paged KV pool never reaches another row (issue 42).

A row that fails (a diverged adapter's NaN keys and values) gives its pages back; a later row that takes
one of them holds stale NaN past its length, and padding once wrote to page 0, which every table's unused
entries read. Attention weighs those slots by zero, and zero times NaN is NaN: the next row failed too, and
so did every row after it. Now the gathered keys and values past a row's length are zeroed, nothing is
written to page 0, and a failed row's pages are zeroed before they are handed out again (which the paged
kernels, reading the pool in place, need).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlm
from meshlm import config, kv_cache, model
from meshlm.serve.engine import GenerationFailed
from tests import oracle
from tests.helpers.generation import greedy
from tests.helpers.lora import ARCHS, peft_model

CFG = config.preset("test-tiny")
PAGE = 16
BAD_PROMPT = list(range(20, 33))  # 13 tokens: NaN in slots 0-12 of its page
GOOD_PROMPT = [5, 17, 99]  # reads slots 3.. of the page it is handed as they are masked


def test_a_decode_reads_nothing_past_each_rows_length():
    """A pool holding NaN everywhere a row has not written (page 0, its pages' tails) decodes as a clean one."""
    params = jax.jit(model.init, static_argnums=0)(CFG, jax.random.key(0))
    clean = kv_cache.init_cache(CFG, 5, PAGE)
    table = jnp.array([[1, 2, 0], [3, 0, 0]], jnp.int32)
    prompt = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7, 1, 8] + [0] * 14], jnp.int32)
    mask = jnp.arange(18)[None] < jnp.array([[18], [4]])
    spoiled = jax.tree.map(lambda pool: jnp.full_like(pool, jnp.nan), clean)
    out = {}
    for name, cache in (("clean", clean), ("spoiled", spoiled)):
        logits, cache = model.decode(params, prompt, cache, table, jnp.zeros(2, jnp.int32), CFG, mask=mask)
        steps = [logits[jnp.arange(2), jnp.array([17, 3])]]
        length = jnp.array([18, 4], jnp.int32)
        for token in ([7, 7], [1, 2]):
            logits, cache = model.decode(params, jnp.array(token)[:, None], cache, table, length, CFG)
            steps.append(logits[:, 0])
            length = length + 1
        out[name] = np.stack(steps)
        if name == "clean":
            assert not np.asarray(cache.k[:, :, 0]).any()  # padding and the rows' spare entries wrote nothing
    assert np.isfinite(out["spoiled"]).all()
    np.testing.assert_array_equal(out["spoiled"], out["clean"])


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> meshlm.LanguageModel:
    """A tiny GPT-J with a LoRA adapter whose weights are all NaN, as a diverged run leaves them."""
    from safetensors.numpy import load_file, save_file

    base = oracle.make_hf_model(tmp_path_factory.mktemp("base"), seed=5, **ARCHS["gptj"]).path
    folder = tmp_path_factory.mktemp("adapters") / "diverged"
    peft_model(base, "gptj", r=4).save_pretrained(folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k: np.full_like(v, np.nan) for k, v in weights.items()}, str(folder / "adapter_model.safetensors"))
    return meshlm.load(Path(base), adapters={"nan": folder})


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xla", "pallas"])  # the pool gathered, or read in place by a paged kernel
def test_a_failed_rows_pages_reach_no_later_row(lm, attention):
    engine = lm.engine(attention=attention, adapters=lm.adapters, max_batch=2, kv_tokens=4 * PAGE)
    want = engine.generate([GOOD_PROMPT], [greedy(10)])[0].tokens
    for _ in range(2):  # the second time round takes the pages the first one's rows gave back
        with pytest.raises(GenerationFailed, match="token id"):
            engine.generate([BAD_PROMPT], [greedy(4)], adapters=["nan"])
        assert engine.generate([GOOD_PROMPT], [greedy(10)])[0].tokens == want
        bad, good = engine.add_requests([BAD_PROMPT, GOOD_PROMPT], [greedy(4), greedy(10)], adapters=["nan", None])
        while engine.has_work():
            engine.step()
        assert bad.error is not None and "token id" in bad.error
        assert good.error is None and good.output.tokens == want
    assert engine.scheduler.pool.available == engine.scheduler.pool.capacity
