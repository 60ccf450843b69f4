"""Model configuration: one validated dataclass, named presets, and conversion from Hugging Face's config."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPT2_VOCAB = 50257  # ids the GPT-2 BPE tokenizer can produce; padded rows above it are never sampled


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a GPT-J-class model. Runtime choices (dtypes, remat) live in `model.Policy`."""

    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    rotary_dim: int
    vocab_size: int = 50400
    n_vocab_used: int = GPT2_VOCAB
    max_seq_len: int = 2048
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for key in ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "n_vocab_used", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {key} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ConfigError(f"model config: n_head ({self.n_head}) must divide d_model ({self.d_model})")
        if not isinstance(self.rotary_dim, int) or self.rotary_dim < 0 or self.rotary_dim % 2:
            raise ConfigError(f"model config: rotary_dim must be a non-negative even integer, got {self.rotary_dim!r}")
        if self.rotary_dim > self.d_head:
            raise ConfigError(
                f"model config: rotary_dim ({self.rotary_dim}) must be <= d_head (d_model / n_head = {self.d_head})"
            )
        if self.n_vocab_used > self.vocab_size:
            raise ConfigError(
                f"model config: n_vocab_used ({self.n_vocab_used}) must be <= vocab_size "
                f"({self.vocab_size}), the padded embedding rows"
            )
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"model config: layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"model config: unknown key(s) {unknown}; allowed: {sorted(known)}")
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in values
        )
        if missing:
            raise ConfigError(f"model config: missing key(s) {missing}")
        return cls(**values)

    def num_params(self) -> int:
        """Parameter count from shapes alone (no allocation), as Hugging Face counts it."""
        from meshlm import model

        return model.count_params(self)


