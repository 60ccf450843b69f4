"""Hugging Face folders of the GPT-J family (`GPTJForCausalLM`, `GPTNeoXForCausalLM`, `GPTNeoForCausalLM`,
`CodeGenForCausalLM`) <-> meshlm parameters.

Each architecture is one `Arch`: how its config.json maps to a `ModelConfig` and back, and a table of
which HF tensor holds each meshlm parameter in which `Layout`. One reader and one writer serve them all.

Import reads tensor slices lazily (safetensors is memory-mapped, `pytorch_model.bin` is loaded with
`mmap=True`), so a device reading heads h0..h1 of q reads only those rows, even out of a fused q/k/v
tensor; the host never holds more than one parameter at a time. Export writes sharded safetensors
files one tensor at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import ml_dtypes
import numpy as np

from meshlm import model
from meshlm.config import GPT2_VOCAB, CheckpointError, ConfigError, ModelConfig, dtype_of
from meshlm.formats import native
from meshlm.formats.slices import Index, Placed, SliceSource, normalise
from meshlm.paths import local_folder, read_json

# ---------------------------------------------------------------------------------------------------
# Tensor layouts


class Layout:
    """How one HF tensor holds one meshlm tensor (one layer's, for stacked parameters): the HF slice
    that holds a meshlm slice, and the reordering between the two. The base class is the identity."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        return index

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return ours

    def read(self, fetch: Callable[[Index], np.ndarray], index: Index, shape: tuple[int, ...]) -> np.ndarray:
        """The meshlm slice `index` of a tensor of `shape`; `fetch(hf_index)` reads a slice of the HF tensor."""
        return self.to_meshlm(fetch(self.hf_index(index, shape)), shape)


class Transposed(Layout):
    """torch Linear weights are [out, in]; meshlm's are [in, out]."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[::-1]

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        return index[::-1]

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.T

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ours.T)


def head_rows(heads: slice, head_dim: slice, d_head: int) -> slice:
    if (head_dim.start, head_dim.stop) != (0, d_head):
        raise ValueError("a shard must hold whole heads")
    return slice(heads.start * d_head, heads.stop * d_head)


class HeadsOut(Layout):
    """q/k/v: HF [H*K, D] -> meshlm [D, H, K]."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        d, h, k = shape
        return h * k, d

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        d, h, k = index
        return head_rows(h, k, shape[2]), d

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(-1, shape[2], hf.shape[1]).transpose(2, 0, 1)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ours.reshape(ours.shape[0], -1).T)


class HeadsBias(Layout):
    """q/k/v biases: HF [H*K] -> meshlm [H, K]."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0] * shape[1],)

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        h, k = index
        return (head_rows(h, k, shape[1]),)

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(-1, shape[1])

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return ours.reshape(-1)


class HeadsIn(Layout):
    """out projection: HF [D, H*K] -> meshlm [H, K, D]."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        h, k, d = shape
        return d, h * k

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        h, k, d = index
        return d, head_rows(h, k, shape[1])

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(hf.shape[0], -1, shape[1]).transpose(1, 2, 0)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ours.reshape(-1, ours.shape[-1]).T)


@dataclass(frozen=True)
class Fused(Layout):
    """One part ("q", "k" or "v") of a fused attention tensor, whose rows are [groups, 3, rows, ...]:
    each group holds `rows` rows of each part, in `order`. GPT-NeoX's query_key_value has a group per
    head (rows = d_head, order q, k, v); CodeGen's qkv_proj has 4 groups (rows = d_model / 4, order
    q, v, k). `inner` is the part's layout as if it were a tensor of its own."""

    inner: Layout
    part: str
    order: str
    rows: int

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        first, *rest = self.inner.hf_shape(shape)
        return (3 * first, *rest)

    def read(self, fetch: Callable[[Index], np.ndarray], index: Index, shape: tuple[int, ...]) -> np.ndarray:
        """Reads only the part's rows that `index` covers: one contiguous run per group it touches."""
        rows, *rest = self.inner.hf_index(index, shape)
        offset = self.order.index(self.part) * self.rows
        runs, start = [], rows.start
        while start < rows.stop:
            group = start // self.rows
            stop = min(rows.stop, (group + 1) * self.rows)
            shift = 2 * group * self.rows + offset  # part row a of group g is fused row g*3R + offset + (a - g*R)
            runs.append(slice(start + shift, stop + shift))
            start = stop
        return self.inner.to_meshlm(np.concatenate([fetch((run, *rest)) for run in runs]), shape)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        """This part's rows only, in the order they would have standing alone; `join` interleaves the parts."""
        return self.inner.to_hf(ours)

    def join(self, parts: dict[str, np.ndarray]) -> np.ndarray:
        """The fused tensor from each part's `to_hf`."""
        grouped = [parts[p].reshape(-1, self.rows, *parts[p].shape[1:]) for p in self.order]
        return np.stack(grouped, axis=1).reshape(-1, *grouped[0].shape[2:])


