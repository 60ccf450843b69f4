"""meshlm's own checkpoint format: orbax-checkpoint arrays plus a small JSON description.

A params-only checkpoint folder holds `meshlm.json` (format version, model config, dtype) and
`params/` (an orbax PyTree checkpoint). `meshlm.json` is written last, so a folder without it is never
taken for a complete checkpoint.

`write_params` writes the same `params/` folder without orbax holding whole arrays: each parameter
becomes a zarr array (orbax's non-OCDBT layout, which orbax restores like its own) written slice by
slice, so converting a model never needs it all in memory.

A training run keeps its checkpoints in `<out_dir>/checkpoints/<step>/`, written by an orbax
CheckpointManager: `params/` (same layout as above), `opt_state/`, and `meshlm/metadata` (the same
description plus step, loader position and train config). Orbax writes each step in a temporary
folder and renames it when every item is complete, so a crash mid-save leaves nothing that restores.
`meshlm.load` reads either kind, and a run folder (its latest step). Restoring reads straight into
any mesh and dtype. A LoRA run's `params/` holds its adapter alone; its description says so (`lora`,
the adapter's settings) and records what the frozen base was built from (`base`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from meshlm import model
from meshlm.config import (
    RUN_CHECKPOINTS,
    CheckpointError,
    ModelConfig,
    as_path,
    dtype_of,
    has_path,
    is_url,
    local_folder,
    read_json,
)
from meshlm.formats.slices import SliceSource
from meshlm.sharding import plan, with_shardings
from meshlm.tokenizer import copy_files

FORMAT_VERSION = 1
MARKER = "meshlm.json"


TRAIN_DESCRIPTION = Path("meshlm") / "metadata"  # the description item inside a training step folder


def _absolute(path: str | Path) -> Path:
    """A local folder made absolute (orbax wants that), or a URL (gs://...) as orbax's path type."""
    return as_path(path) if is_url(path) else Path(path).absolute()


def _marker(path: Path) -> Path:
    return path / MARKER if (path / MARKER).is_file() else path / TRAIN_DESCRIPTION


def detect(path: str | Path) -> bool:
    """Whether `path` (or the run folder's latest step) is a meshlm checkpoint."""
    return _marker(as_path(resolve(path))).is_file()


def resolve(path: str | Path) -> str | Path:
    """A run folder or its `checkpoints/` folder stands for its latest complete step; anything else
    (a checkpoint folder, a file, a URL orbax cannot write to) is returned as given."""
    if not has_path(path) or not as_path(path).is_dir():
        return path
    path = as_path(path)
    folder = path / RUN_CHECKPOINTS if (path / RUN_CHECKPOINTS).is_dir() else path
    steps = [p for p in folder.glob("*") if p.name.isdigit() and (p / TRAIN_DESCRIPTION).is_file()]
    if not (path / MARKER).is_file() and not (path / TRAIN_DESCRIPTION).is_file() and steps:
        return max(steps, key=lambda p: int(p.name))
    return path


def read_description(path: str | Path) -> dict[str, Any]:
    marker = _marker(as_path(path))
    desc = read_json(marker, f"{path}: not a meshlm checkpoint (no {MARKER}; an interrupted save leaves none)")
    if desc.get("format") != "meshlm" or desc.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{marker}: unsupported checkpoint format {desc.get('format')!r} "
            f"version {desc.get('version')!r} (this meshlm reads version {FORMAT_VERSION})"
        )
    return desc


def model_description(path: str | Path) -> dict[str, Any]:
    """The description of a checkpoint that holds a whole model: a LoRA run's holds an adapter alone."""
    desc = read_description(path)
    if "lora" in desc:
        raise CheckpointError(
            f"{path}: a LoRA run's checkpoint holds an adapter, not a model; load the run (its base with the "
            "adapter) or merge the adapter into its base (`meshlm merge`)"
        )
    return desc


def check_new_folder(path: str | Path) -> None:
    """Refuse to write into a folder that holds anything: nothing saved there is ever overwritten."""
    path = as_path(path)
    if path.exists() and any(path.iterdir()):
        raise CheckpointError(f"{path}: already exists and is not empty; choose a new folder")