PRESETS: dict[str, ModelConfig] = {
    "gptj-6b": ModelConfig(n_layer=28, d_model=4096, n_head=16, d_ff=16384, rotary_dim=64),
    # ~1B-parameter GPT-J shape, for benchmarks between the tiny configs and the 6B model.
    "gptj-1b": ModelConfig(n_layer=16, d_model=2048, n_head=16, d_ff=8192, rotary_dim=64),
    # A small real-vocabulary model that trains on a CPU in minutes (the demo default).
    "gptj-tiny": ModelConfig(n_layer=4, d_model=256, n_head=4, d_ff=1024, rotary_dim=32, max_seq_len=512),
    # The built-in `meshlm train` demo: narrow enough that the 50k-row LM head trains on 2 CPU cores in minutes.
    "gptj-demo": ModelConfig(n_layer=4, d_model=128, n_head=4, d_ff=512, rotary_dim=16, max_seq_len=256),
    # Test-sized models: small vocabularies so a forward pass compiles and runs in milliseconds.
    "test-tiny": ModelConfig(
        n_layer=2, d_model=64, n_head=4, d_ff=256, rotary_dim=8, vocab_size=512, n_vocab_used=500, max_seq_len=128
    ),
    "test-full-rotary": ModelConfig(
        n_layer=3, d_model=48, n_head=3, d_ff=96, rotary_dim=16, vocab_size=256, n_vocab_used=256, max_seq_len=64
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}") from None


HF_REQUIRED_KEYS = ("n_embd", "n_layer", "n_head", "vocab_size")


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Map a Hugging Face `GPTJConfig` dict to ModelConfig, refusing anything that is not GPT-J."""
    model_type = hf.get("model_type")
    if model_type != "gptj":
        raise ConfigError(f"{source}: model_type is {model_type!r}, not 'gptj'; meshlm reads GPT-J models only")
    missing = [k for k in HF_REQUIRED_KEYS if k not in hf]
    if missing:
        raise ConfigError(f"{source}: GPT-J config is missing key(s) {missing}")
    activation = hf.get("activation_function", "gelu_new")
    if activation != "gelu_new":
        raise ConfigError(f"{source}: activation_function {activation!r} is not supported (only 'gelu_new')")
    if hf.get("tie_word_embeddings", False):
        raise ConfigError(f"{source}: tie_word_embeddings=true is not GPT-J (its LM head is untied)")
    d_model = hf["n_embd"]
    n_head = hf["n_head"]
    rotary_dim = hf.get("rotary_dim") or d_model // n_head
    vocab = hf["vocab_size"]
    return ModelConfig(
        n_layer=hf["n_layer"],
        d_model=d_model,
        n_head=n_head,
        d_ff=hf.get("n_inner") or 4 * d_model,
        rotary_dim=rotary_dim,
        vocab_size=vocab,
        n_vocab_used=min(vocab, GPT2_VOCAB),
        max_seq_len=hf.get("n_positions", 2048),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json that `transformers.GPTJForCausalLM.from_pretrained` expects."""
    return {
        "architectures": ["GPTJForCausalLM"],
        "model_type": "gptj",
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "rotary_dim": cfg.rotary_dim,
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": False,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }


def load_hf_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; a Hugging Face model folder needs config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return from_hf_config(hf, source=str(path))


# ---------------------------------------------------------------------------------------------------
# Training configuration


@dataclass(frozen=True)
class TrainConfig:
    """Everything `meshlm train` needs. Files (YAML/JSON, or the seed's JSON) and `--set key=value`
    overrides all feed this one dataclass; the defaults are the built-in CPU demo."""

    model: ModelConfig = PRESETS["gptj-demo"]
    data: str | None = None  # a prepared dataset folder; None trains on the built-in demo corpus
    val_data: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> "folder" or "folder:split"
    out_dir: str = "runs/demo"
    init_from: str | None = None  # anything `meshlm.load` reads; the optimizer and schedule start fresh unless:
    # Continue a full seed checkpoint's run: Adam's moments, its count (so the schedule too) and the step.
    resume_optimizer: bool = False
    seed_config: str | None = None  # the seed's run JSON for an init_from seed checkpoint (head count, rotary dims)
    mesh: str | None = None
    seed: int = 0
    seq_len: int | None = None  # demo corpus only; a prepared dataset carries its own
    batch_size: int = 8  # sequences per optimizer step, over all micro-batches and devices
    micro_batches: int = 1  # gradient accumulation steps inside one jitted step
    total_steps: int = 200
    lr: float = 2e-3
    end_lr: float = 2e-4
    warmup_steps: int = 20
    anneal_steps: int = 180
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0
    z_loss: float = 0.0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    val_every: int = 50
    val_batches: int = 8
    eval_tasks: list[str] = dataclasses.field(default_factory=list)  # lm-eval task names, run every eval_every
    eval_every: int = 0  # 0: never
    eval_limit: int | None = None  # documents per task (None: all)
    eval_include_path: str | None = None  # a folder of extra lm-eval task YAMLs
    ckpt_every: int = 50  # 0: only at the end (and on SIGTERM/SIGINT)
    keep_last: int = 2
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this; 0: none
    log_every: int = 10
    noise_scale_alpha: float = 0.01  # EMA weight of the gradient-noise-scale estimate
    sample_prompt: str = "Return the"
    sample_tokens: int = 32  # greedy sample printed at the end; 0: none

    def __post_init__(self) -> None:
        for key in ("batch_size", "micro_batches", "total_steps", "anneal_steps", "val_batches", "keep_last"):
            _check_int(key, getattr(self, key), minimum=1)
        _check_int("log_every", self.log_every, minimum=1)
        for key in ("seed", "warmup_steps", "val_every", "ckpt_every", "keep_every", "sample_tokens", "eval_every"):
            _check_int(key, getattr(self, key), minimum=0)
        if self.seq_len is not None:
            _check_int("seq_len", self.seq_len, minimum=1)
        if self.eval_limit is not None:
            _check_int("eval_limit", self.eval_limit, minimum=1)
        if not isinstance(self.eval_tasks, list) or not all(isinstance(t, str) and t for t in self.eval_tasks):
            raise ConfigError(f"train config: eval_tasks must be a list of lm-eval task names, got {self.eval_tasks!r}")
        for key in ("lr", "end_lr", "weight_decay", "z_loss"):
            _check_float(key, getattr(self, key), lambda v: v >= 0, ">= 0")
        for key in ("b1", "b2"):
            _check_float(key, getattr(self, key), lambda v: 0 <= v < 1, "in [0, 1)")
        for key in ("eps", "clip_norm"):
            _check_float(key, getattr(self, key), lambda v: v > 0, "> 0")
        _check_float("noise_scale_alpha", self.noise_scale_alpha, lambda v: 0 < v <= 1, "in (0, 1]")
        if self.batch_size % self.micro_batches:
            raise ConfigError(
                f"train config: batch_size ({self.batch_size}) must be a multiple of "
                f"micro_batches ({self.micro_batches})"
            )
        if not isinstance(self.val_data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.val_data.items()
        ):
            raise ConfigError(f"train config: val_data must map names to dataset folders, got {self.val_data!r}")
        if not isinstance(self.resume_optimizer, bool):
            raise ConfigError(f"train config: resume_optimizer must be true or false, got {self.resume_optimizer!r}")
        # Both describe the checkpoint a fresh run starts from; without one they would be silently ignored.
        for key in ("resume_optimizer", "seed_config"):
            if getattr(self, key) and not self.init_from:
                raise ConfigError(f"train config: {key} needs init_from (the seed checkpoint to start from)")
        from meshlm.model import Policy

        Policy(self.param_dtype, self.compute_dtype, self.remat)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"train config: unknown key(s) {unknown}; allowed: {sorted(known)}")
        if "model" in values:
            values["model"] = _model_from(values["model"])
        for f in dataclasses.fields(cls):
            # YAML 1.1 reads "1e-4" as a string; accept it where a number is meant.
            if f.type == "float" and isinstance(values.get(f.name), str):
                with contextlib.suppress(ValueError):
                    values[f.name] = float(values[f.name])
        return cls(**values)


def _check_int(key: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"train config: {key} must be an integer >= {minimum}, got {value!r}")


def _check_float(key: str, value: Any, ok: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ConfigError(f"train config: {key} must be a number {what}, got {value!r}")


def _model_from(value: Any) -> ModelConfig:
    """A preset name, a full model dict, or {"preset": name, ...overrides}."""
    if isinstance(value, ModelConfig):
        return value
    if isinstance(value, str):
        return preset(value)
    if not isinstance(value, dict):
        raise ConfigError(f"train config: model must be a preset name or a mapping, got {value!r}")
    value = dict(value)
    if "preset" in value:
        base = preset(value.pop("preset")).to_dict()
        return ModelConfig.from_dict({**base, **value})
    return ModelConfig.from_dict(value)


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


def is_seed_config(values: dict[str, Any]) -> bool:
    return "layers" in values and "n_heads" in values


def from_seed_config(seed: dict[str, Any]) -> dict[str, Any]:
    """Map a mesh-transformer-jax JSON config to TrainConfig keys.

    The seed's global batch per step is `per_replica_batch * (tpu_size / cores_per_replica) *
    gradient_accumulation_steps`; `cores_per_replica` becomes the `model` (tensor-parallel) mesh axis.
    """
    seed = dict(seed)
    for key, allowed in (("norm", "layernorm"), ("pe", "rotary")):
        if seed.pop(key, allowed) != allowed:
            raise ConfigError(f"seed config: {key} must be {allowed!r} (meshlm implements GPT-J only)")
    d_model = seed["d_model"]
    model = {new: seed.pop(old) for old, new in SEED_MODEL_KEYS.items() if old in seed}
    model["d_ff"] = seed.pop("d_ff", 4 * d_model)
    model["rotary_dim"] = seed.pop("pe_rotary_dims", d_model // model["n_head"])
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


def parse_override(item: str) -> tuple[list[str], Any]:
    """ "model.n_layer=2" -> (["model", "n_layer"], 2); the value is read as YAML (numbers, bools, lists)."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: value is not valid YAML ({e})") from None
    return key.strip().split("."), value


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    values = dict(values)
    for item in overrides:
        path, value = parse_override(item)
        if path[0] == "model" and len(path) > 1:
            current = values.get("model", "gptj-demo")
            current = {"preset": current} if isinstance(current, str) else dict(current)
            current[".".join(path[1:])] = value
            values["model"] = current
        elif len(path) == 1:
            values[path[0]] = value
        else:
            raise ConfigError(f"--set {item!r}: only model.* keys are nested")
    return values


def load_train_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML/JSON config (meshlm's or the seed's), apply `key=value` overrides, validate."""
    values: dict[str, Any] = {}
    if path is not None:
        import yaml

        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        try:
            values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot parse ({e})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
        if is_seed_config(values):
            values = from_seed_config(values)
    return TrainConfig.from_dict(apply_overrides(values, list(overrides)))