SAME, T = Layout(), Transposed()
# meshlm parameter path -> (HF tensor name, with {} for the layer index, and its layout), in HF's order
Tensors = dict[str, tuple[str, Layout]]


def _fused(template: str, inner: Layout, order: str, rows: int, suffix: str = "") -> Tensors:
    return {f"layers.attn.{p}{suffix}": (template, Fused(inner, p, order, rows)) for p in "qkv"}


def _gptj_tensors(cfg: ModelConfig) -> Tensors:
    h = "transformer.h.{}."
    return {
        "embed.w": ("transformer.wte.weight", SAME),
        "layers.ln.scale": (h + "ln_1.weight", SAME),
        "layers.ln.bias": (h + "ln_1.bias", SAME),
        "layers.attn.q": (h + "attn.q_proj.weight", HeadsOut()),
        "layers.attn.k": (h + "attn.k_proj.weight", HeadsOut()),
        "layers.attn.v": (h + "attn.v_proj.weight", HeadsOut()),
        "layers.attn.out": (h + "attn.out_proj.weight", HeadsIn()),
        "layers.mlp.fc_in.w": (h + "mlp.fc_in.weight", T),
        "layers.mlp.fc_in.b": (h + "mlp.fc_in.bias", SAME),
        "layers.mlp.fc_out.w": (h + "mlp.fc_out.weight", T),
        "layers.mlp.fc_out.b": (h + "mlp.fc_out.bias", SAME),
        "ln_f.scale": ("transformer.ln_f.weight", SAME),
        "ln_f.bias": ("transformer.ln_f.bias", SAME),
        "head.w": ("lm_head.weight", T),
        "head.b": ("lm_head.bias", SAME),
    }


CODEGEN_MP = 4  # CodeGen's qkv_proj groups (`mp_num`, fixed in transformers' modeling_codegen.py)


def _codegen_tensors(cfg: ModelConfig) -> Tensors:
    """GPT-J's tensors, but q, k and v fused in one qkv_proj (dict update keeps GPT-J's order)."""
    rows = cfg.d_model // CODEGEN_MP
    return {**_gptj_tensors(cfg), **_fused("transformer.h.{}.attn.qkv_proj.weight", HeadsOut(), "qvk", rows)}


def _gpt_neox_tensors(cfg: ModelConfig) -> Tensors:
    h = "gpt_neox.layers.{}."
    qkv = h + "attention.query_key_value."
    return {
        "embed.w": ("gpt_neox.embed_in.weight", SAME),
        "layers.ln.scale": (h + "input_layernorm.weight", SAME),
        "layers.ln.bias": (h + "input_layernorm.bias", SAME),
        "layers.ln_mlp.scale": (h + "post_attention_layernorm.weight", SAME),
        "layers.ln_mlp.bias": (h + "post_attention_layernorm.bias", SAME),
        **_fused(qkv + "weight", HeadsOut(), "qkv", cfg.d_head),
        **_fused(qkv + "bias", HeadsBias(), "qkv", cfg.d_head, suffix="_bias"),
        "layers.attn.out": (h + "attention.dense.weight", HeadsIn()),
        "layers.attn.out_bias": (h + "attention.dense.bias", SAME),
        "layers.mlp.fc_in.w": (h + "mlp.dense_h_to_4h.weight", T),
        "layers.mlp.fc_in.b": (h + "mlp.dense_h_to_4h.bias", SAME),
        "layers.mlp.fc_out.w": (h + "mlp.dense_4h_to_h.weight", T),
        "layers.mlp.fc_out.b": (h + "mlp.dense_4h_to_h.bias", SAME),
        "ln_f.scale": ("gpt_neox.final_layer_norm.weight", SAME),
        "ln_f.bias": ("gpt_neox.final_layer_norm.bias", SAME),
        "head.w": ("embed_out.weight", T),
    }


