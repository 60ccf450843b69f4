"""Hugging Face `GPTJForCausalLM` folders <-> meshlm parameters.

Import reads tensor slices lazily (safetensors is memory-mapped, `pytorch_model.bin` is loaded with
`mmap=True`) and builds each parameter with `jax.make_array_from_callback`, so every device receives
only its own shard and the host never holds more than one parameter at a time. Export writes sharded
safetensors files one layer at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import ml_dtypes
import numpy as np

from meshlm import model
from meshlm.config import GPT2_VOCAB, ConfigError, ModelConfig
from meshlm.formats.slices import Index, SliceSource, normalise, np_dtype
from meshlm.sharding import to_host

# ---------------------------------------------------------------------------------------------------
# config.json

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


class Layout(Protocol):
    """How one HF tensor maps to one meshlm tensor (per layer for stacked parameters)."""

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index: ...
    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray: ...
    def to_hf(self, ours: np.ndarray) -> np.ndarray: ...


class Same:
    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        return index

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return ours


class Transposed:
    """torch Linear weights are [out, in]; meshlm's are [in, out]."""

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


class HeadsOut:
    """q/k/v: HF [H*K, D] -> meshlm [D, H, K]."""

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        d, h, k = index
        return head_rows(h, k, shape[2]), d

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(-1, shape[2], hf.shape[1]).transpose(2, 0, 1)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ours.reshape(ours.shape[0], -1).T)


class HeadsIn:
    """out projection: HF [D, H*K] -> meshlm [H, K, D]."""

    def hf_index(self, index: Index, shape: tuple[int, ...]) -> Index:
        h, k, d = index
        return d, head_rows(h, k, shape[1])

    def to_meshlm(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(hf.shape[0], -1, shape[1]).transpose(1, 2, 0)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ours.reshape(-1, ours.shape[-1]).T)


# meshlm parameter path -> (HF tensor name, with {} for the layer index, and its layout)
HF_NAMES: dict[str, tuple[str, Layout]] = {
    "embed.w": ("transformer.wte.weight", Same()),
    "layers.ln.scale": ("transformer.h.{}.ln_1.weight", Same()),
    "layers.ln.bias": ("transformer.h.{}.ln_1.bias", Same()),
    "layers.attn.q": ("transformer.h.{}.attn.q_proj.weight", HeadsOut()),
    "layers.attn.k": ("transformer.h.{}.attn.k_proj.weight", HeadsOut()),
    "layers.attn.v": ("transformer.h.{}.attn.v_proj.weight", HeadsOut()),
    "layers.attn.out": ("transformer.h.{}.attn.out_proj.weight", HeadsIn()),
    "layers.mlp.fc_in.w": ("transformer.h.{}.mlp.fc_in.weight", Transposed()),
    "layers.mlp.fc_in.b": ("transformer.h.{}.mlp.fc_in.bias", Same()),
    "layers.mlp.fc_out.w": ("transformer.h.{}.mlp.fc_out.weight", Transposed()),
    "layers.mlp.fc_out.b": ("transformer.h.{}.mlp.fc_out.bias", Same()),
    "ln_f.scale": ("transformer.ln_f.weight", Same()),
    "ln_f.bias": ("transformer.ln_f.bias", Same()),
    "head.w": ("lm_head.weight", Transposed()),
    "head.b": ("lm_head.bias", Same()),
}


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name of a GPT-J state dict, in HF's own order (layer by layer)."""
    top = [HF_NAMES["embed.w"][0]]
    per_layer = [name for key, (name, _) in HF_NAMES.items() if key.startswith("layers.")]
    layers = [name.format(i) for i in range(cfg.n_layer) for name in per_layer]
    tail = [HF_NAMES[k][0] for k in ("ln_f.scale", "ln_f.bias", "head.w", "head.b")]
    return top + layers + tail


# ---------------------------------------------------------------------------------------------------
# Reading


class TensorReader(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str, index: Index) -> np.ndarray: ...


class SafetensorsReader:
    """One `model.safetensors` or a sharded set with `model.safetensors.index.json`; slices are read lazily."""

    def __init__(self, files: dict[str, Path]):
        from safetensors import safe_open

        self._handles = {f: safe_open(str(f), framework="np") for f in set(files.values())}
        self._file_of = files

    @classmethod
    def open(cls, folder: Path) -> SafetensorsReader:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: folder / fname for name, fname in weight_map.items()}
            for f in set(files.values()):
                if not f.exists():
                    raise ConfigError(f"{index}: lists {f.name}, which is missing from {folder}")
            return cls(files)
        from safetensors import safe_open

        path = folder / "model.safetensors"
        try:
            with safe_open(str(path), framework="np") as f:
                names = list(f.keys())
        except Exception as e:
            raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None
        return cls(dict.fromkeys(names, path))

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def read(self, name: str, index: Index) -> np.ndarray:
        return self._handles[self._file_of[name]].get_slice(name)[index]


class TorchBinReader:
    """`pytorch_model.bin` (optionally sharded with an index), memory-mapped through torch."""

    def __init__(self, folder: Path):
        try:
            import torch
        except ImportError:
            raise ConfigError(
                f"{folder}: holds pytorch_model.bin, which needs torch installed (or convert it to safetensors)"
            ) from None
        index = folder / "pytorch_model.bin.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.exists()
            else ["pytorch_model.bin"]
        )
        self._tensors: dict[str, Any] = {}
        for fname in files:
            try:
                self._tensors.update(torch.load(folder / fname, map_location="cpu", mmap=True, weights_only=True))
            except Exception as e:
                raise ConfigError(f"{folder / fname}: not a readable torch checkpoint ({e})") from None
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
    raise ConfigError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin found")


