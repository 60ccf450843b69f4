"""The seed's step_N/shard_s/*.npz checkpoints: logits parity with transformers through load and conversion.

The oracle is `tests/mtj_fixture.py`, which writes a random `GPTJForCausalLM` in the seed's layout from
the format's description and returns the torch model holding exactly the weights the files encode.
"""

import copy
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch

import meshlm
from meshlm import ConfigError, api, cli
from meshlm.formats import hf, mtj, native, registry
from meshlm.sharding import make_mesh
from tests import oracle
from tests.mtj_fixture import SeedCheckpoint, write_seed_checkpoint

# 11 layers, so the seed's sorted order puts layer_10 before layer_2.
CONFIG = dict(n_embd=32, n_layer=11, n_head=4, rotary_dim=4, vocab_size=128, n_inner=64, n_positions=64)
MESH = "model=2,fsdp=4"  # every seed load goes straight into a sharded layout; one compiled forward
TOKENS = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (2, 13))


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """seed(shards, dtype, full) -> a seed checkpoint of one random GPT-J, written once per variant."""
    source = oracle.random_gptj(seed=3, **CONFIG)
    written: dict[tuple, SeedCheckpoint] = {}

    def get(shards: int, dtype: str = "float32", full: bool = False) -> SeedCheckpoint:
        key = (shards, dtype, full)
        if key not in written:
            root = tmp_path_factory.mktemp(f"seed_{shards}_{dtype}_{'full' if full else 'slim'}")
            written[key] = write_seed_checkpoint(root, source, shards, dtype, full, seed=shards)
        return written[key]

    return get


def torch_logits(m: torch.nn.Module, tokens: np.ndarray = TOKENS) -> np.ndarray:
    with torch.no_grad():
        return m(torch.as_tensor(tokens)).logits.float().numpy()


VARIANTS = [(s, d, f) for s in (1, 2, 4) for d in ("float32", "bfloat16") for f in (False, True)] + [
    (2, "float16", False)
]


@pytest.mark.parametrize(("shards", "dtype", "full"), VARIANTS, ids=lambda v: str(v).replace("True", "full"))
def test_load_gives_the_torch_logits(seed, shards, dtype, full):
    ck = seed(shards, dtype, full)
    lm = meshlm.load(ck.step_dir, mesh=MESH, seed_config=ck.seed_config)
    assert lm.config.n_layer == 11 and lm.config.vocab_size == 128 and lm.config.d_ff == 64
    assert lm.params["layers"]["attn"]["q"].sharding.spec[2] == "model"
    # The reference holds the stored (rounded) weights in fp32, so every storage dtype is exact to fp32.
    np.testing.assert_allclose(lm.logits(TOKENS), torch_logits(ck.model), atol=1e-4, rtol=0)


def test_shape_detection_without_seed_config_uses_gptj_head_size(tmp_path):
    """GPT-J's head size 256 and rotary_dim 64 when no seed config says otherwise."""
    cfg = dict(n_embd=512, n_layer=1, n_head=2, rotary_dim=64, vocab_size=64, n_inner=64, n_positions=2048)
    ck = write_seed_checkpoint(tmp_path, oracle.random_gptj(seed=5, std=0.05, **cfg), shards=2)
    lm = meshlm.load(ck.step_dir)
    assert (lm.config.n_head, lm.config.rotary_dim, lm.config.max_seq_len) == (2, 64, 2048)
    tokens = TOKENS[:1, :5] % 64
    np.testing.assert_allclose(lm.logits(tokens), torch_logits(ck.model, tokens), atol=1e-4, rtol=0)