def _gpt_neo_tensors(cfg: ModelConfig) -> Tensors:
    h = "transformer.h.{}."
    a = h + "attn.attention."
    return {
        "embed.w": ("transformer.wte.weight", SAME),
        "pos_embed.w": ("transformer.wpe.weight", SAME),
        "layers.ln.scale": (h + "ln_1.weight", SAME),
        "layers.ln.bias": (h + "ln_1.bias", SAME),
        "layers.attn.q": (a + "q_proj.weight", HeadsOut()),
        "layers.attn.k": (a + "k_proj.weight", HeadsOut()),
        "layers.attn.v": (a + "v_proj.weight", HeadsOut()),
        "layers.attn.out": (a + "out_proj.weight", HeadsIn()),
        "layers.attn.out_bias": (a + "out_proj.bias", SAME),
        "layers.ln_mlp.scale": (h + "ln_2.weight", SAME),
        "layers.ln_mlp.bias": (h + "ln_2.bias", SAME),
        "layers.mlp.fc_in.w": (h + "mlp.c_fc.weight", T),
        "layers.mlp.fc_in.b": (h + "mlp.c_fc.bias", SAME),
        "layers.mlp.fc_out.w": (h + "mlp.c_proj.weight", T),
        "layers.mlp.fc_out.b": (h + "mlp.c_proj.bias", SAME),
        "ln_f.scale": ("transformer.ln_f.weight", SAME),
        "ln_f.bias": ("transformer.ln_f.bias", SAME),
        "head.w": ("lm_head.weight", T),
    }


# ---------------------------------------------------------------------------------------------------
# config.json

_REQUIRED = object()
# transformers' activation names -> meshlm's ("gelu_pytorch_tanh" is gelu_new's formula in one torch kernel)
HF_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu"}


