"""The GPT-J family through Hugging Face folders: GPT-NeoX (both residual forms), GPT-Neo (global and local
layers) and CodeGen against their transformers classes for logits, greedy generation, export, conversion
and a sharded training step; config.json of each architecture both ways; bad configs and folders refused
in one line, before anything is written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from transformers import AutoConfig

import meshlm
from meshlm import ConfigError, config
from meshlm.formats import hf
from meshlm.formats.slices import Placed
from tests import oracle
from tests.helpers.family import ARCHS, VOCAB
from tests.helpers.generation import greedy, hf_greedy
from tests.helpers.training import SEQ, run_steps, smooth, tiny_config, write_dataset

MESH = "data=2,fsdp=2,model=2"


@pytest.fixture(scope="session")
def family(tmp_path_factory) -> Callable[[str], oracle.HFModel]:
    """The random model of each ARCHS entry, saved by transformers, built once when first asked for."""
    made: dict[str, oracle.HFModel] = {}

    def get(name: str) -> oracle.HFModel:
        if name not in made:
            made[name] = oracle.make_hf_model(tmp_path_factory.mktemp(name), seed=len(made), **ARCHS[name])
        return made[name]

    return get


@pytest.fixture(scope="module", params=list(ARCHS))
def ref(request, family) -> oracle.HFModel:
    return family(request.param)


@pytest.fixture(scope="module")
def lm(ref) -> meshlm.LanguageModel:
    return meshlm.load(ref.path)


def tensors(folder: Path) -> dict[str, np.ndarray]:
    return load_file(folder / "model.safetensors")


# ---------------------------------------------------------------------------------------------------
# The model against transformers


@pytest.mark.parametrize("mesh", [None, MESH])
def test_logits_match_transformers(ref, mesh):
    tokens = np.random.default_rng(1).integers(0, VOCAB, (4, 23))
    np.testing.assert_allclose(meshlm.load(ref.path, mesh=mesh).logits(tokens), ref.logits(tokens), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_greedy_generation_matches_transformers(ref, lm):
    """A batch of prompts of different lengths (left-padded together) against each prompt alone in
    transformers, far past GPT-Neo's local window."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (7, 3)]
    got = lm.generate_tokens(prompts, greedy(16))
    for completion, prompt in zip(got, prompts, strict=True):
        assert completion.tokens == hf_greedy(ref, prompt, 16)[0]


def test_a_shard_reads_only_its_heads_rows(ref, monkeypatch):
    """A device holding heads 1..2 of q reads those rows only, also out of NeoX's and CodeGen's fused q/k/v."""
    reads: list[tuple[str, tuple[slice, ...]]] = []
    original = hf.SafetensorsReader.read
    monkeypatch.setattr(
        hf.SafetensorsReader,
        "read",
        lambda self, name, index: reads.append((name, index)) or original(self, name, index),
    )
    cfg, source = hf.open(ref.path, "float32")
    shape = (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_head)
    whole = source("layers.attn.q", shape)(tuple(slice(0, n) for n in shape))
    reads.clear()
    part = source("layers.attn.q", shape)((slice(1, 2), slice(0, cfg.d_model), slice(1, 3), slice(0, cfg.d_head)))
    np.testing.assert_array_equal(part, whole[1:2, :, 1:3])
    assert sum(index[0].stop - index[0].start for _, index in reads) == 2 * cfg.d_head
    assert all(".1." in name for name, _ in reads)


