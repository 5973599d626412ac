"""CacheConfig: KV block size, memory budget, prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.validate import check_bool, check_int
from tandem.errors import ConfigError

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True  # vLLM V1 default

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError("block_size", f"got {self.block_size!r}", BLOCK_SIZES)
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {g!r}")
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1, optional=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
