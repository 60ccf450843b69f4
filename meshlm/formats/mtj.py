"""The seed's checkpoints (mesh-transformer-jax v1): `step_N/shard_s/{0..15}.npz`, any shard count.

Each of the S model-parallel shards holds its slice of the state pytree `{"opt_state", "params",
"step"}` (slim checkpoints: `{"params", "step"}`), flattened in JAX's tree order (dict keys sorted,
so `layer_10` precedes `layer_2`), the leaf list cut into 16 contiguous chunks saved with
`np.savez` (keys `arr_0`, `arr_1`, ...). bf16 leaves are stored as numpy `V2`.

The seed's semantics, which a plain concatenation gets wrong: the embedding is the concatenation of
the shards' row slices PLUS the sum of every shard's bias (each shard adds its bias to every token);
fc_out's bias is likewise summed over shards; a LayerNorm is replicated (shard 0's copy is used), an
RMSNorm averages the shards' copies, and layernorm-desync keeps one per shard (see `DESYNC_FOLDS`).

The run JSON's `pe` and `norm` (GPT-J's rotary and layernorm without one) decide which parameters a
checkpoint holds: `fixed` adds `pos_embs` (column slices), `t5` one `rel_embedding` table (its rows
are heads), and each norm has its own Haiku module and parameters (`Variant`).

Nothing is read until needed: `np.savez` stores its members uncompressed, so each member of a local
file is memory-mapped where it lies in the zip, and every device reads only the rows and columns of
its own shard. Conversion to Hugging Face streams one tensor at a time.
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import jax
import ml_dtypes
import numpy as np

from meshlm import model
from meshlm.config import GPT2_VOCAB, CheckpointError, ConfigError, ModelConfig, dtype_of, is_url
from meshlm.formats import hf
from meshlm.formats.mtj_config import SEED_NORMS, SEED_POSITIONS, seed_model_fields, seed_variant
from meshlm.formats.slices import Index, OptimizerState, SliceReader, SliceSource, normalise, place
from meshlm.paths import read_json

CHUNKS = 16  # the seed splits every shard's leaf list into this many files
ROOT = "causal_transformer_shard/~/"
GPTJ_D_HEAD, GPTJ_ROTARY_DIM, GPTJ_CONTEXT = 256, 64, 2048  # GPT-J's own values: not recoverable from weights


# How the shards' pieces of one tensor combine into the whole; NORM: as the variant's norm does.
COLS, ROWS, SUM, MEAN, FIRST, NORM = "cols", "rows", "sum", "mean", "first", "norm"

# meshlm parameter -> (seed module, with {} for the layer and {norm} for the norm's module, Haiku
# parameter, combination, head layout)
SEED_NAMES: dict[str, tuple[str, str, str, str | None]] = {
    "embed.w": ("embedding_shard/~/linear", "w", ROWS, None),
    "pos_embed.w": ("embedding_shard", "pos_embs", COLS, None),
    "rel_bias.w": ("relative_position_embs", "rel_embedding", ROWS, None),
    "layers.ln.scale": ("layer_{}/~/{norm}", "scale", NORM, None),
    "layers.ln.bias": ("layer_{}/~/{norm}", "offset", NORM, None),
    "layers.attn.q": ("layer_{}/~/linear", "w", COLS, "out"),
    "layers.attn.k": ("layer_{}/~/linear_2", "w", COLS, "out"),
    "layers.attn.v": ("layer_{}/~/linear_1", "w", COLS, "out"),
    "layers.attn.out": ("layer_{}/~/linear_3", "w", ROWS, "in"),
    "layers.mlp.fc_in.w": ("layer_{}/~/linear_4", "w", COLS, None),
    "layers.mlp.fc_in.b": ("layer_{}/~/linear_4", "b", COLS, None),
    "layers.mlp.fc_out.w": ("layer_{}/~/linear_5", "w", ROWS, None),
    "layers.mlp.fc_out.b": ("layer_{}/~/linear_5", "b", SUM, None),
    "ln_f.scale": ("projection_shard/~/{norm}", "scale", NORM, None),
    "ln_f.bias": ("projection_shard/~/{norm}", "offset", NORM, None),
    "head.w": ("projection_shard/~/linear", "w", COLS, None),
    "head.b": ("projection_shard/~/linear", "b", COLS, None),
}
EMBED_BIAS = ("embedding_shard/~/linear", "b")


# layernorm-desync in several shards: shard s's heads, FF columns and vocabulary columns see shard s's
# own norm. meshlm keeps one norm (scale 1, offset 0) and folds each shard's scale into its columns'
# rows and its offset, through the weight, into their bias: (n*g + b) @ W = n @ (g*W) + b @ W.
# meshlm parameter -> the weight whose columns it is (a bias) or that it is
DESYNC_FOLDS = {
    "layers.attn.q": "layers.attn.q",
    "layers.attn.k": "layers.attn.k",
    "layers.attn.v": "layers.attn.v",
    "layers.attn.q_bias": "layers.attn.q",
    "layers.attn.k_bias": "layers.attn.k",
    "layers.attn.v_bias": "layers.attn.v",
    "layers.mlp.fc_in.w": "layers.mlp.fc_in.w",
    "layers.mlp.fc_in.b": "layers.mlp.fc_in.w",
    "head.w": "head.w",
    "head.b": "head.w",
}

# The seed's norm -> (Haiku module, how the shards' copies combine). ReplicatedLayerNorm uses shard 0's
# copy (all_gather(...)[0]) and stores its offset even where it is unused (layernorm-nobias); RMSNorm
# averages the copies (pmean); hk.LayerNorm (layernorm-desync) gives each shard its own: one shard's is
# the norm, several shards' are folded into their columns (`DESYNC_FOLDS`).
SEED_NORM_MODULES = {
    "layernorm": ("replicated_layer_norm", FIRST),
    "layernorm-nobias": ("replicated_layer_norm", FIRST),
    "layernorm-desync": ("layer_norm", FIRST),
    "rmsnorm": ("rms_norm", MEAN),
    "scalenorm": ("rms_norm", MEAN),
    "rmsnorm-bias": ("rms_norm", MEAN),
    "scalenorm-bias": ("rms_norm", MEAN),
}


@dataclass(frozen=True)
class Variant:
    """The seed run's `pe` and `norm`, as its JSON names them: they decide which parameters its
    checkpoints hold, and how meshlm computes the same."""

    pe: str = "rotary"
    norm: str = "layernorm"

    @property
    def norm_module(self) -> str:
        return SEED_NORM_MODULES[self.norm][0]

    @property
    def norm_combination(self) -> str:
        return SEED_NORM_MODULES[self.norm][1]

    @property
    def norm_params(self) -> tuple[str, ...]:
        stores_offset = self.norm.startswith("layernorm") or self.norm.endswith("-bias")
        return ("offset", "scale") if stores_offset else ("scale",)

    def norm_shape(self, d_model: int) -> tuple[int, ...]:
        return () if self.norm.startswith("scalenorm") else (d_model,)

    def folded(self, shards: int) -> bool:
        """Whether each shard's own norm is folded into its columns (see `DESYNC_FOLDS`)."""
        return self.norm == "layernorm-desync" and shards > 1

    def __str__(self) -> str:
        return f"pe {self.pe!r}, norm {self.norm!r}"


