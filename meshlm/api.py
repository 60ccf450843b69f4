"""`meshlm.load` and the loaded model: the one front door for the CLI, the server and the evaluator."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from meshlm import checkpoint, model
from meshlm.config import ConfigError, ModelConfig
from meshlm.formats import hf, mtj
from meshlm.sharding import batch_ways, describe, from_host, make_mesh, named_sharding, plan, to_host

SEQ_BUCKET = 64  # logits() pads sequence lengths up to a multiple of this, so few shapes compile


def detect_format(path: str | Path) -> str:
    """'meshlm', 'hf' or 'mtj' (the seed's step_N folder or run folder), from the files in `path`."""
    if mtj.is_url(path):
        if mtj.is_seed_checkpoint(path):
            return "mtj"
        raise ConfigError(f"{path}: URLs are read for the seed's checkpoints only, and this is not one")
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise ConfigError(f"{path}: expected a checkpoint folder, got a file")
    if checkpoint.is_checkpoint(path):
        return "meshlm"
    if (path / "config.json").exists():
        return "hf"
    if mtj.is_seed_checkpoint(path):
        return "mtj"
    raise ConfigError(
        f"{path}: not a checkpoint meshlm can read (expected meshlm.json, a Hugging Face config.json, "
        "or the seed's shard_0/ folder)"
    )


@functools.cache
def _compiled_forward(cfg: ModelConfig, policy: model.Policy):
    """One jitted forward per (config, policy), shared by every model loaded with them: jit then
    compiles once per input sharding, not once per loaded model."""
    return jax.jit(lambda params, tokens: model.forward(params, tokens, cfg, policy))


class LanguageModel:
    """A GPT-J model placed on a mesh, with the parameters it was loaded with."""

    def __init__(self, config: ModelConfig, params: model.Params, mesh: Mesh, dtype: str = "float32"):
        self.config = config
        self.params = params
        self.mesh = mesh
        self.dtype = dtype
        self.policy = model.Policy(param_dtype=dtype, compute_dtype=dtype)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LanguageModel({c.n_layer} layers, d_model {c.d_model}, {c.num_params():,} params, "
            f"{self.dtype}, {describe(self.mesh)})"
        )

    @property
    def _forward(self):
        return _compiled_forward(self.config, self.policy)

    @functools.cached_property
    def _tokens_sharding(self) -> NamedSharding:
        return named_sharding(self.mesh, ("batch", "seq"))

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Float32 logits [B, T, vocab_size] for int tokens [B, T] (no padding inside rows)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array [batch, seq], got {tokens.dtype} {tokens.shape}")
        B, T = tokens.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's context ({self.config.max_seq_len})")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        # Causal attention makes right padding harmless: pad to a few shapes, then cut the padding off.
        ways = batch_ways(self.mesh)
        padded_b = -(-B // ways) * ways
        padded_t = min(-(-T // SEQ_BUCKET) * SEQ_BUCKET, self.config.max_seq_len)
        padded = np.zeros((padded_b, padded_t), np.int32)
        padded[:B, :T] = tokens
        with jax.set_mesh(self.mesh):
            out = self._forward(self.params, from_host(padded, self._tokens_sharding))
        return to_host(out)[:B, :T]

    def save(self, path: str | Path, format: str = "meshlm", dtype: str | None = None) -> None:
        """Write the weights as a meshlm checkpoint or a Hugging Face GPTJForCausalLM folder."""
        params = self.params
        if dtype is not None:
            target = model.dtype_of(dtype)
            params = jax.tree.map(lambda x: x.astype(target), params)
        if format == "meshlm":
            checkpoint.save_params(path, params, self.config)
        elif format == "hf":
            hf.save(path, params, self.config, dtype=dtype or self.dtype)
        else:
            raise ConfigError(f"unknown save format {format!r}; choose 'meshlm' or 'hf'")


def load(
    path: str | Path,
    mesh: str | Mesh | None = None,
    dtype: str = "float32",
    *,
    seed_config: str | Path | None = None,
) -> LanguageModel:
    """Load a meshlm checkpoint, a Hugging Face GPT-J folder or a seed step_N folder onto `mesh`.

    A training run's folder (or a step folder inside it) loads its latest (or that) step's parameters.

    `mesh` is a spec such as "data=1,fsdp=2,model=4", a `jax.sharding.Mesh`, or None for one device.
    `seed_config` (seed checkpoints only) is the seed's run JSON, for the head count and rotary
    dimensions that its weights do not record; GPT-J-6B's values are the default.
    """
    model.dtype_of(dtype)
    path = checkpoint.resolve(path)
    fmt = detect_format(path)
    device_mesh = make_mesh(mesh)
    if fmt == "meshlm":
        cfg, params = checkpoint.restore_params(path, device_mesh, dtype)
    elif fmt == "hf":
        cfg, params = hf.load(path, device_mesh, dtype)
    else:
        cfg, params = mtj.load(path, device_mesh, dtype, seed_config=seed_config)
    return LanguageModel(cfg, params, device_mesh, dtype)


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    dtype: str = "float32",
    out_dtype: str | None = None,
    mesh: str | Mesh | None = None,
    seed_config: str | Path | None = None,
) -> None:
    """Convert a checkpoint to `to` ("meshlm" or "hf"), written in `out_dtype` (default: `dtype`).

    A seed checkpoint goes to Hugging Face one tensor at a time, in memory bounded by the largest
    tensor; every other conversion loads the model onto `mesh` in `dtype` and saves it.
    """
    if to not in ("meshlm", "hf"):
        raise ConfigError(f"unknown target format {to!r}; choose 'meshlm' or 'hf'")
    if Path(dst).exists() and any(Path(dst).iterdir()):
        raise ConfigError(f"{dst}: already exists and is not empty; choose a new folder")
    if to == "hf" and detect_format(src) == "mtj":
        if jax.process_index() == 0:  # streamed on the host: other processes have nothing to do
            mtj.convert_to_hf(src, dst, out_dtype or dtype, seed_config=seed_config)
        return
    lm = load(src, mesh=mesh, dtype=dtype, seed_config=seed_config)
    lm.save(dst, format=to, dtype=out_dtype)


def from_config(
    cfg: ModelConfig, mesh: str | Mesh | None = None, dtype: str = "float32", seed: int = 0
) -> LanguageModel:
    """A randomly initialised model, created shard by shard directly on `mesh`."""
    device_mesh = make_mesh(mesh)
    shardings = plan(model.abstract_params(cfg, dtype), model.logical_axes(cfg), device_mesh)
    params = jax.jit(lambda k: model.init(cfg, k, dtype), out_shardings=shardings)(jax.random.key(seed))
    return LanguageModel(cfg, params, device_mesh, dtype)
