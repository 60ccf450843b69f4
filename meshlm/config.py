"""Configs: the model's and a training run's (validated dataclasses), named presets, dtypes, the errors meshlm
raises, and `key=value` overrides."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

GPT2_VOCAB = 50257  # ids the GPT-2 BPE tokenizer can produce; padded rows above it are never sampled
RUN_CHECKPOINTS = "checkpoints"  # a training run's step folders live in <run>/checkpoints/<step>/


class MeshlmError(Exception):
    """What meshlm raises for input it cannot use (never for its own bugs): the command line prints it in
    one line. Each subclass is also a ValueError, so code that caught ValueError before still does."""


class ConfigError(MeshlmError, ValueError):
    """A configuration value is missing, unknown or inconsistent; the message names the key."""


class CheckpointError(ConfigError):
    """A checkpoint is missing, damaged, or does not match its own config; the message names the file."""


class DataError(ConfigError):
    """A dataset or input text cannot be read or does not fit the model; the message names the file."""


class InputError(MeshlmError, ValueError):
    """An argument to the Python API (tokens, prompts, sampling settings) is out of range; `param` names the
    request field it came from, where there is one (the server answers 400 naming it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class TrainingStopped(MeshlmError):
    """A training run had to stop: a non-finite loss, a checkpoint that could not be written. The message
    names the step and what was kept."""


class Interrupted(MeshlmError):
    """A command was stopped by a signal before it had anything to save; `signum` sets the exit status."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def one_line(error: Exception) -> str:
    """A parser's message (YAML's spans several lines) as one line."""
    return " ".join(str(error).split())


def is_url(path: object) -> bool:
    """gs://bucket/run, s3://..., memory://...: a remote location rather than a local path. Here, not in
    `paths` with the other path helpers, because the train config's checks need it and `paths` needs the errors."""
    return "://" in str(path)


