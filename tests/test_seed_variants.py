"""The seed's `pe` and `norm` variants: its checkpoints load, convert and resume with the seed's logits.

The reference is `seed_logits`, numpy written from the seed's `mesh_transformer/layers.py` alone: it
runs every model shard's part of each module on that shard's own parameters, as the seed does, and
combines the shards as the seed's collectives do (psum of the layers' outputs, all_gather of the
positions and the logits, shard 0's copy of a ReplicatedLayerNorm, pmean of an RMSNorm, each shard's
own hk.LayerNorm under layernorm-desync). The checkpoints are random in every tensor and every shard
(tests/mtj_fixture.py), so a reader that combines any of them the wrong way shows in the logits.
"""

import json

import jax
import numpy as np
import optax
import pytest

import meshlm
from meshlm import ConfigError, api, cli, data, model, optim
from meshlm.formats import mtj
from meshlm.formats.mtj_config import from_seed_config
from meshlm.loader import TrainLoader
from meshlm.sharding import make_mesh
from tests.mtj_fixture import ROOT, ShardParams, VariantCheckpoint, write_variant_checkpoint

RUN = {"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 64, "seq": 16, "pe_rotary_dims": 4}
MESH = "model=2,fsdp=2"
TOKENS = np.random.default_rng(1).integers(0, RUN["n_vocab"], (2, 11))
POSITIONS = {"rotary": "rotary", "fixed": "learned", "t5": "t5"}  # the seed's pe -> ModelConfig's position
NORMS = ("layernorm", "layernorm-desync", "layernorm-nobias", "rmsnorm", "scalenorm", "rmsnorm-bias", "scalenorm-bias")


# ---------------------------------------------------------------------------------------------------
# The reference: the seed's forward pass, shard by shard, in float64


def _norm(x: np.ndarray, shards: list[ShardParams], s: int, prefix: str, kind: str) -> np.ndarray:
    """Shard s's view of the norm `prefix`: getnorm(kind) of the seed."""
    prefix = ROOT + prefix
    if kind == "layernorm-desync":  # hk.LayerNorm: this shard's own parameters
        p = shards[s][prefix + "layer_norm"]
    elif kind.startswith("layernorm"):  # ReplicatedLayerNorm: all_gather(...)[0], shard 0's copy
        p = shards[0][prefix + "replicated_layer_norm"]
    else:  # RMSNorm: pmean of the shards' copies
        p = {k: np.mean([sh[prefix + "rms_norm"][k] for sh in shards], axis=0) for k in shards[0][prefix + "rms_norm"]}
    if kind.startswith("layernorm"):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        y = (x - mean) / np.sqrt(var + 1e-5) * p["scale"]
        return y if kind == "layernorm-nobias" else y + p["offset"]
    y = x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-5) * p["scale"]
    return y + p["offset"] if kind.endswith("-bias") else y


def _rotary(x: np.ndarray, dims: int) -> np.ndarray:
    """x [T, heads, d_head]: fixed_pos_embedding + apply_rotary_pos_emb on the first `dims` of each head."""
    rot, rest = x[..., :dims], x[..., dims:]
    inv_freq = 1.0 / (10000 ** (np.arange(0, dims, 2) / dims))
    angles = np.repeat(np.arange(x.shape[0])[:, None] * inv_freq, 2, axis=-1)[:, None, :]
    every_two = np.stack([-rot[..., 1::2], rot[..., ::2]], axis=-1).reshape(rot.shape)
    return np.concatenate([rot * np.cos(angles) + every_two * np.sin(angles), rest], axis=-1)


def _t5_buckets(length: int) -> np.ndarray:
    """RelativePositionEmbs._relative_position_bucket of every (query, key) pair: [T, T]."""
    n = np.maximum(np.arange(length)[:, None] - np.arange(length)[None, :], 0)
    large = 16 + (np.log(n.astype(np.float32) / 16 + np.finfo(np.float32).eps) / np.log(128 / 16) * 16).astype(int)
    return np.where(n < 16, n, np.minimum(large, 31))


