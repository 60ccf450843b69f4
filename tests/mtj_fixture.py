"""Writes the seed's (mesh-transformer-jax v1) sharded checkpoints: the test oracle.

`write_seed_checkpoint` writes a transformers GPT-J (the seed's default `pe: rotary`, `norm: layernorm`);
`write_variant_checkpoint` writes random per-shard parameters of any `pe` and `norm`, for a reference
that computes what the seed computes from those shards (tests/test_seed_variants.py).

Written from the format's description alone (issue 5), independently of `meshlm.formats.mtj`:
- `step_N/shard_s/{0..15}.npz`, each shard holding its model-parallel slice of the state pytree
  `{"opt_state", "params", "step"}` (slim: `{"params", "step"}`), flattened in JAX's tree order,
  the leaf list split into 16 contiguous nearly-equal chunks saved with `np.savez(f, *leaves)`;
- bf16 leaves stored with numpy dtype `V2`;
- Haiku names: `linear` (q), `linear_1` (v), `linear_2` (k), `linear_3` (out), `linear_4` (fc_in),
  `linear_5` (fc_out), `replicated_layer_norm` {offset, scale}; weights stored [in, out];
- the embedding is the concatenation of the w slices plus the SUM of the shards' biases, fc_out's
  bias is the SUM over shards (both are split into random parts here so a reader that takes one
  shard's copy fails); norms are replicated.

The returned torch models hold exactly the weights the files encode (after bf16/fp16 rounding and the
bias sums), so they are the reference for logits and optimizer moments.

The variants, from the seed's `mesh_transformer/layers.py`: `pe: fixed` adds `embedding_shard`'s
`pos_embs` [seq, d_model / shards], `pe: t5` one `relative_position_embs` module with `rel_embedding`
[heads / shards, 32]; the norm module of every layer and of `projection_shard` is
`replicated_layer_norm` {offset, scale} (layernorm, and layernorm-nobias, which stores the offset it
never uses), `layer_norm` {offset, scale} (layernorm-desync), or `rms_norm` {scale} (rmsnorm), plus
offset (-bias), with shape () for scalenorm. The FF width is always 4 * d_model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import optax
import torch
from transformers import GPTJForCausalLM

from tests import oracle

CHUNKS = 16
ROOT = "causal_transformer_shard/~/"
STORAGE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# the seed's norm -> (Haiku module, its parameters)
NORM_MODULES = {
    "layernorm": ("replicated_layer_norm", ("offset", "scale")),
    "layernorm-nobias": ("replicated_layer_norm", ("offset", "scale")),
    "layernorm-desync": ("layer_norm", ("offset", "scale")),
    "rmsnorm": ("rms_norm", ("scale",)),
    "scalenorm": ("rms_norm", ("scale",)),
    "rmsnorm-bias": ("rms_norm", ("offset", "scale")),
    "scalenorm-bias": ("rms_norm", ("offset", "scale")),
}
ShardParams = dict[str, dict[str, np.ndarray]]  # one shard's Haiku parameters: {module: {name: array}}


@dataclass
class SeedCheckpoint:
    step_dir: Path
    seed_config: Path  # the seed's run JSON (layers, d_model, n_heads, pe_rotary_dims, ...)
    model: GPTJForCausalLM  # the weights the files encode
    mu: GPTJForCausalLM | None  # Adam's first moments, as a model (full checkpoints only)
    nu: GPTJForCausalLM | None
    step: int
    adam_count: int


def _split(full: np.ndarray, shards: int, axis: int) -> list[np.ndarray]:
    assert full.shape[axis] % shards == 0
    return np.split(full, shards, axis=axis)


def _random_parts(total: np.ndarray, shards: int, rng: np.random.Generator) -> list[np.ndarray]:
    """S random arrays that sum to `total` (exactly in float64)."""
    parts = [rng.normal(0.0, 0.3, total.shape) for _ in range(shards - 1)]
    return [*parts, total - sum(parts, np.zeros_like(total, dtype=np.float64))]


class _Writer:
    """Builds per-shard Haiku param dicts and, alongside, the full tensors they encode."""

    def __init__(self, shards: int, storage: type, rng: np.random.Generator, sum_biases: bool):
        self.shards, self.storage, self.rng, self.sum_biases = shards, storage, rng, sum_biases
        self.per_shard: list[dict[str, dict[str, np.ndarray]]] = [{} for _ in range(shards)]

    def _put(self, module: str, name: str, parts: list[np.ndarray]) -> list[np.ndarray]:
        stored = [np.asarray(p, np.float64).astype(self.storage) for p in parts]
        for s, part in enumerate(stored):
            self.per_shard[s].setdefault(ROOT + module, {})[name] = part
        return [p.astype(np.float32) for p in stored]

    def cols(self, module: str, name: str, full: np.ndarray) -> np.ndarray:
        return np.concatenate(self._put(module, name, _split(full, self.shards, -1)), -1)

    def rows(self, module: str, name: str, full: np.ndarray) -> np.ndarray:
        return np.concatenate(self._put(module, name, _split(full, self.shards, 0)), 0)

    def replicated(self, module: str, name: str, full: np.ndarray) -> np.ndarray:
        return self._put(module, name, [full] * self.shards)[0]

    def summed(self, module: str, name: str, full: np.ndarray) -> np.ndarray:
        """A bias the seed adds once per shard: parts summing to `full` (or, for moments, copies)."""
        if not self.sum_biases:
            return self.replicated(module, name, full)
        stored = self._put(module, name, _random_parts(full, self.shards, self.rng))
        return np.sum(np.stack(stored), axis=0, dtype=np.float32)

    def embedding(self, wte: np.ndarray) -> np.ndarray:
        """Rows of w per shard plus per-shard biases; the effective table is concat(w) + sum(b)."""
        module = "embedding_shard/~/linear"
        if not self.sum_biases:
            self.replicated(module, "b", self.rng.normal(0.0, 0.1, wte.shape[1]))
            return self.rows(module, "w", wte)
        b_parts = [self.rng.normal(0.0, 0.3, wte.shape[1]) for _ in range(self.shards)]
        b = np.sum(np.stack(self._put(module, "b", b_parts)), axis=0, dtype=np.float32)
        return self.rows(module, "w", wte - b) + b


def _encode(model: GPTJForCausalLM, writer: _Writer) -> dict[str, torch.Tensor]:
    """Write every tensor of `model` through `writer`; return the state dict the files encode."""
    sd = {k: v.detach().float().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    out["transformer.wte.weight"] = writer.embedding(sd["transformer.wte.weight"])
    for i in range(model.config.n_layer):
        h, m = f"transformer.h.{i}.", f"layer_{i}/~/"
        for proj, module in (("q_proj", "linear"), ("v_proj", "linear_1"), ("k_proj", "linear_2")):
            out[f"{h}attn.{proj}.weight"] = writer.cols(m + module, "w", sd[f"{h}attn.{proj}.weight"].T).T
        out[f"{h}attn.out_proj.weight"] = writer.rows(m + "linear_3", "w", sd[f"{h}attn.out_proj.weight"].T).T
        out[f"{h}mlp.fc_in.weight"] = writer.cols(m + "linear_4", "w", sd[f"{h}mlp.fc_in.weight"].T).T
        out[f"{h}mlp.fc_in.bias"] = writer.cols(m + "linear_4", "b", sd[f"{h}mlp.fc_in.bias"])
        out[f"{h}mlp.fc_out.weight"] = writer.rows(m + "linear_5", "w", sd[f"{h}mlp.fc_out.weight"].T).T
        out[f"{h}mlp.fc_out.bias"] = writer.summed(m + "linear_5", "b", sd[f"{h}mlp.fc_out.bias"])
        out[f"{h}ln_1.weight"] = writer.replicated(m + "replicated_layer_norm", "scale", sd[f"{h}ln_1.weight"])
        out[f"{h}ln_1.bias"] = writer.replicated(m + "replicated_layer_norm", "offset", sd[f"{h}ln_1.bias"])
    norm = "projection_shard/~/replicated_layer_norm"
    out["transformer.ln_f.weight"] = writer.replicated(norm, "scale", sd["transformer.ln_f.weight"])
    out["transformer.ln_f.bias"] = writer.replicated(norm, "offset", sd["transformer.ln_f.bias"])
    out["lm_head.weight"] = writer.cols("projection_shard/~/linear", "w", sd["lm_head.weight"].T).T
    out["lm_head.bias"] = writer.cols("projection_shard/~/linear", "b", sd["lm_head.bias"])
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in out.items()}


def _model_with(template: GPTJForCausalLM, state: dict[str, torch.Tensor]) -> GPTJForCausalLM:
    model = GPTJForCausalLM(template.config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing), (missing, unexpected)
    return model


def _save_shard(folder: Path, state: dict) -> None:
    """Flatten in JAX's tree order, reinterpret bf16 as V2, and write the 16 chunks."""
    leaves = [
        leaf.view(np.dtype("V2")) if leaf.dtype == ml_dtypes.bfloat16 else leaf for leaf in jax.tree.leaves(state)
    ]
    folder.mkdir(parents=True)
    k, m = divmod(len(leaves), CHUNKS)
    for i in range(CHUNKS):
        chunk = leaves[i * k + min(i, m) : (i + 1) * k + min(i + 1, m)]
        with open(folder / f"{i}.npz", "wb") as f:
            np.savez(f, *chunk)


