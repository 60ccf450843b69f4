"""meshlm: model-parallel GPT-J-class Transformers in JAX."""

from meshlm.api import LanguageModel, from_config, load
from meshlm.config import ConfigError, ModelConfig, preset

__version__ = "0.1.0"
__all__ = ["ConfigError", "LanguageModel", "ModelConfig", "__version__", "from_config", "load", "preset"]
