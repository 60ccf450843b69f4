"""The seed's (mesh-transformer-jax's) JSON run config in meshlm's terms: a seed run's config trains as
a meshlm run (`from_seed_config`), and a seed checkpoint's run JSON says what its weights do not record
(`seed_model_fields`, which `mtj` reads)."""

from __future__ import annotations

from typing import Any

from meshlm.config import GPT2_VOCAB, ConfigError

# The seed's (mesh-transformer-jax) JSON config keys: model keys, then keys mapped one to one.
SEED_MODEL_KEYS = {"layers": "n_layer", "d_model": "d_model", "n_heads": "n_head", "n_vocab": "vocab_size"}
SEED_DIRECT_KEYS = {
    "warmup_steps": "warmup_steps",
    "anneal_steps": "anneal_steps",
    "lr": "lr",
    "end_lr": "end_lr",
    "weight_decay": "weight_decay",
    "total_steps": "total_steps",
    "val_every": "val_every",
    "val_batches": "val_batches",
    "ckpt_every": "ckpt_every",
    "keep_every": "keep_every",
    "gradient_accumulation_steps": "micro_batches",
    "model_dir": "out_dir",
    "train_set": "data",
    "val_set": "val_data",
    "seed": "seed",
}
# Keys the seed used for its TPU/GCS/wandb plumbing; accepted and ignored.
SEED_IGNORED_KEYS = {"bucket", "name", "wandb_project", "comment", "eval_harness_tasks", "early_cast", "optimizer"}
# The seed's `pe` and `norm` -> ModelConfig's position and norm. `fixed` is a learned table despite its
# name; layernorm-desync keeps one LayerNorm per model shard, the same math as one replicated LayerNorm.
SEED_POSITIONS = {"rotary": "rotary", "fixed": "learned", "t5": "t5"}
SEED_NORMS = {
    "layernorm": "layernorm",
    "layernorm-desync": "layernorm",
    "layernorm-nobias": "layernorm-nobias",
    "rmsnorm": "rmsnorm",
    "scalenorm": "scalenorm",
    "rmsnorm-bias": "rmsnorm-bias",
    "scalenorm-bias": "scalenorm-bias",
}


def seed_variant(seed: dict[str, Any], where: str = "seed config") -> tuple[str, str]:
    """The seed JSON's `pe` and `norm` (absent: GPT-J's rotary and layernorm), checked."""
    values = {"pe": seed.get("pe", "rotary"), "norm": seed.get("norm", "layernorm")}
    for key, table in (("pe", SEED_POSITIONS), ("norm", SEED_NORMS)):
        if values[key] not in table:
            raise ConfigError(f"{where}: {key} must be one of {list(table)}, got {values[key]!r}")
    return values["pe"], values["norm"]


def seed_model_fields(seed: dict[str, Any], d_head: int, where: str = "seed config") -> dict[str, Any]:
    """ModelConfig's position, norm and rotary_dim for a seed JSON. Rotary applies to `pe_rotary_dims`
    of each head, by the seed's default the whole head (`d_head`); other positions rotate nothing."""
    pe, norm = seed_variant(seed, where)
    rotary_dim = seed.get("pe_rotary_dims", d_head) if pe == "rotary" else 0
    return {"position": SEED_POSITIONS[pe], "norm": SEED_NORMS[norm], "rotary_dim": rotary_dim}


def is_seed_config(values: dict[str, Any]) -> bool:
    return "layers" in values and "n_heads" in values


def from_seed_config(seed: dict[str, Any]) -> dict[str, Any]:
    """Map a mesh-transformer-jax JSON config to TrainConfig keys.

    Every `pe` and `norm` of the seed maps onto the model config (`seed_model_fields`). The seed's
    global batch per step is `per_replica_batch * (tpu_size / cores_per_replica) *
    gradient_accumulation_steps`; `cores_per_replica` becomes the `model` (tensor-parallel) mesh axis.
    """
    seed = dict(seed)
    d_model = seed["d_model"]
    model = {new: seed.pop(old) for old, new in SEED_MODEL_KEYS.items() if old in seed}
    model.update(seed_model_fields(seed, d_model // model["n_head"]))
    for key in ("pe", "norm", "pe_rotary_dims"):
        seed.pop(key, None)
    model["d_ff"] = seed.pop("d_ff", 4 * d_model)
    if "seq" in seed:
        model["max_seq_len"] = seed.pop("seq")
    model["n_vocab_used"] = min(GPT2_VOCAB, model.get("vocab_size", 50400))
    out: dict[str, Any] = {"model": model}
    cores = seed.pop("cores_per_replica", 1)
    tpu_size = seed.pop("tpu_size", cores)
    per_replica = seed.pop("per_replica_batch", 1)
    if tpu_size % cores:
        raise ConfigError(f"seed config: tpu_size ({tpu_size}) must be a multiple of cores_per_replica ({cores})")
    gas = seed.get("gradient_accumulation_steps", 1)
    out["batch_size"] = per_replica * (tpu_size // cores) * gas
    out["mesh"] = f"model={cores}"
    for old, new in SEED_DIRECT_KEYS.items():
        if old in seed:
            out[new] = seed.pop(old)
    if isinstance(out.get("val_data"), str):
        out["val_data"] = {"val": out["val_data"]}
    if out.get("keep_every") is None:
        out.pop("keep_every", None)
    for key in SEED_IGNORED_KEYS:
        seed.pop(key, None)
    if seed:
        raise ConfigError(f"seed config: unknown key(s) {sorted(seed)}")
    return out