def write_seed_checkpoint(
    root: Path,
    source: GPTJForCausalLM,
    shards: int,
    dtype: str = "float32",
    full: bool = False,
    step: int = 1234,
    seed: int = 0,
) -> SeedCheckpoint:
    """Write `source` as the seed's `root/step_{step}/` with `shards` model-parallel shards (full:
    with Adam's moments, in fp32)."""
    rng = np.random.default_rng(seed)
    params = _Writer(shards, STORAGE[dtype], rng, sum_biases=True)
    model = _model_with(source, _encode(source, params))

    mu = nu = mu_shards = nu_shards = None
    adam_count = step - 7
    if full:
        cfg = {k: getattr(source.config, k) for k in ("n_embd", "n_layer", "n_head", "rotary_dim", "vocab_size")}
        cfg.update(n_inner=source.config.n_inner, n_positions=source.config.n_positions)
        moments = []
        for offset in (1, 2):
            writer = _Writer(shards, np.float32, rng, sum_biases=False)
            random_model = oracle.random_gptj(seed=seed + 100 * offset, **cfg)
            if offset == 2:  # second moments are squares: an update divides by their square root
                with torch.no_grad():
                    for p in random_model.parameters():
                        p.square_()
            moments.append((_model_with(source, _encode(random_model, writer)), writer.per_shard))
        (mu, mu_shards), (nu, nu_shards) = moments

    c = source.config
    run = {
        "layers": c.n_layer,
        "d_model": c.n_embd,
        "n_heads": c.n_head,
        "n_vocab": c.vocab_size,
        "pe": "rotary",
        "pe_rotary_dims": c.rotary_dim,
        "seq": c.n_positions,
        "cores_per_replica": shards,
        "norm": "layernorm",
    }
    step_dir, seed_config = _write_run(Path(root), run, params.per_shard, mu_shards, nu_shards, step, adam_count)
    return SeedCheckpoint(step_dir, seed_config, model, mu, nu, step, adam_count if full else -1)