# The architectural choices the GPT-J family differs in; each field's default is GPT-J's.
RESIDUALS = ("parallel", "parallel_two_norms", "sequential")
NORMS = ("layernorm", "layernorm-nobias", "rmsnorm", "scalenorm", "rmsnorm-bias", "scalenorm-bias")
POSITIONS = ("rotary", "learned", "t5")
ROTARY_STYLES = ("interleaved", "half")
ACTIVATIONS = ("gelu_new", "gelu")
ATTENTION_KINDS = ("global", "local")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a GPT-J-class model. Runtime choices (dtypes, remat) live in `Policy`.

    The defaults describe GPT-J; the family differs in a few named choices:
      residual        "parallel": x + attn(ln(x)) + mlp(ln(x)), one norm (GPT-J, CodeGen, the seed);
                      "parallel_two_norms": x + attn(ln(x)) + mlp(ln_mlp(x)) (GPT-NeoX);
                      "sequential": x += attn(ln(x)); x += mlp(ln_mlp(x)) (GPT-Neo, NeoX without
                      use_parallel_residual)
      norm            the seed's norms: layernorm (-nobias: no offset), rmsnorm and scalenorm as the
                      seed defines them (x / (|x|_2 + 1e-5) times a per-channel or a single scale),
                      optionally with an offset ("-bias")
      position        "rotary" on the first `rotary_dim` dims of each head ("interleaved" pairs as GPT-J,
                      rotate-"half" as NeoX); "learned" absolute positions added to the embedding
                      (GPT-Neo, the seed's `fixed`); "t5" relative bias buckets shared by the layers
      attention_layers  "global" or "local" (causal window of `local_window` tokens), cycled over the
                      layers (GPT-Neo alternates); `scale_attn` False drops the 1/sqrt(d_head) (GPT-Neo)
    """

    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    rotary_dim: int
    vocab_size: int = 50400
    n_vocab_used: int = GPT2_VOCAB
    max_seq_len: int = 2048
    layer_norm_eps: float = 1e-5
    residual: str = "parallel"
    norm: str = "layernorm"
    position: str = "rotary"
    rotary_style: str = "interleaved"
    rotary_base: float = 10000.0
    attention_layers: tuple[str, ...] = ("global",)
    local_window: int = 0
    scale_attn: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    tie_embeddings: bool = False
    head_bias: bool = True
    activation: str = "gelu_new"

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
        if isinstance(self.layer_norm_eps, bool) or not isinstance(self.layer_norm_eps, int | float):
            raise ConfigError(f"model config: layer_norm_eps must be a number, got {self.layer_norm_eps!r}")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"model config: layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        for key, allowed in (
            ("residual", RESIDUALS),
            ("norm", NORMS),
            ("position", POSITIONS),
            ("rotary_style", ROTARY_STYLES),
            ("activation", ACTIVATIONS),
        ):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"model config: {key} must be one of {list(allowed)}, got {getattr(self, key)!r}")
        for key in ("scale_attn", "qkv_bias", "out_bias", "tie_embeddings", "head_bias"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"model config: {key} must be true or false, got {getattr(self, key)!r}")
        if isinstance(self.rotary_base, bool) or not isinstance(self.rotary_base, int | float) or self.rotary_base <= 1:
            raise ConfigError(f"model config: rotary_base must be a number > 1, got {self.rotary_base!r}")
        if self.position != "rotary" and self.rotary_dim:
            raise ConfigError(
                f"model config: rotary_dim is {self.rotary_dim} but position is {self.position!r}; "
                "set rotary_dim to 0 (only rotary positions rotate)"
            )
        layers = self.attention_layers
        if isinstance(layers, str | list):  # from YAML/JSON, or a single kind for every layer
            object.__setattr__(self, "attention_layers", (layers,) if isinstance(layers, str) else tuple(layers))
        if not self.attention_layers or any(k not in ATTENTION_KINDS for k in self.attention_layers):
            raise ConfigError(
                f"model config: attention_layers must be a list of {list(ATTENTION_KINDS)} (cycled over the "
                f"layers), got {layers!r}"
            )
        if not isinstance(self.local_window, int) or isinstance(self.local_window, bool) or self.local_window < 0:
            raise ConfigError(f"model config: local_window must be an integer >= 0, got {self.local_window!r}")
        if "local" in self.layer_kinds and self.local_window == 0:
            raise ConfigError("model config: attention_layers has local layers, so local_window must be > 0")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """ "global" or "local" for each layer: `attention_layers` cycled over `n_layer`."""
        return tuple(self.attention_layers[i % len(self.attention_layers)] for i in range(self.n_layer))

    @property
    def norm_has_bias(self) -> bool:
        return self.norm in ("layernorm", "rmsnorm-bias", "scalenorm-bias")

    @property
    def norm_is_scalar(self) -> bool:
        """scalenorm's scale is one number, not one per channel."""
        return self.norm.startswith("scalenorm")

    @property
    def two_norms(self) -> bool:
        """Whether each block has a second norm before its MLP."""
        return self.residual != "parallel"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["attention_layers"] = list(self.attention_layers)
        return values

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


def _pythia(n_layer: int, d_model: int, n_head: int, vocab_size: int = 50304) -> ModelConfig:
    """GPT-NeoX / Pythia: two norms in parallel, rotate-half rotary on a quarter of each head, biased
    attention, exact GELU, an untied head without bias, and the GPT-NeoX BPE's 50277 ids."""
    return ModelConfig(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        d_ff=4 * d_model,
        rotary_dim=d_model // n_head // 4,
        vocab_size=vocab_size,
        n_vocab_used=50277,
        residual="parallel_two_norms",
        rotary_style="half",
        qkv_bias=True,
        out_bias=True,
        head_bias=False,
        activation="gelu",
    )


def _gpt_neo(n_layer: int, d_model: int, n_head: int) -> ModelConfig:
    """GPT-Neo: sequential blocks, learned positions, global and local (256-token) layers alternating,
    no score scaling, biased out projection, tied head without bias, GPT-2's vocabulary."""
    return ModelConfig(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        d_ff=4 * d_model,
        rotary_dim=0,
        vocab_size=GPT2_VOCAB,
        residual="sequential",
        position="learned",
        attention_layers=("global", "local"),
        local_window=256,
        scale_attn=False,
        out_bias=True,
        tie_embeddings=True,
        head_bias=False,
    )


PRESETS: dict[str, ModelConfig] = {
    "gptj-6b": ModelConfig(n_layer=28, d_model=4096, n_head=16, d_ff=16384, rotary_dim=64),
    # ~1B-parameter GPT-J shape, for benchmarks between the tiny configs and the 6B model.
    "gptj-1b": ModelConfig(n_layer=16, d_model=2048, n_head=16, d_ff=8192, rotary_dim=64),
    # A small real-vocabulary model that trains on a CPU in minutes (the demo default).
    "gptj-tiny": ModelConfig(n_layer=4, d_model=256, n_head=4, d_ff=1024, rotary_dim=32, max_seq_len=512),
    # The built-in `meshlm train` demo: narrow enough that the 50k-row LM head trains on 2 CPU cores in minutes.
    "gptj-demo": ModelConfig(n_layer=4, d_model=128, n_head=4, d_ff=512, rotary_dim=16, max_seq_len=256),
    "pythia-70m": _pythia(6, 512, 8),
    "pythia-160m": _pythia(12, 768, 12),
    "pythia-410m": _pythia(24, 1024, 16),
    "pythia-1b": _pythia(16, 2048, 8),
    "pythia-1.4b": _pythia(24, 2048, 16),
    "pythia-2.8b": _pythia(32, 2560, 32),
    "pythia-6.9b": _pythia(32, 4096, 32, vocab_size=50432),
    "pythia-12b": _pythia(36, 5120, 40, vocab_size=50688),
    "gpt-neox-20b": _pythia(44, 6144, 64, vocab_size=50432),
    "gpt-neo-125m": _gpt_neo(12, 768, 12),
    "gpt-neo-1.3b": _gpt_neo(24, 2048, 16),
    "gpt-neo-2.7b": _gpt_neo(32, 2560, 20),
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


# ---------------------------------------------------------------------------------------------------
# How to run a model

# The one table of floating dtypes meshlm stores, computes and writes in: numpy's types (bfloat16 from
# ml_dtypes), which jax takes as they are.
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# What the backward pass keeps of each layer (docs/tpu.md says when to use which): "none" everything;
# "full" only the layer's input (everything else is recomputed); "dots" every matmul's output, attention
# scores included; "dots_no_batch" the projections' outputs; and the policies by name, over the
# activations the model names (`CHECKPOINT_NAMES`): "minimal" all of them, "save_qkv" q, k and v,
# "save_qkv_out" those and the attention's output, "offload" all of them moved to host memory while the
# backward pass waits for them. Any choice of names reads "save:q,k,v", "offload:attn,mlp", or both
# joined by ";" ("save:q,k,v;offload:mlp").
REMAT_NAMES = ("none", "full", "dots", "dots_no_batch", "minimal", "save_qkv", "save_qkv_out", "offload")
CHECKPOINT_NAMES = ("q", "k", "v", "attn", "mlp")  # q, k, v; attention's output before `out`; GELU(fc_in)
REMAT_BY_NAME = {
    "minimal": (CHECKPOINT_NAMES, ()),
    "save_qkv": (("q", "k", "v"), ()),
    "save_qkv_out": (("q", "k", "v", "attn"), ()),
    "offload": ((), CHECKPOINT_NAMES),
}


def remat_names(remat: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The named activations a remat policy keeps on the device and offloads to host memory; None for the
    policies not by name ("none", "full", "dots", "dots_no_batch"). Raises ConfigError for an unknown one."""
    if remat in REMAT_BY_NAME:
        return REMAT_BY_NAME[remat]
    if remat in REMAT_NAMES:
        return None
    lists: dict[str, tuple[str, ...]] = {"save": (), "offload": ()}
    for part in str(remat).split(";"):
        where, _, names = part.partition(":")
        chosen = tuple(n.strip() for n in names.split(",") if n.strip())
        if where.strip() not in lists or not chosen or lists[where.strip()]:
            raise ConfigError(
                f"unknown remat policy {remat!r}; allowed: {list(REMAT_NAMES)}, or named activations as "
                f"'save:q,k,v', 'offload:attn,mlp' or both joined by ';'"
            )
        if unknown := sorted(set(chosen) - set(CHECKPOINT_NAMES)):
            raise ConfigError(f"remat {remat!r}: {unknown} not among the named activations {list(CHECKPOINT_NAMES)}")
        lists[where.strip()] = chosen
    if set(lists["save"]) & set(lists["offload"]):
        raise ConfigError(f"remat {remat!r}: an activation is either saved or offloaded, not both")
    return lists["save"], lists["offload"]


# What `meshlm.attention.resolve` prefers (its docstring has the table of kernels and their limits).
# "auto": the fastest kernel that serves the call: TPU splash for a forward pass, cuDNN's fused attention
# on a GPU, the Pallas paged kernels for decode steps, XLA's otherwise; "xla" or "cudnn" force one (a
# forced "cudnn" raises where cuDNN cannot run); "pallas" uses a paged kernel for decode steps on any
# backend (interpreted on a CPU: slow, for checking it) and XLA's attention elsewhere; "splash" the TPU
# splash kernel for forward passes wherever its limits allow (interpreted off a TPU), XLA's elsewhere.
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas", "splash")


def dtype_of(name: str) -> Any:
    """The numpy dtype named `name` ("float32", "bfloat16", "float16")."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown dtype {name!r}; allowed: {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class Policy:
    """How to run the model: parameter storage dtype, compute dtype, what to rematerialise, which
    attention implementation to use, the adapters' dropout rate while training, and the KV cache's
    storage while serving."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"
    lora_dropout: float = 0.0  # applied to an adapter's input when the model is given a dropout key (training)
    kv_cache_dtype: str | None = None  # how serving stores keys and values: "int8", a float dtype, None: compute's

    def __post_init__(self) -> None:
        dtype_of(self.param_dtype)
        dtype_of(self.compute_dtype)
        if self.kv_cache_dtype not in (None, "int8"):
            dtype_of(self.kv_cache_dtype)
        remat_names(self.remat)  # raises for an unknown policy
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"unknown attention implementation {self.attention!r}; allowed: {list(ATTENTION_IMPLS)}")

    @property
    def kv_dtype(self) -> str:
        """The dtype an engine's KV pool is stored in."""
        return self.kv_cache_dtype or self.compute_dtype


# The projections every architecture of the family has, by role: what LoRA adapters and quantization act on.
PROJECTIONS = ("q", "k", "v", "out", "fc_in", "fc_out")
QUANTIZED = ("int8", "nf4", "w8a8")  # projections' storage besides the floating dtypes (w8a8: `meshlm.quant`)
TRAINABLE_QUANTIZED = ("int8", "nf4")  # a frozen base's: w8a8 rounds the activations, which has no gradient


@dataclass(frozen=True)
class LoraConfig:
    """A low-rank adapter on some of the projections: W x + (alpha / rank) * B(A(dropout(x))), as PEFT's
    LoRA defines it (`rslora`: alpha / sqrt(rank)). Defaults are PEFT's."""

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.targets, str | list):  # from YAML/JSON
            object.__setattr__(
                self, "targets", (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
            )
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ConfigError(f"lora: rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or self.alpha <= 0:
            raise ConfigError(f"lora: alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora: dropout must be a number in [0, 1), got {self.dropout!r}")
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"lora: targets must be a non-empty list without repeats, got {list(self.targets)}")
        if unknown := [t for t in self.targets if t not in PROJECTIONS]:
            raise ConfigError(
                f"lora: target {unknown[0]!r} is not a projection of the GPT-J family; targets are {list(PROJECTIONS)}"
            )
        if not isinstance(self.rslora, bool):
            raise ConfigError(f"lora: rslora must be true or false, got {self.rslora!r}")

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, values: Any) -> LoraConfig:
        if isinstance(values, LoraConfig):
            return values
        if not isinstance(values, dict):
            raise ConfigError(f"lora: expected a mapping (rank, alpha, dropout, targets), got {values!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ConfigError(f"lora: unknown key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)


# What a run trains for (`meshlm.objectives` holds their math): next-token loss on the weighted targets, on
# preference pairs DPO and ORPO, or GRPO on rewarded completions (`meshlm.grpo`), each with its settings named
# as trl names them.
OBJECTIVE_NAMES = ("lm", "dpo", "orpo", "grpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
DPO_REFERENCES = ("precompute", "copy")
GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
GRPO_SCALE_REWARDS = ("group", "batch", "none")
GRPO_IMPORTANCE_LEVELS = ("token", "sequence")
OPTIMIZER_MEMORY = ("device", "host")  # where the optimizer state stays between steps


@dataclass(frozen=True)
class DpoConfig:
    """DPO against a frozen reference model (the starting model), as trl's DPOConfig names its settings.

    `loss_type`: "sigmoid" (DPO; with `label_smoothing` eps > 0 conservative DPO, which assumes each label is
    flipped with probability eps, as trl's CPO and pre-1.0 DPO compute it), "ipo" (the squared log-ratio
    gap, per completion token), "hinge" (SLiC). `reference` applies to full fine-tuning: "precompute"
    computes the reference log-probs once before the first step and stores them beside the run;
    "copy" keeps a frozen copy of the starting model in device memory. A LoRA run's reference is
    always its base with the adapter switched off."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "precompute"

    def __post_init__(self) -> None:
        _check_float("dpo.beta", self.beta, lambda v: v > 0, "> 0")
        _check_choice("dpo.loss_type", self.loss_type, DPO_LOSSES)
        _check_float("dpo.label_smoothing", self.label_smoothing, lambda v: 0 <= v < 0.5, "in [0, 0.5)")
        _check_choice("dpo.reference", self.reference, DPO_REFERENCES)
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ConfigError(
                f"train config: dpo.label_smoothing applies to loss_type sigmoid only (conservative DPO); "
                f"{self.loss_type} has none, so set it to 0"
            )


@dataclass(frozen=True)
class OrpoConfig:
    """ORPO: the chosen completion's NLL minus beta * log sigmoid of the chosen-over-rejected log odds
    ratio; no reference model. `beta` is trl's ORPOConfig's (the paper's lambda)."""

    beta: float = 0.1

    def __post_init__(self) -> None:
        _check_float("orpo.beta", self.beta, lambda v: v > 0, "> 0")


@dataclass(frozen=True)
class GrpoConfig:
    """GRPO and its variants (Dr. GRPO, DAPO, GSPO) on completions sampled from the policy and scored by
    rewards; trl 1.16's GRPOConfig names, meanings and defaults, except `max_completion_tokens` (trl's
    `max_completion_length`: meshlm counts tokens everywhere).

    `loss_type` picks how per-token losses reduce: "grpo" (a mean per completion, then over completions),
    "bnpo" (a mean over the batch's completion tokens), "dr_grpo" (a sum over completions * max_completion_tokens)
    or "dapo" (a sum over the tokens of the whole generation batch). `scale_rewards` divides each advantage
    by its group's reward std ("group", or true), the batch's ("batch") or nothing ("none", or false).
    `importance_sampling_level` "sequence" is GSPO: one ratio per completion, the exp of its mean token
    log-ratio. `epsilon_high` defaults to `epsilon`. `num_iterations` > 1 reuses a batch of completions
    for that many updates, clipped against the log-probs they were sampled with. `use_bias_correction_kl`
    (trl's default, true) weighs the KL term by the importance ratio, which changes its gradient even where the
    ratio is 1: the unbiased gradient of KL(policy || reference).

    The engine samples with `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` (trl's; `min_p` None or
    0: off), then `generation_kwargs` (trl's: settings passed to the sampler, overriding those; here SamplingParams'
    fields by name: `stop` strings, `stop_token_ids`, `min_tokens`, `logit_bias`, the penalties, ...), and keeps its
    output inside `structured_outputs_regex` (trl's `vllm_structured_outputs_regex`). A completion cut by a stop
    string is trained on the tokens up to it (the one it starts in included; trl, through vLLM, keeps the string's
    tokens); one ended by a stop token keeps that token as its last, as EOS.

    Besides trl's settings: `rewards`, the reward functions and their weights (trl's `reward_funcs` and
    `reward_weights`), as `meshlm.rewards.load` reads them: `[{function: module:name | built-in, weight: 1.0,
    ...options}]`; `log_completions_every`, how often a table of the step's prompts, completions and rewards is
    written to the run folder (trl's `log_completions`, every so many steps; 0: never)."""

    num_generations: int = 8
    max_completion_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    num_iterations: int = 1
    importance_sampling_level: str = "token"
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    structured_outputs_regex: str | None = None
    rewards: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    log_completions_every: int = 10

    def __post_init__(self) -> None:
        _check_int("grpo.num_generations", self.num_generations, minimum=2)  # a group needs two to have a spread
        for key in ("max_completion_tokens", "num_iterations"):
            _check_int(f"grpo.{key}", getattr(self, key), minimum=1)
        _check_int("grpo.log_completions_every", self.log_completions_every, minimum=0)
        if not isinstance(self.rewards, list) or not all(isinstance(r, dict) for r in self.rewards):
            raise ConfigError(
                f"train config: grpo.rewards must be a list of {{function, weight}} entries, got {self.rewards!r}"
            )
        _check_float("grpo.temperature", self.temperature, lambda v: v > 0, "> 0")
        _check_float("grpo.top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_int("grpo.top_k", self.top_k, minimum=0)
        if self.min_p is not None:
            _check_float("grpo.min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_float("grpo.repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
        if self.generation_kwargs is not None and not isinstance(self.generation_kwargs, dict):
            raise ConfigError(f"train config: grpo.generation_kwargs must be a mapping, got {self.generation_kwargs!r}")
        if self.structured_outputs_regex is not None and not isinstance(self.structured_outputs_regex, str):
            raise ConfigError(
                f"train config: grpo.structured_outputs_regex must be a string, got {self.structured_outputs_regex!r}"
            )
        _check_float("grpo.beta", self.beta, lambda v: v >= 0, ">= 0")
        _check_float("grpo.epsilon", self.epsilon, lambda v: 0 <= v < 1, "in [0, 1)")
        if self.epsilon_high is not None:
            _check_float("grpo.epsilon_high", self.epsilon_high, lambda v: v >= 0, ">= 0")
        _check_choice("grpo.loss_type", self.loss_type, GRPO_LOSSES)
        # trl reads true as "group" and false as "none" (GRPOConfig.__post_init__)
        if isinstance(self.scale_rewards, bool):
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")
        _check_choice("grpo.scale_rewards", self.scale_rewards, GRPO_SCALE_REWARDS)
        _check_choice("grpo.importance_sampling_level", self.importance_sampling_level, GRPO_IMPORTANCE_LEVELS)
        for key in ("mask_truncated_completions", "use_bias_correction_kl"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"train config: grpo.{key} must be true or false, got {getattr(self, key)!r}")

    @property
    def upper_epsilon(self) -> float:
        """The clip range's upper side: `epsilon_high`, else `epsilon` (symmetric clipping)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _section(cls: type, values: Any, name: str) -> Any:
    """A nested train-config section (`dpo`, `orpo`, `grpo`) from its mapping; YAML's "1e-1" strings read as
    numbers."""
    if isinstance(values, cls):
        return values
    known = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(values, dict):
        raise ConfigError(f"train config: {name} must be a mapping of {known}, got {values!r}")
    if unknown := sorted(set(values) - set(known)):
        raise ConfigError(f"train config: {name}: unknown key(s) {unknown}; allowed: {known}")
    values = dict(values)
    for f in dataclasses.fields(cls):
        if f.type.startswith("float") and isinstance(values.get(f.name), str):
            with contextlib.suppress(ValueError):
                values[f.name] = float(values[f.name])
    return cls(**values)


# ---------------------------------------------------------------------------------------------------
# Training configuration


@dataclass(frozen=True)
class TrainConfig:
    """Everything `meshlm train` needs. Files (YAML/JSON, or the seed's JSON) and `--set key=value`
    overrides all feed this one dataclass; the defaults are the built-in CPU demo."""

    model: ModelConfig = PRESETS["gptj-demo"]
    data: str | None = (
        None  # a prepared dataset folder; None: the built-in demo corpus; demo:chats, demo:pairs, demo:prompts
    )
    val_data: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> "folder" or "folder:split"
    out_dir: str = "runs/demo"
    log_dir: str | None = None  # metrics (JSONL, TensorBoard, W&B files): out_dir unless set; local
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
    adam_dtype: str = "float32"  # how Adam's two moments are stored between steps; "bfloat16" saves 4 bytes/param
    # Where the optimizer state stays between steps: "device", or "host" (pinned host memory: each step brings
    # it to the device for the update and sends it back), which frees its bytes of device memory between steps.
    optimizer_memory: str = "device"
    clip_norm: float = 1.0
    z_loss: float = 0.0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"  # Policy.attention: "auto", "xla", "cudnn", "pallas" or "splash" (see ATTENTION_IMPLS)
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
    wandb_project: str | None = None  # also log to Weights & Biases (pip install 'meshlm[wandb]'); None: off
    wandb_run: str | None = None  # the W&B run's name (default: the run folder's name)
    # LoRA: train only an adapter (rank, alpha, dropout, targets) over a frozen base stored as `base_dtype`
    # (a float dtype, "int8" or "nf4"; default param_dtype). Checkpoints then hold the adapter alone.
    lora: LoraConfig | None = None
    base_dtype: str | None = None
    # The objective (see OBJECTIVE_NAMES): "lm" trains on text (plain or with loss weights), "dpo" and
    # "orpo" on preference pairs, "grpo" on rewarded completions; each reads its own section.
    objective: str = "lm"
    dpo: DpoConfig = dataclasses.field(default_factory=DpoConfig)
    orpo: OrpoConfig = dataclasses.field(default_factory=OrpoConfig)
    grpo: GrpoConfig = dataclasses.field(default_factory=GrpoConfig)

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
        for key in ("wandb_project", "wandb_run"):
            if getattr(self, key) is not None and not (isinstance(getattr(self, key), str) and getattr(self, key)):
                raise ConfigError(f"train config: {key} must be a name, got {getattr(self, key)!r}")
        if not isinstance(self.val_data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.val_data.items()
        ):
            raise ConfigError(f"train config: val_data must map names to dataset folders, got {self.val_data!r}")
        if self.log_dir is not None and not (isinstance(self.log_dir, str) and self.log_dir):
            raise ConfigError(f"train config: log_dir must be a folder, got {self.log_dir!r}")
        if is_url(self.out_dir) and (self.log_dir is None or is_url(self.log_dir)):
            raise ConfigError(
                f"train config: out_dir {self.out_dir} is a URL; set log_dir to a local folder for the metrics "
                "(checkpoints go to the URL)"
            )
        if is_url(self.out_dir) and (self.data is None or self.data.startswith("demo:")):
            raise ConfigError(
                f"train config: out_dir {self.out_dir} is a URL; set data to a prepared dataset (the built-in "
                "corpus is written into a local run folder)"
            )
        if not isinstance(self.resume_optimizer, bool):
            raise ConfigError(f"train config: resume_optimizer must be true or false, got {self.resume_optimizer!r}")
        # Both describe the checkpoint a fresh run starts from; without one they would be silently ignored.
        for key in ("resume_optimizer", "seed_config"):
            if getattr(self, key) and not self.init_from:
                raise ConfigError(f"train config: {key} needs init_from (the seed checkpoint to start from)")
        if self.lora is not None:
            object.__setattr__(self, "lora", LoraConfig.from_dict(self.lora))
        if self.adam_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train config: adam_dtype must be float32 or bfloat16, got {self.adam_dtype!r}")
        if self.adam_dtype != "float32" and self.resume_optimizer:
            raise ConfigError(
                "train config: resume_optimizer continues the seed's moments as stored; keep adam_dtype float32"
            )
        _check_choice("optimizer_memory", self.optimizer_memory, OPTIMIZER_MEMORY)
        _ = self.policy  # checks the dtypes, remat and attention names
        _check_choice("objective", self.objective, OBJECTIVE_NAMES)
        object.__setattr__(self, "dpo", _section(DpoConfig, self.dpo, "dpo"))
        object.__setattr__(self, "orpo", _section(OrpoConfig, self.orpo, "orpo"))
        object.__setattr__(self, "grpo", _section(GrpoConfig, self.grpo, "grpo"))
        for section in ("dpo", "orpo", "grpo"):  # settings that would be silently ignored
            if self.objective != section and getattr(self, section) != type(getattr(self, section))():
                raise ConfigError(
                    f"train config: {section} settings apply to objective {section}, but objective is {self.objective}"
                )
        if self.objective == "grpo":
            self._check_grpo()
        if self.z_loss and self.objective != "lm":
            raise ConfigError(f"train config: z_loss applies to objective lm only, not {self.objective}")
        if self.lora is not None and self.dpo.reference == "copy":
            raise ConfigError(
                "train config: dpo.reference copy is for full fine-tuning; a LoRA run's reference is its base with "
                "the adapter switched off (no second copy), so leave dpo.reference out"
            )
        if self.base_dtype is not None:
            if self.base_dtype in QUANTIZED and self.base_dtype not in TRAINABLE_QUANTIZED:
                raise ConfigError(
                    f"train config: base_dtype {self.base_dtype!r} rounds the activations, which has no gradient; "
                    f"train over one of {list(TRAINABLE_QUANTIZED)} and serve it as {self.base_dtype}"
                )
            if self.base_dtype not in QUANTIZED:
                dtype_of(self.base_dtype)
            if self.lora is None:
                raise ConfigError(
                    f"train config: base_dtype {self.base_dtype!r} needs a lora section: a frozen base is trained "
                    "only through an adapter (a full fine-tune stores its weights as param_dtype)"
                )

    def _check_grpo(self) -> None:
        """A step trains on the completions of whole prompt groups, and a batch of rollouts is trained on for
        `num_iterations` steps together: checkpoints and the end fall between batches of rollouts."""
        g = self.grpo
        if self.batch_size % g.num_generations:
            raise ConfigError(
                f"train config: batch_size ({self.batch_size}) counts completions: it must be a multiple of "
                f"grpo.num_generations ({g.num_generations})"
            )
        for key in ("total_steps", "ckpt_every"):
            if getattr(self, key) % g.num_iterations:
                raise ConfigError(
                    f"train config: {key} ({getattr(self, key)}) must be a multiple of grpo.num_iterations "
                    f"({g.num_iterations}): a batch of rollouts trains that many steps, and a run saves between them"
                )

    @property
    def policy(self) -> Policy:
        """How the training step runs the model."""
        dropout = self.lora.dropout if self.lora else 0.0
        return Policy(self.param_dtype, self.compute_dtype, self.remat, self.attention, dropout)

    @property
    def frozen_dtype(self) -> str:
        """How a LoRA run stores its frozen base: `base_dtype`, else `param_dtype`."""
        return self.base_dtype or self.param_dtype

    @property
    def metrics_dir(self) -> str:
        """Where the metrics go (a local folder): `log_dir`, else the run folder."""
        return self.log_dir or self.out_dir

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["lora"] = self.lora.to_dict() if self.lora else None
        return values

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


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"train config: {key} must be one of {list(allowed)}, got {value!r}")


def _check_float(key: str, value: Any, ok: Any, what: str) -> None:
    """A finite number that passes `ok`: inf and nan pass comparisons like ">= 0" and would train to nan."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok(value):
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


def parse_override(item: str) -> tuple[list[str], Any]:
    """ "model.n_layer=2" -> (["model", "n_layer"], 2); the value is read as YAML (numbers, bools, lists)."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: value is not valid YAML ({one_line(e)})") from None
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
        elif path[0] in ("lora", "dpo", "orpo", "grpo") and len(path) == 2:
            values[path[0]] = {**(values.get(path[0]) or {}), path[1]: value}
        elif len(path) == 1:
            values[path[0]] = value
        else:
            raise ConfigError(f"--set {item!r}: only model.*, lora.*, dpo.*, orpo.* and grpo.* keys are nested")
    return values
