"""Every checkpoint format meshlm reads, looked up in one place: `meshlm.load` and `meshlm.convert`
resolve a path once, detect its format, and open it as a slice source."""

from __future__ import annotations

from pathlib import Path

from meshlm.config import CheckpointError, ModelConfig, is_url
from meshlm.formats import hf, mtj, native
from meshlm.formats.slices import SliceSource

# name -> module with detect(path) -> bool and open(path, dtype, ...) -> (ModelConfig, SliceSource);
# checked in this order (a meshlm checkpoint may also carry a config.json)
FORMATS = {"meshlm": native, "hf": hf, "mtj": mtj}


def detect(path: str | Path) -> str:
    """'meshlm', 'hf' or 'mtj' (the seed's step_N folder or run folder), from the files in `path`."""
    if is_url(path):
        if mtj.detect(path):
            return "mtj"
        if native.detect(path):
            return "meshlm"
        raise CheckpointError(f"{path}: URLs are read for the seed's checkpoints and meshlm's, and this is neither")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a checkpoint folder, got a file")
    for name, module in FORMATS.items():
        if module.detect(path):
            return name
    raise CheckpointError(
        f"{path}: not a checkpoint meshlm can read (expected meshlm.json, a Hugging Face config.json, "
        "or the seed's shard_0/ folder)"
    )


def resolve(path: str | Path) -> tuple[str | Path, str]:
    """The checkpoint a path stands for (a run folder's latest step) and its format."""
    path = native.resolve(path)
    return path, detect(path)


def open(
    path: str | Path, fmt: str, dtype: str, seed_config: str | Path | None = None
) -> tuple[ModelConfig, SliceSource]:
    """The config and slice source of a resolved checkpoint in format `fmt`."""
    if fmt == "mtj":
        return mtj.open(path, dtype, seed_config)
    if seed_config is not None:
        raise CheckpointError(f"{path}: seed_config applies to the seed's checkpoints only; this is a {fmt} checkpoint")
    return FORMATS[fmt].open(path, dtype)