def _write_run(
    root: Path,
    run: dict,
    params: list[ShardParams],
    mu: list[ShardParams] | None,
    nu: list[ShardParams] | None,
    step: int,
    adam_count: int,
) -> tuple[Path, Path]:
    """Write `root/step_{step}/shard_*/`, meta.json and the run JSON; returns the step folder and the JSON.

    Full checkpoints (with `mu` and `nu`) carry the optimizer chain the seed trained with (scale, clip,
    Adam, weight decay, scale, schedule): only Adam (count, mu, nu) and the schedule (count) hold state.
    """
    step_dir = root / f"step_{step}"
    for s, shard in enumerate(params):
        state = {"params": shard, "step": np.array(step, np.int32)}
        if mu is not None:
            count = np.array(adam_count, np.int32)
            state["opt_state"] = (
                optax.EmptyState(),  # scale(1 / gradient_accumulation_steps)
                optax.EmptyState(),  # clip_by_global_norm(1)
                optax.ScaleByAdamState(count=count, mu=mu[s], nu=nu[s]),
                optax.EmptyState(),  # additive_weight_decay
                optax.EmptyState(),  # scale(-1)
                optax.ScaleByScheduleState(count=count),
            )
        _save_shard(step_dir / f"shard_{s}", state)
    meta = {"step": step, "checkpoints": [step], "aux": {str(step): {"note": "written by tests/mtj_fixture.py"}}}
    (root / "meta.json").write_text(json.dumps(meta))
    seed_config = root / "seed_config.json"
    seed_config.write_text(json.dumps(run))
    return step_dir, seed_config