def _expected_hf_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    return layout.to_hf(np.empty(shape, np.int8)).shape


def _check_tensors(reader: TensorReader, cfg: ModelConfig, abstract: Any, folder: Path) -> None:
    names = reader.names()
    missing = [n for n in hf_tensor_names(cfg) if n not in names]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConfigError(f"{folder}: checkpoint lacks tensor(s) {missing[:3]}{more} that config.json implies")
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        key = model.param_name(path)
        template, layout = HF_NAMES[key]
        shape = leaf.shape[1:] if key.startswith("layers.") else leaf.shape
        want = _expected_hf_shape(layout, shape)
        got = reader.shape(template.format(0))
        if got != want:
            raise ConfigError(
                f"{folder}: tensor {template.format(0)} has shape {list(got)}, config.json implies {list(want)}"
            )


def _leaf_reader(reader: TensorReader, key: str, shape: tuple[int, ...], dtype: Any) -> Callable[[Index], np.ndarray]:
    template, layout = HF_NAMES[key]
    stacked = key.startswith("layers.")

    def read(index: Index) -> np.ndarray:
        index = normalise(index, shape)
        if not stacked:
            part = reader.read(template, layout.hf_index(index, shape))
            return layout.to_meshlm(part, shape).astype(dtype)
        inner_shape, inner_index = shape[1:], index[1:]
        hf_index = layout.hf_index(inner_index, inner_shape)
        layers = range(*index[0].indices(shape[0]))
        return np.stack(
            [layout.to_meshlm(reader.read(template.format(i), hf_index), inner_shape).astype(dtype) for i in layers]
        )

    return read


def detect(path: str | Path) -> bool:
    """A Hugging Face model folder: it has a config.json (which `open` then checks)."""
    return (Path(path) / "config.json").is_file()


def open(folder: str | Path, dtype: str) -> tuple[ModelConfig, SliceSource]:
    """The folder's config and its tensors' slices in meshlm's layout and `dtype`, read lazily (the
    tensors' names and shapes are checked against the config first)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a directory")
    cfg = load_hf_config(folder)
    reader = open_reader(folder)
    _check_tensors(reader, cfg, model.abstract_params(cfg, dtype), folder)
    return cfg, lambda key, shape: _leaf_reader(reader, key, shape, np_dtype(dtype))


# ---------------------------------------------------------------------------------------------------
# Writing


def iter_hf_tensors(
    cfg: ModelConfig, read: Callable[[str, int | None], np.ndarray], dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in `dtype`) for every tensor in HF's order; `read(key, layer)` gives meshlm
    parameter `key` (its layer `layer` when stacked) on the host, and is called only as each is written."""
    target = np_dtype(dtype)

    def tensor(key: str, layer: int | None) -> tuple[str, np.ndarray]:
        template, layout = HF_NAMES[key]
        ours = np.asarray(read(key, layer)).astype(target, copy=False)
        return template.format(layer), layout.to_hf(ours)  # cast first: the transpose then moves fewer bytes

    yield tensor("embed.w", None)
    layer_keys = [k for k in HF_NAMES if k.startswith("layers.")]
    for i in range(cfg.n_layer):
        for key in layer_keys:
            yield tensor(key, i)
    for key in ("ln_f.scale", "ln_f.bias", "head.w", "head.b"):
        yield tensor(key, None)


def _write(
    folder: str | Path,
    cfg: ModelConfig,
    dtype: str,
    read: Callable[[str, int | None], np.ndarray],
    max_shard_bytes: int,
    is_writer: bool = True,
) -> None:
    from tqdm import tqdm

    total = len(hf_tensor_names(cfg))
    tensors = tqdm(iter_hf_tensors(cfg, read, dtype), total=total, desc="writing", unit="tensor", leave=False)
    write_folder(folder, tensors, cfg, dtype, max_shard_bytes, is_writer)


def save(
    folder: str | Path, params: model.Params, cfg: ModelConfig, dtype: str = "float32", max_shard_bytes: int = 2 << 30
) -> None:
    """Write a folder that `GPTJForCausalLM.from_pretrained` loads as is.

    Tensors are written in shards of at most `max_shard_bytes` as they are produced, so peak host
    memory is one shard, whatever the model size.
    """
    flat = {model.param_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    read = lambda key, layer: to_host(flat[key] if layer is None else flat[key][layer])
    _write(folder, cfg, dtype, read, max_shard_bytes, jax.process_index() == 0)


def write_from(
    folder: str | Path,
    cfg: ModelConfig,
    dtype: str,
    source: SliceSource,
    max_shard_bytes: int = 512 << 20,
) -> None:
    """Write a Hugging Face folder in `dtype` from a checkpoint's `source`, one tensor at a time (peak
    memory: one output file plus a few copies of the largest tensor, whatever the model size)."""
    shapes = model.param_shapes(cfg)

    def read(key: str, layer: int | None) -> np.ndarray:
        whole = tuple(slice(0, n) for n in shapes[key])
        if layer is None:
            return source(key, shapes[key])(whole)
        return source(key, shapes[key])((slice(layer, layer + 1), *whole[1:]))[0]

    _write(folder, cfg, dtype, read, max_shard_bytes)


def write_folder(
    folder: str | Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    cfg: ModelConfig,
    dtype: str,
    max_shard_bytes: int = 2 << 30,
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
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, dtype), indent=2))