def _one_hot(ids: np.ndarray, n: int) -> np.ndarray:
    """jax.nn.one_hot: rows of zeros for ids outside 0..n-1 (another shard's vocabulary)."""
    return (ids[:, None] == np.arange(n)).astype(np.float64)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _sequence_logits(shards: list[ShardParams], run: dict, tokens: np.ndarray) -> np.ndarray:
    S, T, (D, H, V) = len(shards), len(tokens), (run["d_model"], run["n_heads"], run["n_vocab"])
    K, pe, kind = D // H, run["pe"], run["norm"]
    shards = jax.tree.map(lambda a: np.asarray(a, np.float64), shards)
    p = lambda s, module: shards[s][ROOT + module]

    # EmbeddingShard: each shard's one-hot of its vocabulary slice through its linear (bias too), psum
    x = sum(
        _one_hot(tokens - s * V // S, V // S) @ p(s, "embedding_shard/~/linear")["w"]
        + p(s, "embedding_shard/~/linear")["b"]
        for s in range(S)
    )
    if pe == "fixed":  # all_gather of the shards' column slices
        x = x + np.concatenate([p(s, "embedding_shard")["pos_embs"] for s in range(S)], axis=-1)[:T]
    bias = -1e10 * (1 - np.tril(np.ones((T, T))))
    for i in range(run["layers"]):
        layer, out = f"layer_{i}/~/", 0
        for s in range(S):
            h = _norm(x, shards, s, layer, kind)
            q, v, k = ((h @ p(s, layer + m)["w"]).reshape(T, H // S, K) for m in ("linear", "linear_1", "linear_2"))
            if pe == "rotary":
                q, k = _rotary(q, run["pe_rotary_dims"]), _rotary(k, run["pe_rotary_dims"])
            scores = np.einsum("thd,Thd->htT", q, k) / np.sqrt(K) + bias
            if pe == "t5":
                scores = scores + p(s, "relative_position_embs")["rel_embedding"][:, _t5_buckets(T)]
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            attn = np.einsum("htT,Thd->thd", weights, v).reshape(T, D // S) @ p(s, layer + "linear_3")["w"]
            ff = _gelu(h @ p(s, layer + "linear_4")["w"] + p(s, layer + "linear_4")["b"])
            out = out + attn + ff @ p(s, layer + "linear_5")["w"] + p(s, layer + "linear_5")["b"]
        x = x + out
    proj = "projection_shard/~/linear"
    return np.concatenate(
        [_norm(x, shards, s, "projection_shard/~/", kind) @ p(s, proj)["w"] + p(s, proj)["b"] for s in range(S)],
        axis=-1,
    )


def seed_logits(ck: VariantCheckpoint, tokens: np.ndarray = TOKENS) -> np.ndarray:
    return np.stack([_sequence_logits(ck.params, ck.run, row) for row in tokens])


# ---------------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """seed(pe, norm, shards, dtype, full) -> a random seed checkpoint of that variant, written once."""
    written: dict[tuple, VariantCheckpoint] = {}

    def get(pe: str, norm: str, shards: int, dtype: str = "float32", full: bool = False) -> VariantCheckpoint:
        key = (pe, norm, shards, dtype, full)
        if key not in written:
            root = tmp_path_factory.mktemp(f"seed_{pe}_{norm}_{shards}_{dtype}_{full}")
            written[key] = write_variant_checkpoint(
                root, {**RUN, "pe": pe, "norm": norm}, shards, dtype, full, seed=len(written)
            )
        return written[key]

    return get


# Every pe and every norm, in 1, 2 and 4 shards, layernorm-desync folded across 2 and 4 shards.
VARIANTS = [
    ("rotary", "layernorm", 2, "float32"),
    ("fixed", "layernorm", 2, "float32"),
    ("t5", "layernorm", 4, "float32"),
    ("rotary", "layernorm-desync", 2, "float32"),
    ("t5", "layernorm-desync", 4, "bfloat16"),
    ("fixed", "layernorm-desync", 1, "float32"),
    ("rotary", "layernorm-nobias", 2, "float32"),
    ("t5", "rmsnorm", 2, "float32"),
    ("fixed", "scalenorm", 2, "bfloat16"),
    ("rotary", "rmsnorm-bias", 4, "float32"),
    ("t5", "scalenorm-bias", 2, "float32"),
]


@pytest.mark.parametrize(("pe", "norm", "shards", "dtype"), VARIANTS, ids=["-".join(map(str, v)) for v in VARIANTS])
def test_load_gives_the_seeds_logits_on_one_device_and_on_a_mesh(seed, pe, norm, shards, dtype):
    ck = seed(pe, norm, shards, dtype)
    expected = seed_logits(ck)
    for mesh in (None, MESH):
        lm = meshlm.load(ck.step_dir, mesh=mesh, seed_config=ck.seed_config)
        np.testing.assert_allclose(lm.logits(TOKENS), expected, atol=1e-4, rtol=0, err_msg=str(mesh))
    c = lm.config
    assert (c.position, c.rotary_dim) == (POSITIONS[pe], 4 if pe == "rotary" else 0)
    assert c.qkv_bias == (norm == "layernorm-desync" and shards > 1)  # where each shard's norm is folded in
    if c.position == "t5":
        assert lm.params["rel_bias"]["w"].sharding.spec[0] == "model"


@pytest.mark.parametrize(
    ("pe", "norm", "shards"),
    [
        ("t5", "layernorm-desync", 2),
        ("fixed", "rmsnorm-bias", 4),
        ("rotary", "scalenorm", 2),
    ],
)
def test_converted_to_meshlm_format_restores_the_seeds_logits(seed, tmp_path, pe, norm, shards):
    ck = seed(pe, norm, shards)
    api.convert(ck.step_dir, tmp_path / "ckpt", to="meshlm", seed_config=ck.seed_config)
    lm = meshlm.load(tmp_path / "ckpt", mesh=MESH)
    np.testing.assert_allclose(lm.logits(TOKENS), seed_logits(ck), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("pe", "norm"), [("t5", "layernorm"), ("rotary", "rmsnorm"), ("rotary", "layernorm-desync")])
def test_conversion_to_hf_of_what_no_hf_architecture_holds_fails_in_one_line(seed, tmp_path, capsys, pe, norm):
    ck = seed(pe, norm, 2)
    out = tmp_path / "hf"
    assert cli.main(["convert", str(ck.step_dir), str(out), "--to", "hf", "--seed-config", str(ck.seed_config)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm convert: error: ") and "\n" not in err
    assert not out.exists() or not any(out.iterdir())  # an empty folder stays a valid destination


# ---------------------------------------------------------------------------------------------------
# Adam's moments


def _cols(trees: list[ShardParams], module: str, name: str) -> np.ndarray:
    return np.concatenate([t[ROOT + module][name] for t in trees], axis=-1)


def _rows(trees: list[ShardParams], module: str, name: str) -> np.ndarray:
    return np.concatenate([t[ROOT + module][name] for t in trees], axis=0)


@pytest.mark.parametrize(("pe", "norm"), [("fixed", "scalenorm-bias"), ("t5", "rmsnorm")])
def test_adam_moments_of_a_variant_in_meshlm_layout(seed, pe, norm):
    ck = seed(pe, norm, 2, full=True)
    state = mtj.load_optimizer_moments(ck.step_dir, make_mesh(MESH), seed_config=ck.seed_config)
    assert (state.step, state.count) == (ck.step, ck.adam_count)
    H, K = RUN["n_heads"], RUN["d_model"] // RUN["n_heads"]
    for name, trees in (("mu", ck.mu), ("nu", ck.nu)):
        got = jax.tree.map(np.asarray, getattr(state, name))
        first = trees[0]  # replicated or averaged copies, and per-shard biases: shard 0's moments
        expected = {
            "embed.w": _rows(trees, "embedding_shard/~/linear", "w"),
            "head.w": _cols(trees, "projection_shard/~/linear", "w"),
            "ln_f.scale": first[ROOT + "projection_shard/~/rms_norm"]["scale"],
            "layers.ln.scale": [first[ROOT + f"layer_{i}/~/rms_norm"]["scale"] for i in range(2)],
            "layers.mlp.fc_out.b": [first[ROOT + f"layer_{i}/~/linear_5"]["b"] for i in range(2)],
            "layers.attn.k": [_cols(trees, f"layer_{i}/~/linear_2", "w").reshape(-1, H, K) for i in range(2)],
        }
        if pe == "fixed":
            expected["pos_embed.w"] = _cols(trees, "embedding_shard", "pos_embs")
            expected["ln_f.bias"] = first[ROOT + "projection_shard/~/rms_norm"]["offset"]
        else:
            expected["rel_bias.w"] = _rows(trees, "relative_position_embs", "rel_embedding")
        flat = {model.param_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(got)[0]}
        for key, want in expected.items():
            np.testing.assert_array_equal(flat[key], np.asarray(want, np.float32), err_msg=f"{name} {key}")


def test_folded_desync_moments_are_refused_in_one_line(seed):
    ck = seed("rotary", "layernorm-desync", 2, full=True)
    with pytest.raises(ConfigError, match="layernorm-desync in 2 shards") as e:
        mtj.load_optimizer_moments(ck.step_dir, make_mesh(None), seed_config=ck.seed_config)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_full_variant_run_continues_with_its_adam_state(seed, tmp_path):
    from tests.helpers.seed_adam import ANNEAL, END_LR, EPS, LR, WD, adamw_step, saved_opt_state
    from tests.helpers.training import SEQ, tiny_config, write_dataset

    ck = seed("t5", "scalenorm-bias", 2, full=True)
    rows = np.random.default_rng(0).integers(0, RUN["n_vocab"], (16, SEQ + 1))
    dataset = write_dataset(tmp_path / "data", rows)
    cfg = tiny_config(dataset, tmp_path / "run", total_steps=ck.step + 1, mesh=MESH)
    cfg = cfg.replace(lr=LR, end_lr=END_LR, anneal_steps=ANNEAL, weight_decay=WD, eps=EPS)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    resume = ["--init-from", str(ck.step_dir), "--seed-config", str(ck.seed_config), "--resume-optimizer"]
    assert cli.main(["train", str(config), *resume, "--no-progress"]) == 0

    # The oracle: one step of the seed's AdamW (numpy) from the loaded parameters and moments.
    start = meshlm.load(ck.step_dir, seed_config=ck.seed_config)
    moments = mtj.load_optimizer_moments(ck.step_dir, make_mesh(None), seed_config=ck.seed_config)
    params, mu, nu = (jax.tree.map(np.asarray, t) for t in (start.params, moments.mu, moments.nu))
    tokens = next(TrainLoader(data.TokenDataset(dataset), cfg.batch_size, seed=cfg.seed)).tokens[0]
    grads = jax.tree.map(np.asarray, jax.grad(lambda p: model.loss(p, tokens, start.config)[0])(params))
    want, want_mu, _ = adamw_step(params, grads, mu, nu, ck.adam_count, optim.decay_mask(start.config))

    opt_state = saved_opt_state(tmp_path / "run", ck.step + 1, cfg)
    adam = optax.tree_utils.tree_get(opt_state, "ScaleByAdamState")
    assert int(adam.count) == ck.adam_count + 1
    got = meshlm.load(tmp_path / "run").params
    for name, tree, expected in (("params", got, want), ("mu", adam.mu, want_mu)):
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------------------------------
# The run JSON


@pytest.mark.parametrize("pe", ["rotary", "fixed", "t5"])
@pytest.mark.parametrize("norm", NORMS)
def test_from_seed_config_maps_every_pe_and_norm(pe, norm):
    got = from_seed_config({**RUN, "pe": pe, "norm": norm})["model"]
    assert (got["position"], got["rotary_dim"]) == (POSITIONS[pe], 4 if pe == "rotary" else 0)
    assert got["norm"] == ("layernorm" if norm == "layernorm-desync" else norm)
    meshlm.ModelConfig.from_dict(got)


@pytest.mark.parametrize(("key", "value"), [("pe", "alibi"), ("norm", "batchnorm")])
def test_unknown_pe_or_norm_is_a_one_line_error(seed, tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"seed config: {key} must be one of .* got '{value}'"):
        from_seed_config({**RUN, key: value})
    ck = seed("rotary", "layernorm", 2)
    bad = tmp_path / "seed.json"
    bad.write_text(json.dumps({**ck.run, key: value}))
    with pytest.raises(ConfigError, match=f"seed.json: {key} must be one of") as e:
        meshlm.load(ck.step_dir, seed_config=bad)
    assert "\n" not in str(e.value)


def test_a_variant_without_its_run_json_asks_for_it(seed):
    ck = seed("t5", "rmsnorm", 2)
    with pytest.raises(ConfigError, match="needs the seed's run JSON"):
        meshlm.load(ck.step_dir)