class Fields:
    """config.json's values, each by any of its spellings; an error names the key and the file."""

    def __init__(self, hf: dict[str, Any], source: str):
        self.hf, self.source = hf, source

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def get(self, *names: str, default: Any = _REQUIRED) -> tuple[str, Any]:
        """(the spelling found, its value): the first of `names` present and not null, else `default`."""
        for name in names:
            if self.hf.get(name) is not None:
                return name, self.hf[name]
        if default is _REQUIRED:
            raise self.error(f"missing key {names[0]!r}")
        return names[0], default

    def int(self, *names: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
        name, value = self.get(*names, default=default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(f"{name} must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, *names: str, default: float) -> float:
        """A positive number."""
        name, value = self.get(*names, default=default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise self.error(f"{name} must be a number > 0, got {value!r}")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        _, value = self.get(name, default=default)
        if not isinstance(value, bool):
            raise self.error(f"{name} must be true or false, got {value!r}")
        return value

    def activation(self, name: str, default: str) -> str:
        _, value = self.get(name, default=default)
        if value not in HF_ACTIVATIONS:
            raise self.error(f"{name} {value!r} is not supported (supported: {sorted(HF_ACTIVATIONS)})")
        return HF_ACTIVATIONS[value]

    def heads(self, width: str, heads: str) -> tuple[int, int]:
        """(d_model, n_head), checked that the heads divide the width."""
        d_model, n_head = self.int(width), self.int(heads)
        if d_model % n_head:
            raise self.error(f"{heads} ({n_head}) must divide {width} ({d_model})")
        return d_model, n_head


def _gptj_config(f: Fields) -> dict[str, Any]:
    """GPTJConfig, which CodeGenConfig repeats (transformers' class defaults where a key is absent)."""
    d_model, n_head = f.heads("n_embd", "n_head")
    rotary_dim = f.hf.get("rotary_dim", 64)  # null: the whole head
    if rotary_dim is None:
        rotary_dim = d_model // n_head
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim < 0 or rotary_dim % 2:
        raise f.error(f"rotary_dim must be a non-negative even integer, got {rotary_dim!r}")
    vocab = f.int("vocab_size")
    return dict(
        n_layer=f.int("n_layer"),
        d_model=d_model,
        n_head=n_head,
        d_ff=f.int("n_inner", default=4 * d_model),
        rotary_dim=rotary_dim,
        vocab_size=vocab,
        n_vocab_used=min(vocab, GPT2_VOCAB),
        max_seq_len=f.int("n_positions", default=2048),
        layer_norm_eps=f.number("layer_norm_epsilon", default=1e-5),
        tie_embeddings=f.flag("tie_word_embeddings", False),
        activation=f.activation("activation_function", "gelu_new"),
    )


def _codegen_config(f: Fields) -> dict[str, Any]:
    if f.int("n_embd") % CODEGEN_MP:
        raise f.error(f"n_embd must be a multiple of {CODEGEN_MP} (CodeGen's qkv_proj groups), got {f.hf['n_embd']}")
    return _gptj_config(f)


def _gpt_neox_config(f: Fields) -> dict[str, Any]:
    """GPTNeoXConfig: rotary settings in `rope_parameters` (transformers 5) or top-level `rotary_pct` and
    `rotary_emb_base` (the Pythia folders on the hub)."""
    d_model, n_head = f.heads("hidden_size", "num_attention_heads")
    rope_key, rope = f.get("rope_parameters", "rope_scaling", default={})
    if not isinstance(rope, dict):
        raise f.error(f"{rope_key} must be a mapping, got {rope!r}")
    rope_fields = Fields({**f.hf, **{f"{rope_key}.{k}": v for k, v in rope.items()}}, f.source)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise f.error(f"{rope_key}.rope_type {rope_type!r} is not supported (only 'default' rotary embeddings)")
    pct_key, pct = rope_fields.get(
        f"{rope_key}.partial_rotary_factor", "partial_rotary_factor", "rotary_pct", default=0.25
    )
    d_head = d_model // n_head
    if isinstance(pct, bool) or not isinstance(pct, int | float) or not 0 <= pct <= 1 or int(d_head * pct) % 2:
        raise f.error(f"{pct_key} must be in [0, 1] and give an even number of rotary dims of {d_head}, got {pct!r}")
    bias = f.flag("attention_bias", True)
    return dict(
        n_layer=f.int("num_hidden_layers"),
        d_model=d_model,
        n_head=n_head,
        d_ff=f.int("intermediate_size"),
        rotary_dim=int(d_head * pct),
        vocab_size=f.int("vocab_size"),
        n_vocab_used=f.int("vocab_size"),
        max_seq_len=f.int("max_position_embeddings", default=2048),
        layer_norm_eps=f.number("layer_norm_eps", default=1e-5),
        residual="parallel_two_norms" if f.flag("use_parallel_residual", True) else "sequential",
        rotary_style="half",
        rotary_base=rope_fields.number(f"{rope_key}.rope_theta", "rope_theta", "rotary_emb_base", default=10000.0),
        qkv_bias=bias,
        out_bias=bias,
        tie_embeddings=f.flag("tie_word_embeddings", False),
        head_bias=False,
        activation=f.activation("hidden_act", "gelu"),
    )


def _neo_layer_kinds(f: Fields, n_layer: int) -> tuple[str, ...]:
    """Each layer's attention kind: `attention_types` [[kinds, repeats], ...] expanded (transformers derives
    `attention_layers` from it), else `attention_layers` as written."""
    if "attention_types" in f.hf or "attention_layers" not in f.hf:
        key, types = f.get("attention_types", default=[[["global", "local"], 12]])
        try:
            kinds = [kind for group, repeats in types for _ in range(repeats) for kind in group]
        except (TypeError, ValueError):
            raise f.error(f"{key} must be a list of [[kinds...], repeats], got {types!r}") from None
    else:
        key, kinds = "attention_layers", f.hf["attention_layers"]
    if not isinstance(kinds, list) or any(k not in ("global", "local") for k in kinds):
        raise f.error(f"{key} may name only 'global' and 'local' layers, got {f.hf.get(key)!r}")
    if len(kinds) != n_layer:
        raise f.error(f"{key} gives {len(kinds)} layers but num_layers is {n_layer}")
    period = next(p for p in range(1, n_layer + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return tuple(kinds[:period])


def _gpt_neo_config(f: Fields) -> dict[str, Any]:
    d_model, n_head = f.heads("hidden_size", "num_heads")
    n_layer = f.int("num_layers")
    kinds = _neo_layer_kinds(f, n_layer)
    vocab = f.int("vocab_size")
    window = f.int("window_size", default=256)
    return dict(
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        d_ff=f.int("intermediate_size", default=4 * d_model),
        rotary_dim=0,
        vocab_size=vocab,
        n_vocab_used=min(vocab, GPT2_VOCAB),
        max_seq_len=f.int("max_position_embeddings", default=2048),
        layer_norm_eps=f.number("layer_norm_epsilon", default=1e-5),
        residual="sequential",
        position="learned",
        attention_layers=kinds,
        local_window=window if "local" in kinds else 0,
        scale_attn=False,
        out_bias=True,
        tie_embeddings=f.flag("tie_word_embeddings", True),
        head_bias=False,
        activation=f.activation("activation_function", "gelu_new"),
    )


def _gpt2_end_of_text(cfg: ModelConfig) -> dict[str, Any]:
    """GPT-2's <|endoftext|> (50256) as the bos/eos token where the vocabulary has it (transformers warns otherwise)."""
    eot = GPT2_VOCAB - 1 if cfg.vocab_size >= GPT2_VOCAB else None
    return {"bos_token_id": eot, "eos_token_id": eot}


def _gptj_export(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "rotary_dim": cfg.rotary_dim,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "activation_function": cfg.activation,
        **_gpt2_end_of_text(cfg),
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
    }


def _gpt_neox_export(cfg: ModelConfig) -> dict[str, Any]:
    """Both spellings of the rotary settings, so that transformers before and after 5.0 read them."""
    if cfg.qkv_bias != cfg.out_bias:
        raise ConfigError(
            f"model config: qkv_bias ({cfg.qkv_bias}) and out_bias ({cfg.out_bias}) differ, but "
            "GPTNeoXForCausalLM has one attention_bias for both"
        )
    pct = cfg.rotary_dim / cfg.d_head
    if int(cfg.d_head * pct) != cfg.rotary_dim:
        raise ConfigError(
            f"model config: rotary_dim {cfg.rotary_dim} of {cfg.d_head} is no rotary_pct transformers reads back"
        )
    return {
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.layer_norm_eps,
        "hidden_act": cfg.activation,
        "use_parallel_residual": cfg.residual == "parallel_two_norms",
        "attention_bias": cfg.qkv_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base, "partial_rotary_factor": pct},
        "rotary_pct": pct,
        "rotary_emb_base": cfg.rotary_base,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    }


def _gpt_neo_export(cfg: ModelConfig) -> dict[str, Any]:
    kinds = list(cfg.attention_layers)
    repeats, rest = divmod(cfg.n_layer, len(kinds))
    return {
        "hidden_size": cfg.d_model,
        "num_layers": cfg.n_layer,
        "num_heads": cfg.n_head,
        "intermediate_size": cfg.d_ff,
        "attention_types": [[kinds, repeats]] if not rest else [[list(cfg.layer_kinds), 1]],
        "attention_layers": list(cfg.layer_kinds),
        "window_size": cfg.local_window or 256,
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "activation_function": cfg.activation,
        **_gpt2_end_of_text(cfg),
        "attention_dropout": 0.0,
        "embed_dropout": 0.0,
        "resid_dropout": 0.0,
    }


# What every architecture below fixes; `Arch.fixes` adds the rest.
LAYERNORM = {"norm": ("layernorm",)}
ROTARY = {**LAYERNORM, "position": ("rotary",), "attention_layers": (("global",),), "scale_attn": (True,)}


@dataclass(frozen=True)
class Arch:
    """One transformers architecture: config.json <-> ModelConfig, and where each parameter's tensor is."""

    model_type: str
    class_name: str
    required: tuple[str, ...]  # config.json keys without a sensible default
    config: Callable[[Fields], dict[str, Any]]  # config.json -> ModelConfig fields
    tensors: Callable[[ModelConfig], Tensors]
    export: Callable[[ModelConfig], dict[str, Any]] | None = None  # ModelConfig -> config.json; None: import only
    # the ModelConfig fields this architecture fixes -> the values it can represent
    fixes: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def mismatches(self, cfg: ModelConfig) -> list[str]:
        """The fields of `cfg` this architecture cannot represent, each with what it would need."""
        values = {**cfg.to_dict(), "attention_layers": tuple(sorted(set(cfg.layer_kinds)))}
        return [
            f"{key} {values[key]!r} (transformers' {self.class_name} needs {' or '.join(map(repr, allowed))})"
            for key, allowed in self.fixes.items()
            if values[key] not in allowed
        ]


GPTJ = Arch(
    "gptj", "GPTJForCausalLM", ("n_embd", "n_layer", "n_head", "vocab_size"), _gptj_config, _gptj_tensors,
    _gptj_export,
    {**ROTARY, "rotary_style": ("interleaved",), "rotary_base": (10000.0,), "residual": ("parallel",),
     "qkv_bias": (False,), "out_bias": (False,), "head_bias": (True,)},
)  # fmt: skip
ARCHS: dict[str, Arch] = {
    "gptj": GPTJ,
    "gpt_neox": Arch(
        "gpt_neox", "GPTNeoXForCausalLM",
        ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"),
        _gpt_neox_config, _gpt_neox_tensors, _gpt_neox_export,
        {**ROTARY, "rotary_style": ("half",), "residual": ("parallel_two_norms", "sequential"), "head_bias": (False,)},
    ),
    "gpt_neo": Arch(
        "gpt_neo", "GPTNeoForCausalLM", ("hidden_size", "num_layers", "num_heads", "vocab_size"),
        _gpt_neo_config, _gpt_neo_tensors, _gpt_neo_export,
        {**LAYERNORM, "position": ("learned",), "residual": ("sequential",), "scale_attn": (False,),
         "qkv_bias": (False,), "out_bias": (True,), "head_bias": (False,)},
    ),
    # The same math as GPT-J, so exported as GPT-J.
    "codegen": Arch("codegen", "CodeGenForCausalLM", GPTJ.required, _codegen_config, _codegen_tensors),
}  # fmt: skip


def _arch_of(hf: dict[str, Any], source: str) -> Arch:
    model_type = hf.get("model_type")
    if model_type not in ARCHS:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported; meshlm reads {', '.join(map(repr, ARCHS))}"
        )
    arch = ARCHS[model_type]
    missing = [k for k in arch.required if hf.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: {arch.class_name} config is missing key(s) {missing}")
    return arch


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json of any supported architecture."""
    fields = _arch_of(hf, source).config(Fields(hf, source))
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def export_arch(cfg: ModelConfig) -> Arch:
    """The architecture that represents `cfg` (the one with fewest mismatches, to name them if any)."""
    exporting = [a for a in ARCHS.values() if a.export is not None]
    best = min(exporting, key=lambda a: len(a.mismatches(cfg)))
    if problems := best.mismatches(cfg):
        raise ConfigError(f"model config: no Hugging Face architecture represents {problems[0]}")
    return best


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json that transformers' `from_pretrained` loads `cfg` from, in the architecture that
    represents it; a ConfigError naming the field if none does."""
    arch = export_arch(cfg)
    return {
        "architectures": [arch.class_name],
        "model_type": arch.model_type,
        **arch.export(cfg),
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }


def _read_config(folder: Path) -> tuple[Arch, ModelConfig]:
    path = folder / "config.json"
    hf = read_json(path, f"{path}: not found; a Hugging Face model folder needs config.json")
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return _arch_of(hf, str(path)), from_hf_config(hf, source=str(path))


def load_hf_config(folder: str | Path) -> ModelConfig:
    return _read_config(Path(folder))[1]


# ---------------------------------------------------------------------------------------------------
# The HF tensors of a config


class HFTensor(NamedTuple):
    """One tensor of the HF state dict: its name, its layer (None outside the blocks), and the meshlm
    parameters it holds with their layouts (three for a fused q/k/v, else one)."""

    name: str
    layer: int | None
    parts: list[tuple[str, Layout]]


def hf_tensors(arch: Arch, cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of `cfg`'s HF state dict in `arch`, in HF's order (layer by layer)."""
    shapes = model.param_shapes(cfg)
    table = {key: entry for key, entry in arch.tensors(cfg).items() if key in shapes}
    if unmapped := [k for k in shapes if k not in table]:
        raise ConfigError(f"model config: {arch.class_name} has no tensor for parameter(s) {unmapped}")
    groups: dict[str, list[tuple[str, Layout]]] = {}
    for key, (template, layout) in table.items():
        groups.setdefault(template, []).append((key, layout))
    per_layer = [(template, parts) for template, parts in groups.items() if "{}" in template]
    out = []
    for template, parts in groups.items():
        if "{}" not in template:
            out.append(HFTensor(template, None, parts))
        elif template == per_layer[0][0]:
            out += [HFTensor(t.format(i), i, p) for i in range(cfg.n_layer) for t, p in per_layer]
    return out


def _hf_shape(tensor: HFTensor, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    key, layout = tensor.parts[0]
    return layout.hf_shape(shapes[key][1:] if tensor.layer is not None else shapes[key])


# ---------------------------------------------------------------------------------------------------
# Reading


class TensorReader(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str, index: Index) -> np.ndarray: ...


def _weight_map(index: Path) -> dict[str, str]:
    """The tensor -> file map of a sharded checkpoint's index."""
    found = read_json(index, f"{index}: not found")
    mapping = found.get("weight_map") if isinstance(found, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise CheckpointError(f"{index}: has no 'weight_map' from tensor names to file names")
    return mapping


class SafetensorsReader:
    """One `model.safetensors` or a sharded set with `model.safetensors.index.json`; slices are read lazily.

    Each read maps its file only for that read: a mapping kept open keeps every page read through it
    resident, so streaming a 13 GiB checkpoint through long-lived handles grew the process to 13 GiB."""

    def __init__(self, files: dict[str, Path]):
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in set(files.values()):
            with _safe_open(path) as f:
                self._shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})  # noqa: SIM118
        self._file_of = {name: path for name, path in files.items() if name in self._shapes}  # listed and present

    @classmethod
    def open(cls, folder: Path) -> SafetensorsReader:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = {name: folder / fname for name, fname in _weight_map(index).items()}
            for f in set(files.values()):
                if not f.exists():
                    raise CheckpointError(f"{index}: lists {f.name}, which is missing from {folder}")
            return cls(files)
        path = folder / "model.safetensors"
        with _safe_open(path) as f:
            names = list(f.keys())
        return cls(dict.fromkeys(names, path))

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, index: Index) -> np.ndarray:
        with _safe_open(self._file_of[name]) as f:
            return f.get_slice(name)[index]  # safetensors copies the slice out: it outlives the mapping


def _safe_open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="np")
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


class TorchBinReader:
    """`pytorch_model.bin` (optionally sharded with an index), memory-mapped through torch."""

    def __init__(self, folder: Path):
        try:
            import torch
        except ImportError:
            raise CheckpointError(
                f"{folder}: holds pytorch_model.bin, which needs torch installed (or convert it to safetensors)"
            ) from None
        index = folder / "pytorch_model.bin.index.json"
        files = sorted(set(_weight_map(index).values())) if index.exists() else ["pytorch_model.bin"]
        self._tensors: dict[str, Any] = {}
        for fname in files:
            try:
                self._tensors.update(torch.load(folder / fname, map_location="cpu", mmap=True, weights_only=True))
            except Exception as e:
                raise CheckpointError(f"{folder / fname}: not a readable torch checkpoint ({e})") from None
        self._torch = torch

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(self, name: str, index: Index) -> np.ndarray:
        t = self._tensors[name][index]
        if t.dtype == self._torch.bfloat16:
            return t.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()


def open_reader(folder: Path) -> TensorReader:
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return SafetensorsReader.open(folder)
    if (folder / "pytorch_model.bin").exists() or (folder / "pytorch_model.bin.index.json").exists():
        return TorchBinReader(folder)
    raise CheckpointError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin found")


# Buffers that old transformers versions saved with the weights (causal masks, rotary frequencies); they are
# recomputed, never read.
BUFFERS = re.compile(r"\.(attn|attention)\.(bias|masked_bias|causal_mask|rotary_emb\.inv_freq)$")


def _listing(names: list[str]) -> str:
    return f"{names[:3]}" + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def _check_tensors(reader: TensorReader, arch: Arch, cfg: ModelConfig, tensors: list[HFTensor], folder: Path) -> None:
    """Every tensor the config implies is there with the shape it implies, and nothing else is (a tensor
    the config does not account for, such as a bias where config.json says there is none, would be
    silently dropped)."""
    names = reader.names()
    missing = [t.name for t in tensors if t.name not in names]
    if missing:
        raise CheckpointError(f"{folder}: checkpoint lacks tensor(s) {_listing(missing)} that config.json implies")
    shapes = model.param_shapes(cfg)
    for t in tensors:
        want, got = _hf_shape(t, shapes), reader.shape(t.name)
        if got != want:
            raise CheckpointError(f"{folder}: tensor {t.name} has shape {list(got)}, config.json implies {list(want)}")
    tied_head = {arch.tensors(cfg)["head.w"][0]} if cfg.tie_embeddings else set()
    expected = {t.name for t in tensors} | tied_head
    extra = sorted(n for n in names - expected if not BUFFERS.search(n))
    if extra:
        raise CheckpointError(f"{folder}: checkpoint has tensor(s) {_listing(extra)} that config.json does not imply")


def _leaf_reader(
    reader: TensorReader, template: str, layout: Layout, shape: tuple[int, ...], stacked: bool, dtype: Any
) -> Callable[[Index], np.ndarray]:
    def fetch(name: str) -> Callable[[Index], np.ndarray]:
        return lambda index: reader.read(name, index)

    def read(index: Index) -> np.ndarray:
        index = normalise(index, shape)
        if not stacked:
            return layout.read(fetch(template), index, shape).astype(dtype)
        layers = range(*index[0].indices(shape[0]))
        return np.stack([layout.read(fetch(template.format(i)), index[1:], shape[1:]).astype(dtype) for i in layers])

    return read


def detect(path: str | Path) -> bool:
    """A Hugging Face model folder: it has a config.json (which `open` then checks)."""
    return (Path(path) / "config.json").is_file()


def open(folder: str | Path, dtype: str) -> tuple[ModelConfig, SliceSource]:
    """The folder's config and its tensors' slices in meshlm's layout and `dtype`, read lazily (the
    tensors' names and shapes are checked against the config first)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    arch, cfg = _read_config(folder)
    reader = open_reader(folder)
    _check_tensors(reader, arch, cfg, hf_tensors(arch, cfg), folder)
    table = arch.tensors(cfg)
    target = dtype_of(dtype)

    def source(key: str, shape: tuple[int, ...]) -> Callable[[Index], np.ndarray]:
        template, layout = table[key]
        return _leaf_reader(reader, template, layout, shape, key.startswith("layers."), target)

    return cfg, source


# ---------------------------------------------------------------------------------------------------
# Writing


def iter_hf_tensors(
    cfg: ModelConfig, read: Callable[[str, int | None], np.ndarray], dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in `dtype`) for every tensor of `cfg`'s architecture, in HF's order; `read(key,
    layer)` gives meshlm parameter `key` (its layer `layer` when stacked) on the host, and is called only
    as each tensor is written."""
    target = dtype_of(dtype)
    for t in hf_tensors(export_arch(cfg), cfg):
        # cast first: the transpose then moves fewer bytes
        parts = {
            key: layout.to_hf(np.asarray(read(key, t.layer)).astype(target, copy=False)) for key, layout in t.parts
        }
        if len(parts) == 1:
            yield t.name, next(iter(parts.values()))
        else:
            fused = t.parts[0][1]
            yield t.name, fused.join({layout.part: parts[key] for key, layout in t.parts})


SHARD_BYTES = 512 << 20  # a safetensors file: what the host holds at once while writing


def write(
    folder: str | Path,
    cfg: ModelConfig,
    dtype: str,
    source: SliceSource,
    files: dict[str, Path] | None = None,
    max_shard_bytes: int = SHARD_BYTES,
) -> None:
    """Write a folder that transformers' `from_pretrained` loads as is (GPT-J, GPT-NeoX, GPT-Neo or CodeGen,
    as `cfg` is), in `dtype`, from `source` one tensor at a time: peak host memory is one shard of at most
    `max_shard_bytes` plus a few copies of the largest tensor, whatever the model size.

    `files` (the model's tokenizer) go in first and config.json last, so an unfinished folder is never
    taken for a model; a config no architecture represents is refused before anything is written. A
    `Placed` source (a loaded model's parameters) is written by every process of a job together, process 0
    writing the files; any other by the one process that calls.
    """
    from tqdm import tqdm

    folder = local_folder(folder, "Hugging Face folder")
    dtype_of(dtype)
    config_json = to_hf_config(cfg, dtype)
    native.start_folder(folder, files or {}, every_process=isinstance(source, Placed))
    shapes = model.param_shapes(cfg)

    def read(key: str, layer: int | None) -> np.ndarray:
        whole = tuple(slice(0, n) for n in shapes[key])
        if layer is None:
            return source(key, shapes[key])(whole)
        return source(key, shapes[key])((slice(layer, layer + 1), *whole[1:]))[0]

    total = len(hf_tensors(export_arch(cfg), cfg))
    tensors = tqdm(iter_hf_tensors(cfg, read, dtype), total=total, desc="writing", unit="tensor", leave=False)
    write_folder(folder, tensors, config_json, max_shard_bytes, jax.process_index() == 0)


def write_folder(
    folder: str | Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    config_json: dict[str, Any],
    max_shard_bytes: int = SHARD_BYTES,
    is_writer: bool = True,
) -> None:
    """Write (HF name, array) pairs, in HF order, as safetensors shards of at most `max_shard_bytes`
    each, then the index and config.json; shards are written as the tensors arrive."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    pending_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            if is_writer:
                save_file(pending, str(folder / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
            shards.append(list(pending))
            pending, pending_bytes = {}, 0

    for name, array in tensors:
        if pending and pending_bytes + array.nbytes > max_shard_bytes:
            flush()
        pending[name] = array
        pending_bytes += array.nbytes
        total_bytes += array.nbytes
    flush()
    if not is_writer:
        return

    if len(shards) == 1:
        (folder / "shard-00000.tmp").replace(folder / "model.safetensors")
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (folder / f"shard-{i:05d}.tmp").replace(folder / fname)
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config_json, indent=2))
