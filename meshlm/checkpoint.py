"""meshlm's own checkpoint format: orbax-checkpoint arrays plus a small JSON description.

A checkpoint folder holds `meshlm.json` (format version, model config, dtype) and `params/` (an orbax
PyTree checkpoint). `meshlm.json` is written last, so a folder without it is never taken for a
complete checkpoint. Restoring reads straight into any mesh and dtype.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from meshlm import model
from meshlm.config import ConfigError, ModelConfig
from meshlm.sharding import plan

FORMAT_VERSION = 1
MARKER = "meshlm.json"


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def read_description(path: str | Path) -> dict[str, Any]:
    marker = Path(path) / MARKER
    try:
        desc = json.loads(marker.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not a meshlm checkpoint (no {MARKER}; an interrupted save leaves none)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{marker}: not valid JSON ({e})") from None
    if desc.get("format") != "meshlm" or desc.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{marker}: unsupported checkpoint format {desc.get('format')!r} "
            f"version {desc.get('version')!r} (this meshlm reads version {FORMAT_VERSION})"
        )
    return desc


def save_params(path: str | Path, params: model.Params, cfg: ModelConfig, extra: dict[str, Any] | None = None) -> None:
    """Save parameters (any sharding, any number of processes) as a meshlm checkpoint."""
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"{path}: already exists and is not empty; choose a new folder")
    if jax.process_count() > 1:  # every process has looked before any of them writes
        multihost_utils.sync_global_devices(f"meshlm save {path}")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", params)
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        dtype = str(jax.tree.leaves(params)[0].dtype)
        desc = {"format": "meshlm", "version": FORMAT_VERSION, "model": cfg.to_dict(), "dtype": dtype, **(extra or {})}
        tmp = path / (MARKER + ".tmp")
        tmp.write_text(json.dumps(desc, indent=2))
        tmp.replace(path / MARKER)


def restore_params(
    path: str | Path, mesh: jax.sharding.Mesh, dtype: str = "float32"
) -> tuple[ModelConfig, model.Params]:
    """Restore a checkpoint's parameters onto `mesh` in `dtype`, whatever mesh saved them."""
    path = Path(path).absolute()
    desc = read_description(path)
    cfg = ModelConfig.from_dict(desc["model"])
    abstract = model.abstract_params(cfg, dtype)
    shardings = plan(abstract, model.logical_axes(cfg), mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    try:
        params = ocp.StandardCheckpointer().restore(path / "params", target)
    except Exception as e:  # orbax reports damage from deep inside tensorstore
        raise ConfigError(f"{path}: parameters could not be restored ({type(e).__name__}: {e})") from None
    return cfg, params