def start_folder(path: str | Path, files: dict[str, Path], every_process: bool = True) -> None:
    """Begin a checkpoint folder: refuse one that holds anything, then copy `files` (name -> source: the
    model's tokenizer, see `tokenizer.tokenizer_files`) in on process 0. Weights follow and the marker
    that makes the folder complete (meshlm.json; config.json for a Hugging Face folder) comes last.
    With `every_process`, each process of a multi-process job calls this and all look before any writes."""
    check_new_folder(path)
    if every_process and jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"meshlm save {path}")
    if jax.process_index() == 0 or not every_process:
        copy_files(files, path)


def _write_marker(path: Path, desc: dict[str, Any]) -> None:
    """The marker goes last, atomically: until it exists the folder is not taken for a checkpoint."""
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(desc, indent=2))
    tmp.replace(path / MARKER)


def save_params(
    path: str | Path,
    params: model.Params,
    cfg: ModelConfig,
    files: dict[str, Path] | None = None,
) -> None:
    """Save parameters (any sharding, any number of processes) as a meshlm checkpoint, with `files`."""
    path = _absolute(path)
    start_folder(path, files or {})
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", params)
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        _write_marker(path, description(cfg, params))


ZARR_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "bfloat16"}
SLICE_BYTES = 128 << 20  # a zarr chunk, and what is read and written at once: one 6B layer's fc_in in bf16