def test_cli_convert_to_hf_loads_in_transformers(seed, tmp_path):
    ck = seed(4, "bfloat16", True)
    out = tmp_path / "hf"
    assert cli.main(["convert", str(ck.step_dir), str(out), "--to", "hf", "--seed-config", str(ck.seed_config)]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    np.testing.assert_allclose(torch_logits(oracle.load_hf(out)), torch_logits(ck.model), atol=1e-4, rtol=0)


def test_streamed_hf_conversion_in_bf16_and_in_several_files(seed, tmp_path):
    ck = seed(2, "float32", True)
    cfg, source = mtj.open(ck.step_dir, "bfloat16", ck.seed_config)
    hf.write(tmp_path / "hf", cfg, "bfloat16", source, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    from safetensors import safe_open

    first = sorted(set(index["weight_map"].values()))[0]
    with safe_open(str(tmp_path / "hf" / first), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    reference = copy.deepcopy(ck.model)
    with torch.no_grad():
        for p in reference.parameters():  # the same round-to-nearest of the same fp32 weights
            p.copy_(p.to(torch.bfloat16).float())
    np.testing.assert_allclose(
        torch_logits(oracle.load_hf(tmp_path / "hf")), torch_logits(reference), atol=1e-4, rtol=0
    )


def test_converted_to_meshlm_format_restores_on_several_meshes(seed, tmp_path):
    ck = seed(4, "float32", False)
    api.convert(ck.step_dir, tmp_path / "ckpt", to="meshlm", seed_config=ck.seed_config)
    expected = torch_logits(ck.model)
    for mesh in ("data=2,model=4", MESH):
        lm = meshlm.load(tmp_path / "ckpt", mesh=mesh)
        np.testing.assert_allclose(lm.logits(TOKENS), expected, atol=1e-4, rtol=0)


def test_meshlm_conversion_streams_slices_that_do_not_divide_the_parameters(seed, tmp_path, monkeypatch):
    """Slices of 1,000 bytes: several per parameter, the last one short; bf16 output equals a bf16 load."""
    ck = seed(2, "bfloat16", True)
    monkeypatch.setattr(native, "SLICE_BYTES", 1000)
    args = ["convert", str(ck.step_dir), str(tmp_path / "ckpt"), "--to", "meshlm", "--out-dtype", "bfloat16"]
    assert cli.main([*args, "--seed-config", str(ck.seed_config)]) == 0
    assert native.read_description(tmp_path / "ckpt")["dtype"] == "bfloat16"
    converted = meshlm.load(tmp_path / "ckpt", mesh=MESH, dtype="bfloat16")
    direct = meshlm.load(ck.step_dir, mesh=MESH, dtype="bfloat16", seed_config=ck.seed_config)
    pairs = zip(jax.tree_util.tree_leaves_with_path(converted.params), jax.tree.leaves(direct.params), strict=True)
    for (path, a), b in pairs:
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def test_run_folder_loads_the_latest_step_named_in_meta_json(seed, tmp_path):
    ck = seed(2, "float32", False)
    root = tmp_path / "run"
    shutil.copytree(ck.step_dir, root / ck.step_dir.name)
    (root / "step_10").mkdir()  # an older step, not the one meta.json names last
    (root / "meta.json").write_text(json.dumps({"step": ck.step, "checkpoints": [10, ck.step], "aux": {}}))
    assert registry.detect(root) == "mtj"
    lm = meshlm.load(root, mesh=MESH, seed_config=ck.seed_config)
    np.testing.assert_allclose(lm.logits(TOKENS), torch_logits(ck.model), atol=1e-4, rtol=0)


def test_fsspec_url(seed, tmp_path):
    import fsspec

    ck = seed(2, "bfloat16", False)
    fs = fsspec.filesystem("memory")
    fs.put(str(ck.step_dir), "/seedrun/step", recursive=True)
    lm = meshlm.load("memory://seedrun/step", mesh=MESH, seed_config=ck.seed_config)
    np.testing.assert_allclose(lm.logits(TOKENS), torch_logits(ck.model), atol=1e-4, rtol=0)
    meshlm.convert("memory://seedrun/step", tmp_path / "hf", to="hf", seed_config=ck.seed_config)
    np.testing.assert_allclose(torch_logits(oracle.load_hf(tmp_path / "hf")), torch_logits(ck.model), atol=1e-4)


def test_adam_moments_import_in_meshlm_layout(seed, tmp_path):
    ck = seed(4, "float32", True)
    mesh = make_mesh(MESH)
    state = mtj.load_optimizer_moments(ck.step_dir, mesh, seed_config=ck.seed_config)
    assert (state.step, state.count) == (ck.step, ck.adam_count)
    for name, moments_model in (("mu", ck.mu), ("nu", ck.nu)):
        moments_model.save_pretrained(tmp_path / name)  # the HF import is the layout oracle
        expected = meshlm.load(tmp_path / name).params
        got = getattr(state, name)
        assert got["layers"]["mlp"]["fc_in"]["w"].sharding.spec[2] == "model"
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, expected)

    # How `meshlm train --resume-optimizer` continues the run: the moments go into an optax AdamW state.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(0.0, 1e-4, 100)))
    resumed = state.into(tx.init(state.mu))
    for name in ("mu", "nu"):  # placed as loaded, not copied
        placed = jax.tree.leaves(optax.tree_utils.tree_get(resumed, name))
        assert all(a is b for a, b in zip(placed, jax.tree.leaves(getattr(state, name)), strict=True))
    counts = [c for _, c in optax.tree_utils.tree_get_all_with_path(resumed, "count")]
    assert [int(c) for c in counts] == [ck.adam_count, ck.adam_count]  # Adam's and the schedule's
    assert counts[0] is not counts[1]  # a jitted step donating the state refuses one buffer given twice


def test_slim_checkpoint_has_no_moments(seed):
    ck = seed(2, "bfloat16", False)
    with pytest.raises(ConfigError, match="slim checkpoint"):
        mtj.load_optimizer_moments(ck.step_dir, make_mesh(None), seed_config=ck.seed_config)


# ---------------------------------------------------------------------------------------------------
# Errors


@pytest.fixture
def damaged(seed, tmp_path) -> Path:
    """A writable copy of a 4-shard full checkpoint to break."""
    ck = seed(4, "float32", True)
    shutil.copytree(ck.step_dir, tmp_path / "step")
    shutil.copy(ck.seed_config, tmp_path / "seed.json")
    return tmp_path / "step"


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        meshlm.load(path, seed_config=path.parent / "seed.json")
    return str(e.value)


def test_folder_that_is_not_a_checkpoint(damaged):
    for p in damaged.iterdir():
        shutil.rmtree(p)
    assert "not a checkpoint meshlm can read" in load_error(damaged)
    (damaged / "shard_0").mkdir()
    assert "shard_0/0.npz: missing" in load_error(damaged)


def test_missing_shard(damaged):
    shutil.rmtree(damaged / "shard_1")
    assert "shard folder(s) ['shard_1'] missing" in load_error(damaged)


def test_missing_last_shard(damaged):
    shutil.rmtree(damaged / "shard_3")
    assert "implies 4 shards: is a shard_ folder missing?" in load_error(damaged)


def test_missing_chunk(damaged):
    (damaged / "shard_2" / "7.npz").unlink()
    assert "shard_2/7.npz: missing" in load_error(damaged)


def test_truncated_npz(damaged):
    chunk = damaged / "shard_0" / "3.npz"
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    assert "shard_0/3.npz: not a complete npz file, perhaps truncated mid-write" in load_error(damaged)


def _rewrite_chunk(path: Path, change) -> None:
    with np.load(path) as z:
        arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    with open(path, "wb") as f:
        np.savez(f, *change(arrays))


def test_shape_that_fits_no_gptj(damaged):
    # chunk 15 ends with projection_shard's linear {b, w}, its norm {offset, scale} and step: lengthen b
    _rewrite_chunk(damaged / "shard_1" / "15.npz", lambda a: [*a[:-5], np.zeros(a[-5].size + 1, a[-5].dtype), *a[-4:]])
    message = load_error(damaged)
    assert "shard_1: params projection_shard/~/linear/b has shape [33], expected [32]" in message


def test_leaf_count_that_fits_no_gptj(damaged):
    _rewrite_chunk(damaged / "shard_0" / "4.npz", lambda a: a[:-1])
    assert "fits no checkpoint of the seed with pe 'rotary', norm 'layernorm'" in load_error(damaged)


def test_unknown_head_count_asks_for_the_seed_config(seed):
    ck = seed(1)
    with pytest.raises(ConfigError, match="pass the seed's run JSON"):
        meshlm.load(ck.step_dir)


def test_seed_config_of_another_model_is_refused(damaged):
    seed_config = damaged.parent / "seed.json"
    seed_config.write_text(json.dumps({**json.loads(seed_config.read_text()), "d_model": 64}))
    assert "the seed config gives d_model 64, the checkpoint holds 32" in load_error(damaged)


def test_cli_reports_a_one_line_error(damaged, capsys):
    (damaged / "shard_2" / "0.npz").unlink()
    assert cli.main(["convert", str(damaged), str(damaged.parent / "out"), "--to", "hf"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm convert: error: ") and "0.npz: missing" in err and "\n" not in err
