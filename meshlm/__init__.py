"""meshlm: model-parallel GPT-J-class Transformers in JAX."""

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
_API = ("LanguageModel", "convert", "export_adapter", "from_config", "load", "merge")


def __getattr__(name: str):
    """Import JAX only when the model API is first used, so `meshlm prepare` and its worker processes start fast."""
    if name in _API:
        from meshlm import api

        return getattr(api, name)
    raise AttributeError(f"module 'meshlm' has no attribute {name!r}")