def test_export_and_conversion_round_trip(ref, lm, tmp_path):
    """`lm.save` and `meshlm.convert` write the same folder, which transformers loads with the reference's
    logits; HF -> meshlm -> HF gives it again. The tensors are the reference's own, exactly, in the same
    architecture (CodeGen, the same math as GPT-J, is written as GPT-J)."""
    lm.save(tmp_path / "saved", format="hf")
    meshlm.convert(ref.path, tmp_path / "converted", to="hf")
    meshlm.convert(ref.path, tmp_path / "meshlm", to="meshlm")
    meshlm.convert(tmp_path / "meshlm", tmp_path / "back", to="hf")

    saved = tensors(tmp_path / "saved")
    for name in ("converted", "back"):
        other = tensors(tmp_path / name)
        assert other.keys() == saved.keys() and all(np.array_equal(other[k], saved[k]) for k in saved)
    model_type = json.loads((ref.path / "config.json").read_text())["model_type"]
    exported_type = json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"]
    assert exported_type == ("gptj" if model_type == "codegen" else model_type)
    if exported_type == model_type:
        original = tensors(ref.path)
        assert saved.keys() == original.keys() and all(np.array_equal(saved[k], original[k]) for k in saved)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 19))
    np.testing.assert_allclose(oracle.open_hf(tmp_path / "saved").logits(tokens), ref.logits(tokens), atol=1e-4)
    assert meshlm.load(tmp_path / "back").config == lm.config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    rows = np.random.default_rng(4).integers(0, VOCAB, (16, SEQ + 1))
    return write_dataset(tmp_path_factory.mktemp("family_data"), rows)


@pytest.mark.slow
def test_a_training_step_on_a_mesh_equals_one_device(lm, dataset, tmp_path):
    cfg = smooth(tiny_config(dataset, tmp_path, model=lm.config))
    init = jax.tree.map(np.asarray, lm.params)
    ref_losses, ref_params, _ = run_steps(cfg, None, 1, dataset, init)
    losses, params, _ = run_steps(cfg, MESH, 1, dataset, init)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())


# ---------------------------------------------------------------------------------------------------
# config.json both ways