def _tables(cfg: ModelConfig, shards: int, variant: Variant) -> tuple[dict, dict]:
    """Per-shard shapes: of the top-level parameters, and of each layer's ("module/param")."""
    S, D, F, V = shards, cfg.d_model, cfg.d_ff, cfg.vocab_size
    norm = {f"{variant.norm_module}/{p}": variant.norm_shape(D) for p in variant.norm_params}
    top = {
        "embedding_shard/~/linear/b": (D,),
        "embedding_shard/~/linear/w": (V // S, D),
        "projection_shard/~/linear/b": (V // S,),
        "projection_shard/~/linear/w": (D, V // S),
        **{f"projection_shard/~/{name}": shape for name, shape in norm.items()},
    }
    if variant.pe == "fixed":
        top["embedding_shard/pos_embs"] = (cfg.max_seq_len, D // S)
    if variant.pe == "t5":
        top["relative_position_embs/rel_embedding"] = (cfg.n_head // S, model.T5_BUCKETS)
    per_layer = {
        "linear/w": (D, D // S),
        "linear_1/w": (D, D // S),
        "linear_2/w": (D, D // S),
        "linear_3/w": (D // S, D),
        "linear_4/b": (F // S,),
        "linear_4/w": (D, F // S),
        "linear_5/b": (D,),
        "linear_5/w": (F // S, D),
        **norm,
    }
    return top, per_layer


def shard_shapes(cfg: ModelConfig, shards: int, variant: Variant = Variant()) -> dict[str, tuple[int, ...]]:
    """Every parameter's per-shard shape, in the seed's flattening order (Haiku's dicts, keys sorted)."""
    top, per_layer = _tables(cfg, shards, variant)
    shapes = dict(top)
    for i in range(cfg.n_layer):
        shapes.update({f"layer_{i}/~/{name}": shape for name, shape in per_layer.items()})
    # JAX sorts each dict level: modules first, then their parameters
    return {ROOT + name: shapes[name] for name in sorted(shapes, key=lambda n: tuple(n.rsplit("/", 1)))}


def _unit_config(n_layer: int) -> ModelConfig:
    """Any config of `n_layer` layers: for names and counts, which do not depend on sizes."""
    return ModelConfig(n_layer=n_layer, d_model=1, n_head=1, d_ff=1, rotary_dim=0)


def param_names(n_layer: int, variant: Variant = Variant()) -> list[str]:
    return list(shard_shapes(_unit_config(n_layer), 1, variant))


def param_counts(variant: Variant) -> tuple[int, int]:
    """How many parameters each layer, and the rest of the model, hold."""
    top, per_layer = _tables(_unit_config(1), 1, variant)
    return len(per_layer), len(top)


# ---------------------------------------------------------------------------------------------------
# Files: local paths or fsspec URLs


class Files:
    """The few file operations the reader needs, on a local folder or an fsspec URL."""

    def __init__(self, root: str | Path, fs: Any = None):
        self.url = fs is not None or is_url(root)
        if fs is not None:
            self.fs, self.root = fs, str(root)
        elif self.url:
            try:
                import fsspec
            except ImportError:
                raise ConfigError(f"{root}: reading URLs needs fsspec installed (pip install fsspec)") from None
            self.fs, self.root = fsspec.core.url_to_fs(str(root))
            self.root = self.root.rstrip("/")
        else:
            self.fs, self.root = None, str(Path(root))

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if self.url else str(Path(self.root, *parts))

    def child(self, *parts: str) -> Files:
        return Files(self.join(*parts), self.fs)

    def is_dir(self, *parts: str) -> bool:
        return self.fs.isdir(self.join(*parts)) if self.url else Path(self.join(*parts)).is_dir()

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.join(*parts)) if self.url else Path(self.join(*parts)).exists()

    def listdir(self) -> list[str]:
        if self.url:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        return [p.name for p in Path(self.root).iterdir()]

    def read_text(self, *parts: str) -> str:
        with self.open(*parts) as f:
            return f.read().decode()

    def open(self, *parts: str) -> BinaryIO:
        return self.fs.open(self.join(*parts), "rb") if self.url else Path(self.join(*parts)).open("rb")

    def __str__(self) -> str:
        return self.root


# ---------------------------------------------------------------------------------------------------
# Members of the npz chunks, read lazily


@dataclass(frozen=True)
class Member:
    """One `arr_k.npy` inside one chunk file: its shape and dtype, read from headers only."""

    files: Files
    chunk: str  # file name relative to `files`
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    data_offset: int | None  # where the raw array starts in the chunk file (stored members of local files)

    def where(self) -> str:
        return f"{self.files.join(self.chunk)}:{self.name}"

    def array(self) -> np.ndarray:
        """The member as an array: memory-mapped when possible, else read whole."""
        order = "F" if self.fortran else "C"
        if self.data_offset is not None:
            if 0 in self.shape:  # nothing to map
                return np.zeros(self.shape, self.dtype)
            if not self.shape:  # a step or count: read its few bytes
                with self.files.open(self.chunk) as f:
                    f.seek(self.data_offset)
                    return np.frombuffer(f.read(self.dtype.itemsize), self.dtype).reshape(())
            return np.memmap(
                self.files.join(self.chunk), self.dtype, "r", offset=self.data_offset, shape=self.shape, order=order
            )
        with self.files.open(self.chunk) as f, zipfile.ZipFile(f) as z, z.open(self.name) as m:
            return np.lib.format.read_array(m).view(self.dtype)


def _npy_header(f: BinaryIO) -> tuple[tuple[int, ...], np.dtype, bool]:
    version = np.lib.format.read_magic(f)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        raise ValueError(f"npy format version {version} (np.savez writes 1.0 or 2.0)")
    shape, fortran, dtype = readers[version](f)
    if dtype == np.dtype("V2"):  # how the seed's bf16 arrays reach numpy
        dtype = np.dtype(ml_dtypes.bfloat16)
    return tuple(shape), dtype, fortran


def _arr_key(name: str) -> int:
    m = re.fullmatch(r"arr_(\d+)\.npy", name)
    return int(m.group(1)) if m else -1


def index_chunk(files: Files, chunk: str) -> list[Member]:
    """The members of one `k.npz`, in `arr_0, arr_1, ...` order, from the zip and npy headers alone."""
    where = files.join(chunk)
    try:
        with files.open(chunk) as f:
            size = f.seek(0, 2)
            with zipfile.ZipFile(f) as z:
                infos = sorted(z.infolist(), key=lambda i: _arr_key(i.filename))
                if [_arr_key(i.filename) for i in infos] != list(range(len(infos))):
                    raise CheckpointError(
                        f"{where}: not written by np.savez(f, *leaves) (members {z.namelist()[:4]}...)"
                    )
                members = []
                for info in infos:
                    with z.open(info) as m:
                        shape, dtype, fortran = _npy_header(m)
                        header_len = m.tell()
                    offset = None
                    if not files.url and info.compress_type == zipfile.ZIP_STORED:
                        f.seek(info.header_offset)
                        local = f.read(30)
                        name_len, extra_len = struct.unpack("<HH", local[26:30])
                        offset = info.header_offset + 30 + name_len + extra_len + header_len
                        if offset + int(np.prod(shape)) * dtype.itemsize > size:
                            raise CheckpointError(f"{where}: {info.filename} runs past the end of the file (truncated)")
                    members.append(Member(files, chunk, info.filename, shape, dtype, fortran, offset))
                return members
    except ConfigError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing (every shard needs 0.npz ... {CHUNKS - 1}.npz)") from None
    except (zipfile.BadZipFile, EOFError, ValueError, struct.error) as e:
        raise CheckpointError(f"{where}: not a complete npz file, perhaps truncated mid-write ({e})") from None


# ---------------------------------------------------------------------------------------------------
# The checkpoint


def is_seed_checkpoint(path: str | Path) -> bool:
    """A step_N folder (holds shard_0/) or a run folder whose meta.json names its checkpoints."""
    files = Files(path)
    if files.is_dir("shard_0"):
        return True
    return files.exists("meta.json") and any(re.fullmatch(r"step_\d+", n) for n in files.listdir())


def _resolve_step(files: Files) -> Files:
    """A run folder -> its latest step folder (from meta.json, as the seed itself chose it)."""
    if files.is_dir("shard_0"):
        return files
    if not files.exists("meta.json"):
        raise CheckpointError(f"{files}: not a seed checkpoint (no shard_0/ and no meta.json)")
    try:
        meta = json.loads(files.read_text("meta.json"))
        step = meta["checkpoints"][-1]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise CheckpointError(f"{files.join('meta.json')}: cannot find the latest checkpoint in it ({e!r})") from None
    step_files = files.child(f"step_{step}")
    if not step_files.is_dir("shard_0"):
        raise CheckpointError(f"{files.join('meta.json')}: names step {step}, but {step_files}/shard_0 is missing")
    return step_files


def read_seed_config(path: str | Path) -> dict[str, Any]:
    """The architecture values weights cannot tell (heads, rotary dims, context) from the seed's run JSON,
    and its `pe` and `norm` as the seed names them (checked; GPT-J's rotary and layernorm if absent)."""
    seed = read_json(path, f"{path}: seed config not found")
    if not isinstance(seed, dict):
        raise ConfigError(f"{path}: not a seed config (expected a JSON object)")
    for key in ("n_heads", "d_model"):
        if key not in seed:
            raise ConfigError(f"{path}: not a seed config (no {key!r} key)")
    fields = seed_model_fields(seed, seed["d_model"] // seed["n_heads"], where=str(path))
    out = {"n_head": seed["n_heads"], "rotary_dim": fields["rotary_dim"], "max_seq_len": seed.get("seq")}
    out["pe"], out["norm"] = seed_variant(seed, where=str(path))
    # what the weights do tell, to check that this JSON belongs to this checkpoint
    out.update(n_layer=seed.get("layers"), d_model=seed.get("d_model"), vocab_size=seed.get("n_vocab"))
    return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Layout:
    """Where the parameters, and for full checkpoints Adam's moments, sit in each shard's leaf list."""

    n_layer: int
    full: bool
    variant: Variant = Variant()

    @property
    def n_params(self) -> int:
        per_layer, fixed = param_counts(self.variant)
        return per_layer * self.n_layer + fixed

    @property
    def n_leaves(self) -> int:
        # full: opt_state = (adam count, mu..., nu..., schedule count), then params, then step
        return 3 * self.n_params + 3 if self.full else self.n_params + 1

    def start(self, tree: str) -> int:
        if tree == "params":
            return 2 * self.n_params + 2 if self.full else 0
        return {"mu": 1, "nu": 1 + self.n_params}[tree]

    @classmethod
    def from_count(cls, n: int, variant: Variant, where: str, hint: str = "") -> Layout:
        per_layer, fixed = param_counts(variant)
        if (n - 1 - fixed) % per_layer == 0 and n - 1 - fixed > 0:
            return cls((n - 1 - fixed) // per_layer, full=False, variant=variant)
        if n % 3 == 0 and (n // 3 - 1 - fixed) % per_layer == 0 and n // 3 - 1 - fixed > 0:
            return cls((n // 3 - 1 - fixed) // per_layer, full=True, variant=variant)
        raise CheckpointError(
            f"{where}: holds {n} arrays, which fits no checkpoint of the seed with {variant} "
            f"(slim: {per_layer}*layers+{fixed + 1}, full: 3*({per_layer}*layers+{fixed})+3){hint}"
        )


class SeedCheckpoint:
    """An indexed step_N folder: per shard, every leaf's location, shape and dtype."""

    def __init__(self, path: str | Path, seed_config: str | Path | None = None):
        files = _resolve_step(Files(path))
        self.files = files
        self._maps: dict[Member, np.ndarray] = {}
        self.shards = self._count_shards(files)
        self.leaves = [self._index_shard(files.child(f"shard_{s}")) for s in range(self.shards)]
        given = read_seed_config(seed_config) if seed_config else {}
        self.variant = Variant(given.pop("pe", "rotary"), given.pop("norm", "layernorm"))
        # without the run JSON a variant's checkpoint is read as GPT-J's, and fails on its counts or shapes
        self._hint = "" if seed_config else "; a pe/norm variant other than GPT-J's needs the seed's run JSON"
        self.layout = Layout.from_count(len(self.leaves[0]), self.variant, f"{files}/shard_0", self._hint)
        for s, leaves in enumerate(self.leaves[1:], 1):
            if len(leaves) != len(self.leaves[0]):
                raise CheckpointError(f"{files}/shard_{s}: holds {len(leaves)} arrays, shard_0 {len(self.leaves[0])}")
        self.names = param_names(self.layout.n_layer, self.variant)
        self._position = {name: i for i, name in enumerate(self.names)}
        self.config = self._infer_config(given)
        self._check_shapes()

    def __str__(self) -> str:
        return str(self.files)

    @staticmethod
    def _count_shards(files: Files) -> int:
        found = {int(m.group(1)) for n in files.listdir() if (m := re.fullmatch(r"shard_(\d+)", n))}
        count = max(found) + 1
        missing = sorted(set(range(count)) - found)
        if missing:
            raise CheckpointError(f"{files}: shard folder(s) {[f'shard_{i}' for i in missing]} missing")
        return count

    @staticmethod
    def _index_shard(files: Files) -> list[Member]:
        return [m for k in range(CHUNKS) for m in index_chunk(files, f"{k}.npz")]

    def member(self, tree: str, name: str, shard: int) -> Member:
        return self.leaves[shard][self.layout.start(tree) + self._position[name]]

    @property
    def folded(self) -> bool:
        """Whether each shard's own norm is folded into its columns (`DESYNC_FOLDS`)."""
        return self.variant.folded(self.shards)

    def seed_name(self, module: str, param: str, layer: int | None = None) -> str:
        """The full name of a `SEED_NAMES` module's parameter in this checkpoint's variant."""
        return ROOT + module.format(layer, norm=self.variant.norm_module) + "/" + param

    def _shape(self, module: str, param: str, layer: int | None = None) -> tuple[int, ...]:
        return self.member("params", self.seed_name(module, param, layer), 0).shape

    def _infer_config(self, given: dict[str, int]) -> ModelConfig:
        S = self.shards
        embed = self._shape("embedding_shard/~/linear", "w")
        fc_in = self._shape("layer_{}/~/linear_4", "w", 0)
        if len(embed) != 2 or len(fc_in) != 2:
            raise CheckpointError(f"{self}: embedding {list(embed)} / fc_in {list(fc_in)} are not matrices; not GPT-J")
        vocab, d_model, d_ff = embed[0] * S, embed[1], fc_in[1] * S
        q = self._shape("layer_{}/~/linear", "w", 0)
        if len(q) == 2 and q[1] and d_model % q[1] == 0 and d_model // q[1] != S:
            raise CheckpointError(
                f"{self}: {S} shard folder(s) found, but the q projection's width {q[1]} implies "
                f"{d_model // q[1]} shards: is a shard_ folder missing?"
            )
        found = {"n_layer": self.layout.n_layer, "d_model": d_model, "vocab_size": vocab}
        # the tables of learned and relative positions tell the context and the head count
        if self.variant.pe == "fixed" and len(table := self._shape("embedding_shard", "pos_embs")) == 2:
            found["max_seq_len"] = table[0]
        if self.variant.pe == "t5" and len(table := self._shape("relative_position_embs", "rel_embedding")) == 2:
            found["n_head"] = table[0] * S
        for key, value in found.items():
            if key in given and given[key] != value:
                raise CheckpointError(f"{self}: the seed config gives {key} {given[key]}, the checkpoint holds {value}")
        given = {**found, **given}
        if "n_head" in given:
            n_head = given["n_head"]
        elif d_model % GPTJ_D_HEAD == 0:
            n_head = d_model // GPTJ_D_HEAD
        else:
            raise CheckpointError(
                f"{self}: d_model {d_model} is not a multiple of GPT-J's head size {GPTJ_D_HEAD}; the number "
                "of heads is not stored in the weights: pass the seed's run JSON (--seed-config)"
            )
        try:
            return ModelConfig(
                n_layer=self.layout.n_layer,
                d_model=d_model,
                n_head=n_head,
                d_ff=d_ff,
                rotary_dim=given.get("rotary_dim", min(GPTJ_ROTARY_DIM, d_model // n_head)),
                vocab_size=vocab,
                n_vocab_used=min(vocab, GPT2_VOCAB),
                max_seq_len=given.get("max_seq_len", GPTJ_CONTEXT),
                position=SEED_POSITIONS[self.variant.pe],
                norm=SEED_NORMS[self.variant.norm],
                qkv_bias=self.folded,
            )
        except ConfigError as e:
            raise CheckpointError(f"{self}: the shapes fit no model of the seed with {self.variant} ({e})") from None

    def _check_shapes(self) -> None:
        c, S = self.config, self.shards
        if c.d_model % S or c.d_ff % S or c.n_head % S:
            raise CheckpointError(
                f"{self}: {S} shards do not divide d_model {c.d_model}, d_ff {c.d_ff}, heads {c.n_head}"
            )
        trees = ("params", "mu", "nu") if self.layout.full else ("params",)
        for name, want in shard_shapes(c, S, self.variant).items():
            for s in range(S):
                for tree in trees:
                    got = self.member(tree, name, s).shape
                    if got != want:
                        raise CheckpointError(
                            f"{self}/shard_{s}: {tree} {name.removeprefix(ROOT)} has shape {list(got)}, "
                            f"expected {list(want)} for d_model {c.d_model}, d_ff {c.d_ff}, vocab {c.vocab_size}, "
                            f"{self.variant} in {S} shards{self._hint}"
                        )

    def _array(self, member: Member) -> np.ndarray:
        """Members are kept until `release`: mapped (local files) or read whole (URLs)."""
        if member not in self._maps:
            self._maps[member] = member.array()
        return self._maps[member]

    def release(self) -> None:
        """Drop what was read so far: called after each read, so resident memory stays one slice."""
        self._maps.clear()

    def source(self, tree: str, dtype: str) -> SliceSource:
        """The parameters ("params") or Adam's moments ("mu", "nu") as slices in meshlm's layout: each
        read combines the shards' parts and releases them."""
        target = dtype_of(dtype)

        def reader(key: str, shape: tuple[int, ...]) -> SliceReader:
            read = _leaf_reader(self, key, shape, target, tree)

            def read_and_release(index: Index) -> np.ndarray:
                try:
                    return read(index)
                finally:
                    self.release()

            return read_and_release

        return reader

    def scalar(self, position: int) -> int:
        m = self.leaves[0][position]
        if m.shape:
            raise CheckpointError(f"{m.where()}: expected a scalar (step or count), got shape {list(m.shape)}")
        return int(np.asarray(m.array()))

    @property
    def step(self) -> int:
        return self.scalar(self.layout.n_leaves - 1)

    # -----------------------------------------------------------------------------------------------
    # Reading one (per-layer) tensor in meshlm's layout

    def read(
        self, key: str, layer: int | None, index: Index, shape: tuple[int, ...], tree: str = "params"
    ) -> np.ndarray:
        """The float32 slice `index` of meshlm parameter `key` (layer `layer`) whose full shape is `shape`.

        For Adam's moments (`tree` "mu"/"nu") a bias the seed keeps per shard and an RMSNorm's copies
        take shard 0's moment (every shard receives the same gradient for them) and the embedding bias
        has no counterpart.
        """
        if self.folded and key in DESYNC_FOLDS:
            out = self._read_folded(key, layer, index, shape)
        else:
            out = self._read_combined(key, layer, index, shape, tree)
        return out.reshape(tuple(s.stop - s.start for s in index))

    def _parts(self, tree: str, module: str, param: str, layer: int | None) -> list[np.ndarray]:
        """Every shard's array of one seed parameter."""
        name = self.seed_name(module, param, layer)
        return [self._array(self.member(tree, name, s)) for s in range(self.shards)]

    def _read_combined(
        self, key: str, layer: int | None, index: Index, shape: tuple[int, ...], tree: str
    ) -> np.ndarray:
        """The shards' parts of `key` combined by its `SEED_NAMES` rule, in the seed's 2-D layout."""
        module, param, how, heads = SEED_NAMES[key]
        if how == NORM:
            if self.folded:  # each shard's norm lives in its columns (`DESYNC_FOLDS`): one identity norm
                return np.full(tuple(s.stop - s.start for s in index), param == "scale", np.float32)
            how = self.variant.norm_combination
        parts = self._parts(tree, module, param, layer)
        seed_index = _seed_index(index, shape, heads)
        if how == FIRST or (how in (SUM, MEAN) and tree != "params"):
            out = np.asarray(parts[0][seed_index], np.float32)
        elif how in (SUM, MEAN):
            combine = np.sum if how == SUM else np.mean
            out = combine([np.asarray(p[seed_index], np.float32) for p in parts], axis=0, dtype=np.float32)
        else:
            axis = 0 if how == ROWS else len(seed_index) - 1
            out = _read_concat([p.shape[axis] for p in parts], axis, seed_index, lambda s, local: parts[s][local])
        if key == "embed.w" and tree == "params":
            biases = self._parts(tree, *EMBED_BIAS, None)
            out += np.sum([np.asarray(b[index[1]], np.float32) for b in biases], axis=0, dtype=np.float32)
        return out

    def _read_folded(self, key: str, layer: int | None, index: Index, shape: tuple[int, ...]) -> np.ndarray:
        """A weight, or the bias of its columns, with each shard's own norm folded in (`DESYNC_FOLDS`):
        shard s's columns of the weight scaled row-wise by its norm's scale; of the bias, its norm's
        offset times those columns added (to the stored bias, where the seed has one)."""
        weight = DESYNC_FOLDS[key]
        module, _, _, heads = SEED_NAMES[weight]
        norm = SEED_NAMES["layers.ln.scale" if key.startswith("layers.") else "ln_f.scale"][0]
        w = self._parts("params", module, "w", layer)
        scale, offset = (self._parts("params", norm, p, layer) for p in ("scale", "offset"))
        if key == weight:
            seed_index = _seed_index(index, shape, heads)

            def piece(s: int, local: Index) -> np.ndarray:
                return np.asarray(w[s][local], np.float32) * np.asarray(scale[s][local[0]], np.float32)[:, None]

        else:  # a bias is indexed like its weight's columns: the weight's index less the rows
            rows = w[0].shape[0]
            seed_index = _seed_index((slice(0, rows), *index), (rows, *shape), heads)[1:]
            stored = self._parts("params", *SEED_NAMES[key][:2], layer) if key in SEED_NAMES else None

            def piece(s: int, local: Index) -> np.ndarray:
                out = np.asarray(offset[s], np.float32) @ np.asarray(w[s][:, local[0]], np.float32)
                return out + np.asarray(stored[s][local], np.float32) if stored else out

        return _read_concat([p.shape[-1] for p in w], len(seed_index) - 1, seed_index, piece)


def _seed_index(index: Index, shape: tuple[int, ...], heads: str | None) -> Index:
    """meshlm [D, H, K] (heads "out") / [H, K, D] (heads "in") index -> the seed's 2-D [D, H*K] / [H*K, D]."""
    if heads == "out":
        d, h, k = index
        return d, hf.head_rows(h, k, shape[2])
    if heads == "in":
        h, k, d = index
        return hf.head_rows(h, k, shape[1]), d
    return index


def _read_concat(sizes: list[int], axis: int, index: Index, piece: Callable[[int, Index], np.ndarray]) -> np.ndarray:
    """`index` of the concatenation along `axis` of the shards' pieces (of `sizes` along it) in float32,
    asking `piece(s, local index)` only for the shards it overlaps."""
    want = index[axis]
    out = np.empty(tuple(s.stop - s.start for s in index), np.float32)
    offset = 0
    for s, n in enumerate(sizes):
        lo, hi = max(want.start, offset), min(want.stop, offset + n)
        if lo < hi:
            local, dest = list(index), [slice(None)] * len(index)
            local[axis], dest[axis] = slice(lo - offset, hi - offset), slice(lo - want.start, hi - want.start)
            out[tuple(dest)] = piece(s, tuple(local))
        offset += n
    return out


def _leaf_reader(
    ckpt: SeedCheckpoint, key: str, shape: tuple[int, ...], dtype: Any, tree: str
) -> Callable[[Index], np.ndarray]:
    stacked = key.startswith("layers.")

    def read(index: Index) -> np.ndarray:
        index = normalise(index, shape)
        if not stacked:
            return ckpt.read(key, None, index, shape, tree).astype(dtype)
        layers = range(*index[0].indices(shape[0]))
        out = np.empty((len(layers), *(s.stop - s.start for s in index[1:])), dtype)
        for j, i in enumerate(layers):  # filled layer by layer: one copy of the slice, not two
            out[j] = ckpt.read(key, i, index[1:], shape[1:], tree)
        return out

    return read


def load_optimizer_moments(
    step_dir: str | Path,
    mesh: jax.sharding.Mesh,
    dtype: str = "float32",
    seed_config: str | Path | None = None,
) -> OptimizerState:
    """Adam's mu and nu from a full seed checkpoint, placed on `mesh` like the parameters.

    The seed keeps a separate bias per shard for the embedding and fc_out; meshlm has one fc_out bias
    (its moments are shard 0's: all shards see the same gradient) and no embedding bias (dropped).
    RMSNorms' copies likewise take shard 0's moments.
    """
    ckpt = SeedCheckpoint(step_dir, seed_config)
    if not ckpt.layout.full:
        raise CheckpointError(f"{ckpt}: a slim checkpoint (parameters only); Adam's moments need the full checkpoint")
    if ckpt.folded:
        raise CheckpointError(
            f"{ckpt}: layernorm-desync in {ckpt.shards} shards loads with each shard's norm folded into its "
            "columns, where Adam's moments of those norms have no place; continue without resuming the optimizer"
        )
    return OptimizerState(
        mu=place(ckpt.config, ckpt.source("mu", dtype), mesh, dtype),
        nu=place(ckpt.config, ckpt.source("nu", dtype), mesh, dtype),
        count=ckpt.scalar(0),
        step=ckpt.step,
    )


def detect(path: str | Path) -> bool:
    """A step_N folder (holds shard_0/) or a run folder whose meta.json names its checkpoints."""
    return is_seed_checkpoint(path)


def open(path: str | Path, dtype: str, seed_config: str | Path | None = None) -> tuple[ModelConfig, SliceSource]:
    """The checkpoint's config and its parameters' slices in meshlm's layout and `dtype`.

    `seed_config` is the seed's run JSON; it supplies n_heads, pe, norm, pe_rotary_dims and seq, which
    the weights do not record (without it: GPT-J's rotary and layernorm, head size 256, rotary_dim 64
    and context 2048).
    """
    ckpt = SeedCheckpoint(path, seed_config)
    return ckpt.config, ckpt.source("params", dtype)
