"""Many LoRA adapters over one base in one engine: a batch that mixes the base and three PEFT adapters gives each
row what that adapter gives served alone, and what peft gives on transformers; on a mesh with an NF4 base too;
prefix caching keyed on the adapter; slots refused or swapped when full; bad adapters refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel

import meshlm
from meshlm import ConfigError, InputError
from meshlm.serve.engine import SlotsBusy
from tests import oracle
from tests.helpers.generation import greedy, hf_greedy
from tests.helpers.lora import ARCHS, peft_model

PROMPTS = [[5, 17, 99, 3, 8], [42, 7, 7, 130, 2, 9], [1, 2, 3], [200, 100, 50, 25, 12, 6, 7]]
NEW = 8
# (rank, targets) of the three adapters: different ranks (padded to the slots') and different projections
ADAPTERS = {
    "qv": (2, ["q_proj", "v_proj"]),
    "mlp": (8, ["fc_in", "fc_out", "out_proj"]),
    "all": (4, ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"]),
}


def save_adapters(base: Path, root: Path) -> dict[str, Path]:
    folders = {}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        folders[name] = root / name
        peft_model(base, "gptj", seed=seed, r=rank, lora_alpha=2 * rank, target_modules=targets).save_pretrained(
            folders[name]
        )
    return folders


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return oracle.make_hf_model(tmp_path_factory.mktemp("base"), seed=3, **ARCHS["gptj"]).path


@pytest.fixture(scope="module")
def folders(base, tmp_path_factory) -> dict[str, Path]:
    return save_adapters(base, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def lm(base, folders):
    """The base with the three adapters added: `generate` runs them by name, on one engine with a slot each."""
    return meshlm.load(base, adapters=folders)


@pytest.fixture(scope="module")
def engine(lm):
    return lm._engine


def alone(engine, prompt: list[int], adapter: str | None):
    return engine.generate([prompt], [greedy(NEW)], adapters=[adapter])[0]


@pytest.mark.slow
def test_a_mixed_batch_gives_each_row_what_its_adapter_gives_alone_and_what_peft_gives(base, folders, lm, engine):
    names = [None, "qv", "mlp", "all"]
    mixed = lm.generate_tokens(PROMPTS, greedy(NEW), adapters=names)
    for prompt, name, got in zip(PROMPTS, names, mixed, strict=True):
        one = alone(engine, prompt, name)
        assert got.tokens == one.tokens
        np.testing.assert_allclose(got.logprobs, one.logprobs, atol=1e-5, rtol=0)
        torch_model = oracle.load_hf(base)
        if name is not None:
            torch_model = PeftModel.from_pretrained(torch_model, folders[name]).eval()
        want, logits = hf_greedy(oracle.HFModel(base, torch_model), prompt, NEW)
        assert got.tokens == want
        want_lps = torch.log_softmax(torch.as_tensor(logits), -1).numpy()[np.arange(NEW), want]
        np.testing.assert_allclose(got.logprobs, want_lps, atol=1e-4, rtol=0)
    # the adapters change what is generated: each row's output is its adapter's, not the base's
    base_rows = lm.generate_tokens(PROMPTS, greedy(NEW))
    for m, b in zip(mixed[1:], base_rows[1:], strict=True):
        assert np.abs(np.subtract(m.logprobs, b.logprobs)).max() > 1e-3
    with pytest.raises(InputError, match="no adapter named 'nope'"):
        lm.generate_tokens([PROMPTS[0]], greedy(NEW), adapters=["nope"])


@pytest.mark.slow
def test_a_prompt_prefilled_in_one_pass_with_decoding_rows_keeps_each_rows_adapter(folders, lm, engine):
    """Mixed steps (`mixed_steps`): with 16 prompt tokens a step, three rows are admitted first and the fourth ("all")
    is prefilled in one pass with their decode step; each span's rows take their own adapters' updates, and every
    row gives what it gives without mixing (which the test above holds to peft)."""
    names = [None, "qv", "mlp", "all"]
    mixing = lm.engine(adapters=folders, mixed_steps=True, prefill_tokens=16)
    calls = []
    run_mixed = mixing.runner.run_mixed
    mixing.runner.run_mixed = lambda prefill, decode: calls.append(decode) or run_mixed(prefill, decode)
    got = mixing.generate(PROMPTS, [greedy(NEW)] * 4, adapters=names, chunk=2)  # rows still decode in step 2
    want = engine.generate(PROMPTS, [greedy(NEW)] * 4, adapters=names)
    assert len(calls) == 1 and (calls[0].slots < mixing.runner.max_batch).sum() == 3
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_prefix_caching_keys_on_the_adapter(engine):
    """Rows of different adapters with one prompt never share pages; rows of one adapter do."""
    prompt = list(range(10, 50))  # two full pages of 16
    first = engine.generate([prompt], [greedy(4)], adapters=["qv"])[0]
    hits = engine.snapshot().prefix_cache_hits
    other = engine.generate([prompt], [greedy(4)], adapters=["all"])[0]
    assert engine.snapshot().prefix_cache_hits == hits  # nothing of qv's pages served "all"
    again = engine.generate([prompt], [greedy(4)], adapters=["qv"])[0]
    assert engine.snapshot().prefix_cache_hits > hits and again.tokens == first.tokens
    assert other.logprobs != first.logprobs


@pytest.mark.slow
def test_full_slots_swap_idle_adapters_and_refuse_busy_ones(folders, lm, engine):
    """Three slots, four adapters: an idle one gives its slot up (and comes back when asked for); when every
    slot runs live requests, the fourth adapter is refused."""
    engine.add_adapter("qv-again", lm.read_adapter("qv-again", folders["qv"]))
    want = {name: alone(engine, PROMPTS[1], name).tokens for name in ("qv", "mlp", "all")}
    assert alone(engine, PROMPTS[1], "qv-again").tokens == want["qv"]  # in the slot of the least recently used
    again = engine.generate([PROMPTS[1]] * 4, [greedy(NEW)] * 4, adapters=["all", "mlp", None, "qv"])
    assert [r.tokens for r in again] == [want["all"], want["mlp"], again[2].tokens, want["qv"]]
    held = [engine.add_request(PROMPTS[0], greedy(NEW), adapter=name) for name in ("all", "mlp", "qv")]
    with pytest.raises(SlotsBusy, match="all 3 adapter slots"):
        engine.add_request(PROMPTS[0], greedy(NEW), adapter="qv-again")
    with pytest.raises(InputError, match="in use by running requests"):
        engine.unload_adapter("mlp")
    for r in held:
        engine.abort(r.id)
    engine.step()  # frees the aborted rows
    assert alone(engine, PROMPTS[1], "qv-again").tokens == want["qv"]
    engine.unload_adapter("qv-again")
    assert list(engine.adapter_sources()) == ["qv", "mlp", "all"]


def test_bad_adapters_are_refused_in_one_line(base, folders, lm, engine, tmp_path):
    other = oracle.make_hf_model(tmp_path / "other", seed=0, **{**ARCHS["gptj"], "n_embd": 32}).path
    peft_model(other, "gptj").save_pretrained(tmp_path / "other-adapter")
    with pytest.raises(ConfigError, match="adapter does not match the base"):
        engine.add_adapter("other", lm.read_adapter("other", tmp_path / "other-adapter"))
    peft_model(base, "gptj", r=16).save_pretrained(tmp_path / "wide")
    with pytest.raises(ConfigError, match="rank 16 exceeds the adapter slots' rank 8"):
        engine.add_adapter("wide", lm.read_adapter("wide", tmp_path / "wide"))
    with pytest.raises(InputError, match="does not exist"):
        engine.add_adapter("gone", lm.read_adapter("gone", tmp_path / "gone"))
    with pytest.raises(InputError, match="loaded already"):
        engine.add_adapter("qv", lm.read_adapter("qv", folders["qv"]))
    with pytest.raises(InputError, match="no adapter named 'nope'"):
        engine.add_request(PROMPTS[0], greedy(NEW), adapter="nope")
    assert list(engine.adapter_sources()) == ["qv", "mlp", "all"]  # nothing half-registered


@pytest.mark.slow
def test_mixed_adapters_on_a_mesh_with_an_nf4_base(tmp_path):
    """data=2, fsdp=2, model=2 and a 4-bit base: each row of a mixed batch gives what its adapter gives alone,
    and the adapter touching every projection gives what the single-adapter path (`load(..., adapter=)`)
    gives on one device."""
    base = oracle.make_hf_model(tmp_path / "base", seed=4, **{**ARCHS["gptj"], "n_embd": 128, "n_head": 2}).path
    folders = save_adapters(base, tmp_path)
    lm = meshlm.load(base, mesh="data=2,fsdp=2,model=2", quantize="nf4")
    engine = lm.engine(adapters=folders, max_batch=4, max_len=64)
    a, q = engine.runner.params["adapters"]["q"]["a"], engine.runner.params["layers"]["attn"]["q"]
    assert a.sharding.spec[2] == q.codes.sharding.spec[1]  # the slots' A is split like its base's input:
    assert a.sharding.spec[2] is None  # whole over fsdp, as the serving rules lay the weights out
    names = [None, "qv", "mlp", "all"]
    mixed = engine.generate(PROMPTS, [greedy(NEW)] * 4, adapters=names)
    for prompt, name, got in zip(PROMPTS, names, mixed, strict=True):
        one = alone(engine, prompt, name)
        assert got.tokens == one.tokens
        np.testing.assert_allclose(got.logprobs, one.logprobs, atol=1e-5, rtol=0)
    single = meshlm.load(base, quantize="nf4", adapter=folders["all"])
    want = single.generate_tokens([PROMPTS[3]], greedy(NEW))[0]
    assert mixed[3].tokens == want.tokens
    np.testing.assert_allclose(mixed[3].logprobs, want.logprobs, atol=1e-5, rtol=0)
