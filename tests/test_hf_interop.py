"""Logits parity with transformers' GPT-J (and CodeGen, the same math) through import and export, and clear
errors for bad folders."""

import copy
import json
import shutil

import numpy as np
import pytest
import torch

import meshlm
from meshlm import ConfigError, cli
from tests import oracle

CONFIGS = {
    "rotary<d_head": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=512, n_positions=64),
    "rotary=d_head": dict(n_embd=48, n_layer=3, n_head=3, rotary_dim=16, vocab_size=300, n_positions=64),
    "one-head,n_inner": dict(n_embd=32, n_layer=1, n_head=1, rotary_dim=4, vocab_size=128, n_inner=80, n_positions=64),
    "tied-head": dict(
        n_embd=32, n_layer=1, n_head=2, rotary_dim=4, vocab_size=128, n_positions=64, tie_word_embeddings=True
    ),
    # 3 heads of 32 in CodeGen's 4 qkv_proj groups of 24 rows: heads straddle the groups (exported as GPT-J)
    "codegen,heads-across-groups": dict(
        model_type="codegen", n_embd=96, n_layer=1, n_head=3, rotary_dim=8, vocab_size=128, n_positions=64
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_and_export_match_transformers_logits(name, tmp_path):
    ref = oracle.make_hf_model(tmp_path / "hf", seed=len(name), **CONFIGS[name])
    tokens = np.random.default_rng(1).integers(0, CONFIGS[name]["vocab_size"], (3, 17))
    expected = ref.logits(tokens)

    lm = meshlm.load(ref.path)
    np.testing.assert_allclose(lm.logits(tokens), expected, atol=1e-4, rtol=0)

    lm.save(tmp_path / "export", format="hf")
    exported = oracle.load_hf(tmp_path / "export")
    with torch.no_grad():
        back = exported(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(back, expected, atol=1e-4, rtol=0)


def test_export_in_half_precision_loads_in_transformers(hf_tiny, tmp_path):
    lm = meshlm.load(hf_tiny.path)
    tokens = np.arange(24).reshape(2, 12)
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        lm.save(tmp_path / dtype, format="hf", dtype=dtype)
        m = oracle.load_hf(tmp_path / dtype)
        assert json.loads((tmp_path / dtype / "config.json").read_text())["torch_dtype"] == dtype
        from safetensors import safe_open

        with safe_open(str(tmp_path / dtype / "model.safetensors"), framework="pt") as f:
            assert f.get_tensor("lm_head.weight").dtype == torch_dtype
        rounded = copy.deepcopy(hf_tiny.torch_model)  # the reference with every weight rounded the same way
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.to(torch_dtype).float())
            got, want = (model(torch.as_tensor(tokens)).logits.numpy() for model in (m, rounded))
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_sharded_safetensors_export_and_import(hf_tiny, tmp_path):
    lm = meshlm.load(hf_tiny.path)
    from meshlm.formats import hf
    from meshlm.formats.slices import Placed

    hf.write(tmp_path / "sharded", lm.config, "float32", Placed(lm.params), max_shard_bytes=100_000)
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 3
    tokens = np.arange(30).reshape(1, 30)
    np.testing.assert_allclose(
        oracle.load_hf(tmp_path / "sharded")(torch.as_tensor(tokens)).logits.detach().numpy(),
        hf_tiny.logits(tokens),
        atol=1e-4,
    )
    again = meshlm.load(tmp_path / "sharded", mesh="model=4,fsdp=2")
    np.testing.assert_allclose(again.logits(tokens), hf_tiny.logits(tokens), atol=1e-4)


def test_pytorch_model_bin_folder_imports(tmp_path):
    ref = oracle.make_hf_model(tmp_path / "bin", safe_serialization=False, **CONFIGS["rotary<d_head"])
    assert (ref.path / "pytorch_model.bin").exists()
    tokens = np.arange(20).reshape(2, 10)
    np.testing.assert_allclose(meshlm.load(ref.path).logits(tokens), ref.logits(tokens), atol=1e-4)


def test_meshlm_checkpoint_round_trip_onto_another_mesh(hf_tiny, tmp_path):
    tokens = np.arange(40).reshape(2, 20)
    meshlm.load(hf_tiny.path, mesh="fsdp=8").save(tmp_path / "ckpt")
    lm = meshlm.load(tmp_path / "ckpt", mesh="data=2,model=4")
    assert lm.params["layers"]["attn"]["q"].sharding.spec[2] == "model"
    np.testing.assert_allclose(lm.logits(tokens), hf_tiny.logits(tokens), atol=1e-4)


def test_streamed_conversions_between_the_formats(hf_tiny, tmp_path):
    """`meshlm convert` streams every pair: HF -> meshlm (zarr arrays), that -> HF, and a checkpoint
    orbax wrote itself (OCDBT) -> HF; each result restores on a mesh or loads in transformers unchanged."""
    tokens = np.arange(40).reshape(2, 20)
    meshlm.convert(hf_tiny.path, tmp_path / "streamed", to="meshlm")
    lm = meshlm.load(tmp_path / "streamed", mesh="fsdp=2,model=4")
    np.testing.assert_allclose(lm.logits(tokens), hf_tiny.logits(tokens), atol=1e-4)
    lm.save(tmp_path / "orbax")
    for name in ("streamed", "orbax"):
        meshlm.convert(tmp_path / name, tmp_path / f"{name}-hf", to="hf")
        back = oracle.open_hf(tmp_path / f"{name}-hf")
        np.testing.assert_allclose(back.logits(tokens), hf_tiny.logits(tokens), atol=1e-4)


def test_folder_without_weights_is_refused(hf_tiny, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    shutil.copy(hf_tiny.path / "config.json", folder)
    with pytest.raises(ConfigError, match="no model.safetensors"):
        meshlm.load(folder)


@pytest.mark.parametrize(
    "index, message",
    [
        ('{"metadata": {}}', "has no 'weight_map'"),
        ('{"weight_map": ', "not valid JSON"),
    ],
)
def test_a_damaged_safetensors_index_is_named(hf_tiny, tmp_path, index, message):
    folder = tmp_path / "indexed"
    folder.mkdir()
    shutil.copy(hf_tiny.path / "config.json", folder)
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ConfigError, match=rf"model.safetensors.index.json: {message}"):
        meshlm.load(folder)


def test_weights_that_do_not_match_the_config_are_refused(hf_tiny, tmp_path):
    folder = tmp_path / "mismatch"
    shutil.copytree(hf_tiny.path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "n_inner": 128}))
    with pytest.raises(ConfigError, match=r"mlp.fc_in.weight has shape \[256, 64\], config.json implies \[128, 64\]"):
        meshlm.load(folder)


def test_missing_tensor_is_named(hf_tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "missing"
    shutil.copytree(hf_tiny.path, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.bias"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"lacks tensor\(s\) \['lm_head.bias'\]"):
        meshlm.load(folder)


def test_truncated_safetensors_is_refused(hf_tiny, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(hf_tiny.path, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        meshlm.load(folder)


def test_converting_a_damaged_meshlm_checkpoint_names_the_parameter(hf_tiny, tmp_path, capsys):
    meshlm.convert(hf_tiny.path, tmp_path / "ckpt", to="meshlm")
    shutil.rmtree(tmp_path / "ckpt" / "params" / "layers.attn.q")
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm convert: error: ") and "parameter layers.attn.q could not be opened" in err
    assert ".zarray" in err and "does not exist" in err and "\n" not in err


def test_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory"):
        meshlm.load(tmp_path / "nope")
    with pytest.raises(ConfigError, match="not a checkpoint meshlm can read"):
        meshlm.load(tmp_path)
