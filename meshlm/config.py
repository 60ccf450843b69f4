"""Model configuration: one validated dataclass, named presets, and conversion from Hugging Face's config."""

from __future__ import annotations

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
