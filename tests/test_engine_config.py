"""`EngineConfig`: an engine's settings, frozen and checked once when made (or changed), on the host alone."""

import dataclasses
import subprocess
import sys

import pytest

from meshlm.serve.config import BACKEND_PAGE_SIZES, LEAST, PAGE_SIZE, SPECULATE_TOKENS, EngineConfig


def test_it_is_frozen_and_its_defaults_work():
    config = EngineConfig()
    assert (config.max_batch, config.max_len, config.kv_tokens, config.chunk) == (8, None, None, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 2


@pytest.mark.parametrize("name", sorted(LEAST))
def test_a_value_that_cannot_work_is_refused_naming_its_field(name):
    for bad in (LEAST[name] - 1, True, 2.0, "4"):
        with pytest.raises(ValueError, match=rf"^{name} must be an integer >= {LEAST[name]}") as caught:
            EngineConfig(**{name: bad})
        assert caught.value.param == name


def test_a_change_is_checked_as_a_new_config_is():
    config = EngineConfig(max_batch=4)
    assert config.replace(max_len=64) == EngineConfig(max_batch=4, max_len=64)
    with pytest.raises(ValueError, match="chunk must be an integer >= 1"):
        config.replace(chunk=0)
    with pytest.raises(ValueError, match="attention"):
        EngineConfig(attention="fast")


def test_the_context_and_the_speculation_it_resolves_for_a_model():
    assert EngineConfig().context(128) == 128 and EngineConfig(max_len=64).context(128) == 64
    with pytest.raises(ValueError, match=r"max_len must be in \[2, 128\]"):
        EngineConfig(max_len=256).context(128)
    assert EngineConfig().speculated(drafting=False) == 0
    assert EngineConfig().speculated(drafting=True) == SPECULATE_TOKENS
    assert EngineConfig(ngram=2, speculate=3).speculated(drafting=False) == 3


def test_the_page_size_is_the_given_one_or_the_backends():
    assert EngineConfig().tokens_per_page("cpu") == EngineConfig().tokens_per_page("gpu") == PAGE_SIZE
    assert EngineConfig().tokens_per_page("tpu") == BACKEND_PAGE_SIZES["tpu"] != PAGE_SIZE
    assert EngineConfig(page_size=32).tokens_per_page("tpu") == 32


def test_mixed_steps_default_to_a_tpu_and_are_refused_where_they_cannot_run():
    plain = dict(speculating=False, batch_ways=1)
    assert EngineConfig().mixes("tpu", paged=True, **plain)
    # the default mixes where a TPU's paged kernel reads the pool in place, not where a decode step gathers it
    assert not EngineConfig().mixes("tpu", paged=False, **plain)
    assert not EngineConfig().mixes("cpu", paged=False, **plain)
    assert EngineConfig(mixed_steps=True).mixes("cpu", paged=False, **plain)
    assert not EngineConfig(mixed_steps=False).mixes("tpu", paged=True, **plain)
    # where a mixed step cannot run, the default quietly does not mix, and asking for it is refused
    assert not EngineConfig().mixes("tpu", paged=True, speculating=True, batch_ways=1)
    assert not EngineConfig().mixes("tpu", paged=True, speculating=False, batch_ways=2)
    with pytest.raises(ValueError, match="mixed_steps needs speculation .* off") as caught:
        EngineConfig(mixed_steps=True).mixes("tpu", paged=True, speculating=True, batch_ways=1)
    assert caught.value.param == "mixed_steps"
    with pytest.raises(ValueError, match="mixed_steps needs a mesh without batch axes"):
        EngineConfig(mixed_steps=True).mixes("tpu", paged=True, speculating=False, batch_ways=2)
    with pytest.raises(ValueError, match="mixed_steps needs speculation"):  # prompt lookup: when made, not later
        EngineConfig(mixed_steps=True, ngram=2)
    with pytest.raises(ValueError, match="mixed_steps must be true, false or None"):
        EngineConfig(mixed_steps="yes")


def test_it_imports_no_jax():
    code = "import sys, meshlm.serve.config; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
