"""Configuration, in one place: frozen, validated dataclasses, one per concern.

Each bad value raises one ConfigError naming the key (and the allowed values where finite).
``EngineConfig`` bundles them; ``env.py`` is the only reader of environment variables.
"""

from tandem.config.cache import BLOCK_SIZES, CacheConfig
from tandem.config.engine import EngineConfig
from tandem.config.model import DTYPES, LOAD_FORMATS, ModelConfig, resolve_device, resolve_dtype, resolve_max_model_len
from tandem.config.runner import RunnerConfig
from tandem.config.scheduler import SchedulerConfig
from tandem.config.speculative import SpeculativeConfig

__all__ = [
    "BLOCK_SIZES", "CacheConfig", "DTYPES", "EngineConfig", "LOAD_FORMATS", "ModelConfig", "RunnerConfig",
    "SchedulerConfig", "SpeculativeConfig", "resolve_device", "resolve_dtype", "resolve_max_model_len",
]
