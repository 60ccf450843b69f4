"""meshlm: model-parallel GPT-J-class Transformers in JAX.

Importing the package imports nothing else: `python -m meshlm` and the `meshlm` program put their Ctrl-C
handling in place before NumPy and JAX load (seconds on a slow machine), and `meshlm prepare` and its
worker processes start without JAX. The names below load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlm.api import LanguageModel, convert, export_adapter, from_config, load, merge
    from meshlm.config import CheckpointError, ConfigError, DataError, InputError, MeshlmError, ModelConfig, preset

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "InputError",
    "LanguageModel",
    "MeshlmError",
    "ModelConfig",
    "__version__",
    "convert",
    "export_adapter",
    "from_config",
    "load",
    "merge",
    "preset",
]
_CONFIG = ("CheckpointError", "ConfigError", "DataError", "InputError", "MeshlmError", "ModelConfig", "preset")
_API = ("LanguageModel", "convert", "export_adapter", "from_config", "load", "merge")


def __getattr__(name: str):
    if name in _CONFIG:
        from meshlm import config

        return getattr(config, name)
    if name in _API:
        from meshlm import api

        return getattr(api, name)
    raise AttributeError(f"module 'meshlm' has no attribute {name!r}")
