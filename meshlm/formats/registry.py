"""Every checkpoint format meshlm reads and writes, in one table: `meshlm.load` and `meshlm.convert` resolve a
path once, detect its format, and open it as a slice source; `LanguageModel.save`, `convert` and `merge`
look up the writer of the format they write; a run that continues the seed's reads its optimizer state here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshlm.config import CheckpointError, ConfigError, ModelConfig, is_url
from meshlm.formats import hf, mtj, native
from meshlm.formats.slices import OptimizerState, SliceSource


@dataclass(frozen=True)
class Format:
    """One checkpoint format: how a folder of it is recognised, read and (where meshlm writes it) written."""

    detect: Callable[[str | Path], bool]
    open: Callable[..., tuple[ModelConfig, SliceSource]]  # (path, dtype[, seed_config])
    write: Callable[..., None] | None  # (path, cfg, dtype, source, files); None: read only
    urls: bool  # read from a URL (gs://...) as well as from a local folder
    seed_config: bool = False  # `open` takes the seed's run JSON (the head count its files do not record)
    optimizer: Callable[..., OptimizerState] | None = None  # (path, mesh, dtype, seed_config): Adam's state


# Checked in this order: a meshlm checkpoint may also carry a config.json.
FORMATS = {
    "mtj": Format(mtj.detect, mtj.open, None, urls=True, seed_config=True, optimizer=mtj.load_optimizer_moments),
    "meshlm": Format(native.detect, native.open, native.write, urls=True),
    "hf": Format(hf.detect, hf.open, hf.write, urls=False),
}


def detect(path: str | Path) -> str:
    """'meshlm', 'hf' or 'mtj' (the seed's step_N folder or run folder), from the files in `path`."""
    url = is_url(path)
    if not url:
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path}: no such file or directory")
        if not path.is_dir():
            raise CheckpointError(f"{path}: expected a checkpoint folder, got a file")
    for name, fmt in FORMATS.items():
        if (fmt.urls or not url) and fmt.detect(path):
            return name
    if url:
        raise CheckpointError(f"{path}: URLs are read for the seed's checkpoints and meshlm's, and this is neither")
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
    reader = FORMATS[fmt]
    if seed_config is None:
        return reader.open(path, dtype)
    if not reader.seed_config:
        raise CheckpointError(f"{path}: seed_config applies to the seed's checkpoints only; this is a {fmt} checkpoint")
    return reader.open(path, dtype, seed_config)


def writer(fmt: str, what: str) -> Callable[..., None]:
    """The writer of format `fmt`, `write(path, cfg, dtype, source, files)`; an unknown one is refused,
    naming it as `what` ("save format")."""
    writable = [name for name, f in FORMATS.items() if f.write is not None]
    if fmt not in writable:
        raise ConfigError(f"unknown {what} {fmt!r}; choose {' or '.join(map(repr, writable))}")
    return FORMATS[fmt].write


def optimizer_reader(path: str | Path) -> Callable[..., OptimizerState] | None:
    """How to read the optimizer state of the checkpoint at `path`, `read(path, mesh, dtype, seed_config)`:
    None when its format keeps none that a run continues."""
    return FORMATS[detect(path)].optimizer
