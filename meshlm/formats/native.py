"""meshlm's own checkpoint format: orbax-checkpoint arrays plus a small JSON description.

A params-only checkpoint folder holds `meshlm.json` (format version, model config, dtype) and
`params/` (an orbax PyTree checkpoint). `meshlm.json` is written last, so a folder without it is never
taken for a complete checkpoint.

`write` saves a loaded model's parameters with orbax, from the devices. Given any other slice source
it writes the same `params/` folder without orbax holding whole arrays: each parameter becomes a zarr
array (orbax's non-OCDBT layout, which orbax restores like its own) written slice by slice, so
converting a model never needs it all in memory.

A training run keeps its checkpoints in `<out_dir>/checkpoints/<step>/`, written by an orbax
CheckpointManager: `params/` (same layout as above), `opt_state/`, and `meshlm/metadata` (the same
description plus step, loader position and train config). Orbax writes each step in a temporary
folder and renames it when every item is complete, so a crash mid-save leaves nothing that restores.
`meshlm.load` reads either kind, and a run folder (its latest step). Restoring reads straight into
any mesh and dtype. A LoRA run's `params/` holds its adapter alone; its description says so (`lora`,
the adapter's settings) and records what the frozen base was built from (`base`).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
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
    TrainingStopped,
    dtype_of,
    is_url,
)
from meshlm.formats.slices import Index, Placed, SliceReader, SliceSource
from meshlm.paths import as_path, has_path, local_folder, read_json
from meshlm.tokenizer import TOKENIZER_FILES, copy_files

FORMAT_VERSION = 1
MARKER = "meshlm.json"


TRAIN_DESCRIPTION = Path("meshlm") / "metadata"  # the description item inside a training step folder


def _absolute(path: str | Path) -> Path:
    """A local folder made absolute without `..` (orbax wants it absolute, tensorstore's file driver refuses
    `..`), or a URL (gs://...) as orbax's path type."""
    return as_path(path) if is_url(path) else Path(path).resolve()


def _marker(path: Path) -> Path:
    return path / MARKER if (path / MARKER).is_file() else path / TRAIN_DESCRIPTION


def detect(path: str | Path) -> bool:
    """Whether `path` (or the run folder's latest step) is a meshlm checkpoint."""
    return _marker(as_path(resolve(path))).is_file()


def resolve(path: str | Path) -> str | Path:
    """A run folder or its `checkpoints/` folder stands for its latest step; anything else (a checkpoint
    folder, a file, a URL orbax cannot write to) is returned as given. Orbax names a step folder by its
    number only once the step is complete, so a newest step without its description is damaged: refused,
    rather than quietly standing in an older step for it."""
    if not has_path(path) or not as_path(path).is_dir():
        return path
    path = as_path(path)
    folder = path / RUN_CHECKPOINTS if (path / RUN_CHECKPOINTS).is_dir() else path
    steps = sorted((p for p in folder.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    if (path / MARKER).is_file() or (path / TRAIN_DESCRIPTION).is_file() or not steps:
        return path
    if not (steps[-1] / TRAIN_DESCRIPTION).is_file():
        complete = [p.name for p in steps if (p / TRAIN_DESCRIPTION).is_file()]
        older = f"; remove it to use step {complete[-1]}, or load that step's folder" if complete else ""
        raise CheckpointError(
            f"{steps[-1]}: the run's newest checkpoint has no {TRAIN_DESCRIPTION} (damaged, or not meshlm's){older}"
        )
    return steps[-1]


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


# The files that mark a folder meshlm wrote as complete (a meshlm checkpoint, a Hugging Face folder, a PEFT
# adapter), and everything its writers put beside them, temporary files included: `overwrite` replaces a
# folder that holds nothing else, and never touches anything a person or another program put there.
MARKERS = (MARKER, "config.json", "adapter_config.json")
OUTPUT_FILES = (
    *MARKERS,
    "params",
    "*.orbax-checkpoint-tmp*",
    "model*.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    *TOKENIZER_FILES,
    "*.tmp*",  # meshlm's shard-00000.tmp, tokenizer.json.tmp123, safetensors' hidden .tmpXXXXXX
)


def check_new_folder(path: str | Path, overwrite: bool = False) -> None:
    """Refuse to write into a folder that holds anything, unless `overwrite` and it holds meshlm's own output
    (finished or not) alone: nothing else saved there is ever overwritten."""
    path = as_path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"{path}: exists and is not a folder")
    names = sorted(p.name for p in path.iterdir())
    foreign = [n for n in names if not any(fnmatch.fnmatchcase(n, pattern) for pattern in OUTPUT_FILES)]
    if foreign:
        raise CheckpointError(
            f"{path}: already exists and is not empty (it holds {foreign[0]}, which meshlm does not write); "
            "choose a new folder"
        )
    if not names or overwrite:
        return
    if any(n in MARKERS for n in names):
        raise CheckpointError(
            f"{path}: already holds a checkpoint; choose a new folder or pass --overwrite to replace it"
        )
    raise CheckpointError(
        f"{path}: an unfinished save or conversion (no {MARKER} / config.json); remove it or pass --overwrite"
    )


@contextlib.contextmanager
def staged(dst: str | Path, command: str, overwrite: bool = False, size: int | None = None) -> Iterator[Path]:
    """A folder to write `dst` in: `DST.COMMAND-unfinished` beside it, renamed to `dst` once the writing is
    done, so `dst` never holds half a checkpoint. A failed write removes it; a killed one leaves it, and the
    next write of `dst` refuses to start (that one may still be running) unless `overwrite`. With
    `overwrite`, a `dst` holding meshlm's output is replaced, once the new one is whole. `size`, the bytes
    about to be written, goes in the message when the disk fills."""
    dst = local_folder(dst, "destination folder").resolve()
    staging = dst.with_name(f"{dst.name}.{command}-unfinished")
    check_new_folder(dst, overwrite)
    if dst.is_mount():  # the staging folder beside it would be written on another disk
        raise CheckpointError(f"{dst}: a mount point; write into a new folder inside it")
    if staging.exists():
        if not overwrite:
            raise CheckpointError(
                f"{staging}: left by a `meshlm {command}` to {dst} that did not finish (killed, or still running); "
                "remove it or pass --overwrite"
            )
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    free = shutil.disk_usage(staging).free
    try:
        yield staging
        _publish(staging, dst)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        reason = _no_space(e)
        if reason is None:
            raise
        needs = "" if size is None else f"it needs about {size:,} bytes, "
        raise CheckpointError(f"{dst}: {reason} ({needs}{free:,} bytes were free)") from None


def _publish(staging: Path, dst: Path) -> None:
    """Put the finished `staging` folder in `dst`'s place. A `dst` still there is empty or (overwrite) meshlm's
    output: its marker goes first, so if this is cut short no folder looks complete that is not."""
    if dst.exists():
        check_new_folder(dst, overwrite=True)  # nothing else was put there while the checkpoint was written
        for marker in MARKERS:
            (dst / marker).unlink(missing_ok=True)
        shutil.rmtree(dst)
    staging.rename(dst)


def _no_space(error: BaseException) -> str | None:
    """The OS's words when a write failed for want of space: an OSError's, or inside the message of the
    writer that met it (tensorstore's, safetensors')."""
    for code in (errno.ENOSPC, errno.EDQUOT):
        words = os.strerror(code)
        if getattr(error, "errno", None) == code or words in str(error):
            return words
    return None


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


def write(
    path: str | Path,
    cfg: ModelConfig,
    dtype: str,
    source: SliceSource,
    files: dict[str, Path] | None = None,
) -> None:
    """Write a meshlm checkpoint of `cfg` in `dtype` from `source`, `files` (the model's tokenizer) first and
    meshlm.json last. A `Placed` source (a loaded model's parameters, any sharding, any number of
    processes: every process calls) is saved by orbax from the devices, to a folder or a URL. Any other
    source is read on this one process a slice of at most `SLICE_BYTES` at a time (its slices come in
    `dtype`), so peak memory stays a few slices whatever the model size; it restores on any mesh all the same.
    """
    dtype_of(dtype)  # an unknown dtype is refused before anything is written
    if isinstance(source, Placed):
        _save_placed(_absolute(path), cfg, dtype, source.params, files or {})
    else:  # tensorstore's file driver writes the arrays
        _write_slices(_absolute(local_folder(path, "checkpoint folder")), cfg, dtype, source, files or {})


def _save_placed(path: Path, cfg: ModelConfig, dtype: str, params: model.Params, files: dict[str, Path]) -> None:
    start_folder(path, files)
    target = dtype_of(dtype)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", jax.tree.map(lambda x: x.astype(target), params))
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        _write_marker(path, _description(cfg, dtype))


ZARR_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "bfloat16"}
SLICE_BYTES = 128 << 20  # a zarr chunk, and what is read and written at once: one 6B layer's fc_in in bf16


def _write_slices(path: Path, cfg: ModelConfig, dtype: str, source: SliceSource, files: dict[str, Path]) -> None:
    from tqdm import tqdm

    start_folder(path, files, every_process=False)
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
    with tqdm(total=total, desc="writing", unit="slice", leave=False) as bar:
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
    path = _absolute(local_folder(resolve(path), "checkpoint to convert"))  # tensorstore's file driver reads it
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
        # a missing chunk is an error, not zeros (orbax, and _write_slices, store every chunk)
        spec = {"driver": driver, "kvstore": kvstore, "fill_missing_data_reads": False}
        try:
            array = ts.open(spec, open=True, read=True).result()
        except Exception as e:
            raise CheckpointError(f"{folder}: parameter {name} could not be opened ({_first_line(e)})") from None
        if tuple(array.shape) != shape:
            raise CheckpointError(
                f"{folder}: parameter {name} has shape {list(array.shape)}, meshlm.json implies {list(shape)}"
            )
        return array

    arrays = {name: open_array(name, shape) for name, shape in model.param_shapes(cfg).items()}
    target = np.dtype(dtype_of(dtype))

    def source(name: str, shape: tuple[int, ...]) -> SliceReader:
        def read(index: Index) -> np.ndarray:
            try:
                return arrays[name][index].read().result().astype(target, copy=False)
            except ValueError as e:  # tensorstore's: a chunk missing, cut short or not what it should be
                raise _unreadable(folder, e) from None

        return read

    return cfg, source


# tensorstore's words for a chunk it could not read: a key of an OCDBT database, or a zarr chunk's file
_CHUNK = re.compile(
    r'Error reading "(?P<key>[^"]+)" in OCDBT database at local file "(?P<db>[^"]+)"|local file "(?P<file>[^"]+)"'
)


def _first_line(error: BaseException) -> str:
    """An error's message without the spec tensorstore appends to it (tens of lines)."""
    return str(error).split(" [tensorstore_spec=")[0].splitlines()[0]


def _unreadable(folder: Path, error: BaseException) -> CheckpointError:
    """One line for parameters that could not be read, naming the parameter and its chunk when some error in
    `error`'s chain names one (orbax wraps tensorstore's error in one that prints the store's whole spec)."""
    cause: BaseException | None = error
    while cause is not None:
        if found := _CHUNK.search(str(cause)):
            if found["key"]:
                name, where = found["key"].split("/")[0], f"{found['key']} in the OCDBT database {found['db']}"
            else:
                name, where = Path(found["file"]).parent.name, found["file"]
            return CheckpointError(f"parameter {name}: chunk missing or corrupt ({where})")
        cause = cause.__cause__ or cause.__context__
    return CheckpointError(f"{folder}: parameters could not be read ({type(error).__name__}: {_first_line(error)})")


def restore_params(
    path: str | Path, mesh: jax.sharding.Mesh, dtype: str = "float32"
) -> tuple[ModelConfig, model.Params]:
    """Restore a checkpoint's parameters onto `mesh` in `dtype`, whatever mesh saved them."""
    path = _absolute(resolve(path))
    cfg = ModelConfig.from_dict(model_description(path)["model"])
    return cfg, restore_tree(path / "params", model.placed_params(cfg, mesh, dtype))


def restore_tree(folder: str | Path, target: Any = None) -> Any:
    """A PyTree orbax saved in `folder` (a checkpoint's `params/`), laid out as `target` says (None: as
    saved, on the host). A damaged chunk raises one line naming it, and nothing else is printed."""
    folder = _absolute(folder)
    _AbandonedWork.install()
    try:
        return ocp.StandardCheckpointer().restore(folder, target)
    except Exception as e:
        raise _unreadable(folder, e) from None


class _AbandonedWork:
    """sys.unraisablehook from the first restore or training save on. When one read or write fails, orbax
    closes its event loop and leaves the others running: each reports, with a traceback on stderr, as it
    meets the closed loop (even before the failure reaches meshlm) or is finalised (even at exit), after
    the one error that matters. Those reports are dropped; any other is passed on."""

    def __init__(self, hook: Callable[[Any], object]):
        self.hook = hook

    @classmethod
    def install(cls) -> None:
        if not isinstance(sys.unraisablehook, cls):
            sys.unraisablehook = cls(sys.unraisablehook)

    def __call__(self, report: Any) -> None:
        read = getattr(report.object, "__qualname__", None) == "_read_array_index_and_device_put"
        closed_loop = report.object is None and str(report.exc_value) == "Event loop is closed"
        if not (read or closed_loop):
            self.hook(report)


def description(cfg: ModelConfig, params: model.Params, **extra: Any) -> dict[str, Any]:
    return _description(cfg, str(jax.tree.leaves(params)[0].dtype), **extra)


def _description(cfg: ModelConfig, dtype: str, **extra: Any) -> dict[str, Any]:
    return {"format": "meshlm", "version": FORMAT_VERSION, "model": cfg.to_dict(), "dtype": dtype, **extra}


class _HideOrbaxErrors(logging.Filter):
    """Orbax logs a failed background save from each of its threads, and asyncio each of its writes that
    failed, with a traceback each; meshlm reports the failure itself, in one line (`TrainCheckpoints.check`)."""

    LOGGERS = ("absl", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or not _from_orbax(record)

    def attach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        _AbandonedWork.install()

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


def _from_orbax(record: logging.LogRecord) -> bool:
    if "orbax" in record.pathname:
        return True
    error = record.exc_info[1] if record.exc_info else None
    tb = error.__traceback__ if error is not None else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class TrainCheckpoints:
    """The checkpoints of one training run: async saves, keep the last N plus every `keep_every`-th step.

    A save that cannot be written (a full disk) stops the run at that save: refused up front when the
    folder's free space is short of the checkpoint's size, else raised by the next `check` once the
    background write fails. The previous checkpoints stay intact either way (orbax renames a step's
    folder into place only when it is complete)."""

    def __init__(self, folder: str | Path, keep_last: int = 2, keep_every: int = 0):
        self.folder = _absolute(folder)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last,
            keep_period=keep_every or None,
            cleanup_tmp_directories=True,  # leftovers of a save that a crash interrupted
            enable_async_checkpointing=True,
        )
        self._manager = ocp.CheckpointManager(self.folder, options=options)
        # Orbax removes a crashed save's leftovers on a thread of its own, which close() does not wait for: one
        # still running when a refused run exits printed a traceback. It is a listing of one folder: wait here.
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
        self._saving: tuple[int, int] | None = None  # (step, bytes) of the save in flight
        self._failed = False
        self._hide = _HideOrbaxErrors()
        self._hide.attach()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, params: model.Params, opt_state: Any, desc: dict[str, Any]) -> None:
        """Start saving in the background; the arrays are copied off the devices before this returns."""
        self.wait()  # orbax waits for the previous save anyway: its failure is reported as such, and the
        # free space is measured once it (and the deletion of the steps it made old) is done
        size = sum(leaf.nbytes for leaf in jax.tree.leaves((params, opt_state)))
        free = _free_bytes(self.folder)
        if free is not None and free < size:
            raise TrainingStopped(self._no_space_message(step, size, free))
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meshlm=ocp.args.JsonSave(desc),
        )
        self._saving = (step, size)
        self._manager.save(step, args=args, force=True)

    def check(self) -> None:
        """Raise TrainingStopped, in one line, once a background save has failed; cheap while it runs."""
        if self._saving is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def _failure(self, error: Exception) -> TrainingStopped:
        self._failed = True
        step, size = self._saving or (None, 0)
        if not is_url(self.folder):  # the half-written step: its space is wanted (orbax would drop it on resume)
            for partial in Path(self.folder).glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        if _no_space(error):
            return TrainingStopped(self._no_space_message(step, size, _free_bytes(self.folder)))
        return TrainingStopped(
            f"{self.folder / str(step)}: the checkpoint of step {step} could not be written ({type(error).__name__}: "
            f"{_first_line(error)}); the run stopped there, and the previous checkpoint is intact"
        )

    def _no_space_message(self, step: int | None, size: int, free: int | None) -> str:
        left = "" if free is None else f", {free:,} bytes free"
        return (
            f"{self.folder}: no space left for the checkpoint of step {step} (it needs about {size:,} bytes{left}); "
            "the run stopped there, and the previous checkpoint is intact: free space and rerun to resume"
        )

    def restore(self, step: int, params_target: Any, opt_target: Any) -> tuple[model.Params, Any, dict[str, Any]]:
        """Params and optimizer state laid out as the targets (ShapeDtypeStructs with shardings) say."""
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(params_target),
            opt_state=ocp.args.StandardRestore(opt_target),
            meshlm=ocp.args.JsonRestore(),
        )
        _AbandonedWork.install()
        try:
            out = self._manager.restore(step, args=args)
        except Exception as e:  # orbax reports damage from deep inside tensorstore
            raise _unreadable(self.folder / str(step), e) from None
        opt_state = jax.tree.unflatten(jax.tree.structure(opt_target), jax.tree.leaves(out.opt_state))
        return out.params, opt_state, out.meshlm

    def wait(self) -> None:
        """Until every save is written; a failed one raises TrainingStopped."""
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            raise self._failure(e) from None
        self._saving = None

    def close(self) -> None:
        """Stop the background threads; a failure already reported is not raised again."""
        try:
            self._manager.close()
        except Exception as e:
            if not self._failed:
                raise self._failure(e) from None
        finally:
            if not self._failed:  # else the failed writes are still to be logged when asyncio collects them
                self._hide.detach()


def _free_bytes(folder: Path) -> int | None:
    """Free bytes where `folder` lives (its nearest existing parent); None for a URL."""
    if is_url(folder):
        return None
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free
