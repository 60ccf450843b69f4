"""Where meshlm reads and writes: local paths, and the URLs (gs://, s3://, az://) that orbax's path layer
reaches. `config.is_url`, the one test of what is a URL, stays with the configs, whose checks need it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshlm.config import ConfigError, is_url, one_line

PATH_URLS = ("gs://", "s3://", "az://")  # the schemes orbax's path layer reads and writes


def cache_dir() -> Path:
    """meshlm's own cache of things fetched or measured once per machine: `MESHLM_CACHE`, else ~/.cache/meshlm."""
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm"))


def has_path(path: str | Path) -> bool:
    """Whether `as_path` reaches `path`: a local path, or a URL of a scheme orbax's path layer serves."""
    return not is_url(path) or str(path).startswith(PATH_URLS)


def as_path(path: str | Path) -> Path:
    """A local path as a `Path`; a URL (gs://, s3://, az://) as orbax's own path type (`etils.epath`),
    which reads and writes it through fsspec (gcsfs for gs://) with `Path`'s methods. Written through a
    plain `Path`, `gs://b/run` would silently become a local folder `gs:/b/run`."""
    if is_url(path):
        if not has_path(path):
            raise ConfigError(f"{path}: unsupported URL for a run or checkpoint folder; use one of {list(PATH_URLS)}")
        from etils import epath

        return epath.Path(path)  # type: ignore[return-value]
    return Path(path)


def local_folder(path: str | Path, what: str) -> Path:
    """A folder that only local writes reach (a Hugging Face folder's safetensors): a URL is refused."""
    if is_url(path):
        raise ConfigError(
            f"{what} {path}: remote URLs are not supported here; give a local path or a filesystem every "
            "host mounts (for a bucket, e.g. gcsfuse)"
        )
    return Path(path)


def read_json(path: str | Path, missing: str) -> Any:
    """A JSON file's contents; a missing file raises ConfigError(`missing`), bad JSON one naming the file."""
    try:
        return json.loads(as_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({one_line(e)})") from None