# ---------------------------------------------------------------------------------------------------
# Variants: random per-shard parameters of any pe and norm


@dataclass
class VariantCheckpoint:
    step_dir: Path
    seed_config: Path
    run: dict  # the run JSON written there
    params: list[ShardParams]  # each shard's parameters as stored, in float32
    mu: list[ShardParams] | None  # Adam's moments per shard (full checkpoints only)
    nu: list[ShardParams] | None
    step: int
    adam_count: int


def variant_shapes(run: dict, shards: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """One shard's parameter shapes, {module: {name: shape}}, for the seed run JSON `run`."""
    S, D, H, V, seq = shards, run["d_model"], run["n_heads"], run["n_vocab"], run["seq"]
    F = 4 * D
    module, names = NORM_MODULES[run["norm"]]
    norm = dict.fromkeys(names, () if run["norm"].startswith("scalenorm") else (D,))
    shapes = {
        "embedding_shard/~/linear": {"w": (V // S, D), "b": (D,)},
        "projection_shard/~/linear": {"w": (D, V // S), "b": (V // S,)},
        f"projection_shard/~/{module}": norm,
    }
    if run["pe"] == "fixed":
        shapes["embedding_shard"] = {"pos_embs": (seq, D // S)}
    if run["pe"] == "t5":
        shapes["relative_position_embs"] = {"rel_embedding": (H // S, 32)}
    for i in range(run["layers"]):
        layer = f"layer_{i}/~/"
        shapes.update({layer + name: {"w": (D, D // S)} for name in ("linear", "linear_1", "linear_2")})
        shapes[layer + "linear_3"] = {"w": (D // S, D)}
        shapes[layer + "linear_4"] = {"w": (D, F // S), "b": (F // S,)}
        shapes[layer + "linear_5"] = {"w": (F // S, D), "b": (D,)}
        shapes[layer + module] = norm
    return {ROOT + name: params for name, params in shapes.items()}


def _random_shards(
    run: dict, shards: int, storage: type, rng: np.random.Generator, moment: int = 0
) -> list[ShardParams]:
    """Every shard's parameters drawn independently, norms too (each shard's copy differs, so the
    reference decides whose copy counts); scales near their init (1, or sqrt(d) for the RMS norms).
    `moment` 1 or 2 draws Adam's first (any sign) or second (non-negative) moments instead."""
    sqrt_d = np.sqrt(run["d_model"])
    out = []
    for _ in range(shards):
        shard = {}
        for module, params in variant_shapes(run, shards).items():
            shard[module] = {}
            for name, shape in params.items():
                value = rng.normal(0.0, 0.2, shape)
                if moment == 2:
                    value = np.square(value)
                elif moment == 0 and name == "scale":
                    value = (1.0 + value) * (sqrt_d if module.endswith("rms_norm") else 1.0)
                shard[module][name] = np.asarray(value).astype(storage)
        out.append(shard)
    return out


def write_variant_checkpoint(
    root: Path,
    run: dict,
    shards: int,
    dtype: str = "float32",
    full: bool = False,
    step: int = 1234,
    seed: int = 0,
) -> VariantCheckpoint:
    """Random parameters of the seed run `run` (its JSON: layers, d_model, n_heads, n_vocab, seq, pe,
    norm, pe_rotary_dims) written as `root/step_{step}/` in `shards` shards; moments (fp32) if `full`."""
    rng = np.random.default_rng(seed)
    run = {**run, "cores_per_replica": shards}
    params = _random_shards(run, shards, STORAGE[dtype], rng)
    mu = _random_shards(run, shards, np.float32, rng, moment=1) if full else None
    nu = _random_shards(run, shards, np.float32, rng, moment=2) if full else None
    adam_count = step - 7
    step_dir, seed_config = _write_run(Path(root), run, params, mu, nu, step, adam_count)
    stored = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    return VariantCheckpoint(step_dir, seed_config, run, stored, mu, nu, step, adam_count if full else -1)