def write_params(
    path: str | Path,
    cfg: ModelConfig,
    dtype: str,
    source: SliceSource,
    progress: bool = True,
    files: dict[str, Path] | None = None,
) -> None:
    """Write a meshlm checkpoint in `dtype` from `source` (whose slices come in `dtype`), one slice of
    at most `SLICE_BYTES` at a time: peak memory stays a few slices, whatever the model size. `files`
    (the model's tokenizer) are copied in first.

    Runs on one process; the result restores on any mesh like any other meshlm checkpoint.
    """
    from tqdm import tqdm

    path = local_folder(path, "checkpoint folder").absolute()  # tensorstore's file driver writes the arrays
    start_folder(path, files or {}, every_process=False)
    (path / "params").mkdir(parents=True, exist_ok=True)
    itemsize = np.dtype(dtype_of(dtype)).itemsize
    plans = []  # (name, shape, chunk, slices): a chunk is what is read and written at once
    for name, shape in model.param_shapes(cfg).items():
        if not shape:  # a scalar (scalenorm's scale): one chunk of one number
            plans.append((name, shape, shape, [()]))
            continue
        rows = max(1, min(shape[0], SLICE_BYTES // max(math.prod(shape[1:]) * itemsize, 1)))
        rest = tuple(slice(0, n) for n in shape[1:])
        slices = [(slice(i, min(i + rows, shape[0])), *rest) for i in range(0, shape[0], rows)]
        plans.append((name, shape, (rows, *shape[1:]), slices))
    total = sum(len(slices) for *_, slices in plans)
    tree_metadata = {}
    with tqdm(total=total, desc="writing", unit="slice", leave=False, disable=not progress) as bar:
        for name, shape, chunk, slices in plans:
            array = ts.open(
                {
                    "driver": "zarr",
                    "kvstore": {"driver": "file", "path": str(path / "params" / name)},
                    "metadata": {
                        "shape": list(shape),
                        "chunks": list(chunk),
                        "dtype": ZARR_DTYPES[dtype],
                        "compressor": {"id": "zstd", "level": 1},
                    },
                },
                create=True,
            ).result()
            read = source(name, shape)
            for index in slices:
                array[index].write(read(index)).result()
                bar.update()
            keys = tuple(name.split("."))
            tree_metadata[str(keys)] = {
                "key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2: a dict key
                "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(chunk)},
            }
    orbax_metadata = {
        "tree_metadata": tree_metadata,
        "use_ocdbt": False,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    (path / "params" / "_METADATA").write_text(json.dumps(orbax_metadata))
    _write_marker(path, _description(cfg, dtype))


def open(path: str | Path, dtype: str) -> tuple[ModelConfig, SliceSource]:
    """A checkpoint's config and its parameters' slices in `dtype`, read straight from the files
    (tensorstore, as orbax lays them out: OCDBT or one zarr array per parameter), so converting never
    loads the model."""
    path = local_folder(resolve(path), "checkpoint to convert").absolute()  # tensorstore's file driver reads it
    cfg = ModelConfig.from_dict(model_description(path)["model"])
    folder = path / "params"
    try:
        layout = json.loads((folder / "_METADATA").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{folder}: no readable orbax metadata ({e})") from None
    driver = "zarr3" if layout.get("use_zarr3") else "zarr"

    def open_array(name: str, shape: tuple[int, ...]) -> ts.TensorStore:
        if layout.get("use_ocdbt"):
            kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": f"{folder}/"}, "path": name}
        else:
            kvstore = {"driver": "file", "path": str(folder / name)}
        try:
            array = ts.open({"driver": driver, "kvstore": kvstore}, open=True, read=True).result()
        except Exception as e:  # tensorstore names the missing or damaged file, then appends its whole spec
            reason = str(e).split(" [tensorstore_spec=")[0]
            raise CheckpointError(f"{folder}: parameter {name} could not be opened ({reason})") from None
        if tuple(array.shape) != shape:
            raise CheckpointError(
                f"{folder}: parameter {name} has shape {list(array.shape)}, meshlm.json implies {list(shape)}"
            )
        return array

    arrays = {name: open_array(name, shape) for name, shape in model.param_shapes(cfg).items()}
    target = np.dtype(dtype_of(dtype))
    return cfg, lambda name, shape: lambda index: arrays[name][index].read().result().astype(target, copy=False)


def restore_params(
    path: str | Path, mesh: jax.sharding.Mesh, dtype: str = "float32"
) -> tuple[ModelConfig, model.Params]:
    """Restore a checkpoint's parameters onto `mesh` in `dtype`, whatever mesh saved them."""
    path = _absolute(resolve(path))
    cfg = ModelConfig.from_dict(model_description(path)["model"])
    abstract = model.abstract_params(cfg, dtype)
    target = with_shardings(abstract, plan(abstract, model.logical_axes(cfg), mesh))
    try:
        params = ocp.StandardCheckpointer().restore(path / "params", target)
    except Exception as e:  # orbax reports damage from deep inside tensorstore
        raise CheckpointError(f"{path}: parameters could not be restored ({type(e).__name__}: {e})") from None
    return cfg, params


def description(cfg: ModelConfig, params: model.Params, **extra: Any) -> dict[str, Any]:
    return _description(cfg, str(jax.tree.leaves(params)[0].dtype), **extra)


def _description(cfg: ModelConfig, dtype: str, **extra: Any) -> dict[str, Any]:
    return {"format": "meshlm", "version": FORMAT_VERSION, "model": cfg.to_dict(), "dtype": dtype, **extra}


class TrainCheckpoints:
    """The checkpoints of one training run: async saves, keep the last N plus every `keep_every`-th step."""

    def __init__(self, folder: str | Path, keep_last: int = 2, keep_every: int = 0):
        self.folder = _absolute(folder)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last,
            keep_period=keep_every or None,
            cleanup_tmp_directories=True,  # leftovers of a save that a crash interrupted
            enable_async_checkpointing=True,
        )
        self._manager = ocp.CheckpointManager(self.folder, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, params: model.Params, opt_state: Any, desc: dict[str, Any]) -> None:
        """Start saving in the background; the arrays are copied off the devices before this returns."""
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meshlm=ocp.args.JsonSave(desc),
        )
        self._manager.save(step, args=args, force=True)

    def restore(self, step: int, params_target: Any, opt_target: Any) -> tuple[model.Params, Any, dict[str, Any]]:
        """Params and optimizer state laid out as the targets (ShapeDtypeStructs with shardings) say."""
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(params_target),
            opt_state=ocp.args.StandardRestore(opt_target),
            meshlm=ocp.args.JsonRestore(),
        )
        try:
            out = self._manager.restore(step, args=args)
        except Exception as e:  # orbax reports damage from deep inside tensorstore
            raise CheckpointError(
                f"{self.folder / str(step)}: checkpoint could not be restored ({type(e).__name__}: {e})"
            ) from None
        opt_state = jax.tree.unflatten(jax.tree.structure(opt_target), jax.tree.leaves(out.opt_state))
        return out.params, opt_state, out.meshlm

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