# config.json files as the hub has them (old spellings included), and the presets they are
PYTHIA_70M = {
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
    "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8, "num_hidden_layers": 6,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.24.0", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304,
}  # fmt: skip
GPT_NEO_125M = {
    "activation_function": "gelu_new", "architectures": ["GPTNeoForCausalLM"], "attention_dropout": 0,
    "attention_layers": ["global", "local"] * 6, "attention_types": [[["global", "local"], 6]], "bos_token_id": 50256,
    "embed_dropout": 0, "eos_token_id": 50256, "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": None, "layer_norm_epsilon": 1e-05, "max_position_embeddings": 2048, "model_type": "gpt_neo",
    "num_heads": 12, "num_layers": 12, "resid_dropout": 0, "vocab_size": 50257, "window_size": 256,
}  # fmt: skip
CODEGEN_350M = {
    "activation_function": "gelu_new", "architectures": ["CodeGenForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 50256, "layer_norm_epsilon": 1e-05, "model_type": "codegen", "n_ctx": 2048, "n_embd": 1024,
    "n_head": 16, "n_inner": None, "n_layer": 20, "n_positions": 2048, "rotary_dim": 32, "tie_word_embeddings": False,
    "torch_dtype": "float16", "vocab_size": 51200,
}  # fmt: skip
GPTJ_6B = {
    "activation_function": "gelu_new", "architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_embd": 4096,
    "n_head": 16, "n_inner": None, "n_layer": 28, "n_positions": 2048, "rotary_dim": 64, "vocab_size": 50400,
    "tie_word_embeddings": False, "layer_norm_epsilon": 1e-05,
}  # fmt: skip


@pytest.mark.parametrize(
    "hub, want",
    [
        # the tokenizer's 50277 ids are not in config.json: import keeps every row
        (PYTHIA_70M, config.preset("pythia-70m").replace(n_vocab_used=50304)),
        (GPT_NEO_125M, config.preset("gpt-neo-125m")),
        (GPTJ_6B, config.preset("gptj-6b")),
        (
            CODEGEN_350M,
            meshlm.ModelConfig(n_layer=20, d_model=1024, n_head=16, d_ff=4096, rotary_dim=32, vocab_size=51200),
        ),
    ],
    ids=["pythia-70m", "gpt-neo-125m", "gptj-6b", "codegen-350m"],
)
def test_hub_config_json_maps_to_the_model(hub, want):
    assert hf.from_hf_config(hub) == want


@pytest.mark.parametrize(
    "cfg",
    [
        config.preset("gptj-6b"),
        config.preset("pythia-160m"),
        config.preset("pythia-160m").replace(residual="sequential", qkv_bias=False, out_bias=False, rotary_dim=16),
        config.preset("gpt-neo-1.3b"),
        config.preset("gpt-neo-1.3b").replace(attention_layers=("global",), local_window=0, tie_embeddings=False),
        config.preset("test-full-rotary"),
    ],
    ids=["gptj-6b", "pythia-160m", "neox-sequential", "gpt-neo-1.3b", "gpt-neo-global", "test-full-rotary"],
)
def test_exported_config_round_trips_directly_and_through_transformers_config_class(cfg):
    """What meshlm writes, read back by meshlm and by transformers' own config class (whose to_dict spells
    NeoX's rotary settings the transformers-5 way), is the same model (the tokenizer's id count aside)."""
    written = hf.to_hf_config(cfg)
    expected = cfg.replace(n_vocab_used=hf.from_hf_config(written).n_vocab_used)
    assert hf.from_hf_config(written) == expected
    model_type = written.pop("model_type")
    assert hf.from_hf_config(AutoConfig.for_model(model_type, **written).to_dict()) == expected


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


@pytest.mark.parametrize(
    "hf_config, message",
    [
        (_with(GPTJ_6B, model_type="llama"), "model_type 'llama' is not supported; meshlm reads 'gptj', 'gpt_neox', "),
        ({"model_type": "gptj", "n_embd": 64, "n_head": 4}, r"missing key\(s\) \['n_layer', 'vocab_size'\]"),
        (_with(GPTJ_6B, activation_function="relu"), "activation_function 'relu' is not supported"),
        (_with(GPTJ_6B, rotary_dim=300), r"rotary_dim \(300\) must be <= d_head"),
        (_with(GPTJ_6B, n_layer=0), "n_layer must be an integer >= 1, got 0"),
        (
            {k: v for k, v in PYTHIA_70M.items() if k != "intermediate_size"},
            r"missing key\(s\) \['intermediate_size'\]",
        ),
        (_with(PYTHIA_70M, num_attention_heads=7), r"num_attention_heads \(7\) must divide hidden_size \(512\)"),
        (_with(PYTHIA_70M, rotary_pct=1.5), r"rotary_pct must be in \[0, 1\]"),
        (
            _with(PYTHIA_70M, rotary_pct=0.203125),
            r"rotary_pct must be .* an even number of rotary dims of 64, got 0.203125",
        ),
        (_with(PYTHIA_70M, rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type 'linear' is not"),
        (_with(PYTHIA_70M, rope_parameters={"rope_theta": -1.0}), "rope_parameters.rope_theta must be a number > 0"),
        (_with(PYTHIA_70M, hidden_act="relu"), "hidden_act 'relu' is not supported"),
        (_with(PYTHIA_70M, layer_norm_eps=-1), "layer_norm_eps must be a number > 0, got -1"),
        (_with(PYTHIA_70M, use_parallel_residual="yes"), "use_parallel_residual must be true or false"),
        (_with(GPT_NEO_125M, window_size=0), "window_size must be an integer >= 1, got 0"),
        (_with(GPT_NEO_125M, attention_types=[[["global", "sparse"], 6]]), "attention_types may name only 'global'"),
        (_with(GPT_NEO_125M, attention_types=[[["global", "local"], 5]]), "attention_types gives 10 layers but num_"),
        (_with(CODEGEN_350M, n_embd=1026, n_head=18), "n_embd must be a multiple of 4"),
    ],
)
def test_bad_config_json_is_refused_naming_the_key(hf_config, message):
    with pytest.raises(ConfigError, match=message) as e:
        hf.from_hf_config(hf_config)
    assert str(e.value).startswith("config.json: ") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "base, changes, message",
    [
        (
            "test-tiny",
            dict(norm="rmsnorm"),
            "represents norm 'rmsnorm' \\(transformers' GPTJForCausalLM needs 'layernorm'\\)",
        ),
        ("test-tiny", dict(position="t5", rotary_dim=0), "represents position 't5'"),
        ("test-tiny", dict(rotary_style="half"), "represents rotary_style 'half'"),
        (
            "test-tiny",
            dict(attention_layers=("global", "local"), local_window=4),
            "attention_layers \\('global', 'local'\\)",
        ),
        ("pythia-70m", dict(residual="parallel"), "residual 'parallel' \\(transformers' GPTNeoXForCausalLM needs"),
        ("pythia-70m", dict(out_bias=False), "qkv_bias \\(True\\) and out_bias \\(False\\) differ"),
    ],
)
def test_a_config_no_transformers_architecture_represents_is_refused_before_writing(base, changes, message, tmp_path):
    cfg = config.preset(base).replace(
        **changes, n_layer=2, d_model=64, n_head=4, d_ff=64, vocab_size=128, n_vocab_used=128
    )
    with pytest.raises(ConfigError, match=message):
        hf.to_hf_config(cfg)
    lm = meshlm.from_config(cfg)
    with pytest.raises(ConfigError, match=message):
        hf.write(tmp_path / "out", cfg, "float32", Placed(lm.params))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=message):
        lm.save(tmp_path / "saved", format="hf")


# ---------------------------------------------------------------------------------------------------
# Folders whose tensors do not match their config.json


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _drop_tensor(folder: Path, name: str) -> None:
    weights = tensors(folder)
    del weights[name]
    save_file(weights, folder / "model.safetensors")


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("neox-parallel", lambda f: _edit_config(f, model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (
            "neox-parallel",
            lambda f: _edit_config(f, attention_bias=False),
            r"has tensor\(s\) \['gpt_neox.layers.0.attention.dense.bias', .* that config.json does not imply",
        ),
        (
            "neox-parallel",
            lambda f: _edit_config(f, intermediate_size=256),
            r"tensor gpt_neox.layers.0.mlp.dense_h_to_4h.weight has shape \[128, 64\], config.json implies \[256, 64\]",
        ),
        (
            "gpt-neo",
            lambda f: _edit_config(f, max_position_embeddings=32),
            r"tensor transformer.wpe.weight has shape \[64, 64\], config.json implies \[32, 64\]",
        ),
        (
            "codegen",
            lambda f: _drop_tensor(f, "transformer.h.1.attn.qkv_proj.weight"),
            r"lacks tensor\(s\) \['transformer.h.1.attn.qkv_proj.weight'\]",
        ),
    ],
    ids=["model_type", "extra-biases", "intermediate_size", "positions", "missing-qkv"],
)
def test_a_folder_that_does_not_match_its_config_is_refused_in_one_line(family, name, damage, message, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(family(name).path, folder)
    damage(folder)
    for to in ("hf", "meshlm"):
        with pytest.raises(ConfigError, match=message) as e:
            meshlm.convert(folder, tmp_path / to, to=to)
        assert "\n" not in str(e.value)
        assert not (tmp_path / to).exists()
    with pytest.raises(ConfigError, match=message):
        meshlm.load(folder)


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_rotary_is_a_signed_permutation_and_the_forward_slices_no_head(style):
    """The rotation matrix gives each rotary dimension its textbook partner (GPT-J's every-two pairs, NeoX's
    halves), the rest zero; the model's lowered forward slices nothing (the old rotary sliced each head, with
    a stride for GPT-J's pairs, which on a TPU moves the head dimension off its 128 lanes: a third of a GPT-J
    training step; BENCHMARKS.md)."""
    from meshlm import model

    cfg = config.preset("gptj-tiny").replace(rotary_style=style)
    rot = cfg.rotary_dim
    assert 0 < rot < cfg.d_head
    x = np.random.default_rng(0).normal(size=(3, cfg.d_head)).astype(np.float32)
    head = x[:, :rot]
    if style == "interleaved":
        textbook = np.stack([-head[:, 1::2], head[:, ::2]], axis=-1).reshape(head.shape)
    else:
        textbook = np.concatenate([-head[:, rot // 2 :], head[:, : rot // 2]], axis=-1)
    turned = x @ model.rotation(cfg)
    np.testing.assert_array_equal(turned[:, :rot], textbook)
    np.testing.assert_array_equal(turned[:, rot:], 0)

    params = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0), "float32"))
    tokens = jax.ShapeDtypeStruct((2, 16), np.int32)
    text = jax.jit(lambda p, t: model.forward(p, t, cfg)).lower(params, tokens).as_text()
    slices = [line.strip() for line in text.splitlines() if "stablehlo.slice" in line]
    assert not slices, slices[:2]
