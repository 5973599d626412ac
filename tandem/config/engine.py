"""EngineConfig: everything an LLMEngine is built from, one frozen object."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config.cache import CacheConfig
from tandem.config.model import ModelConfig
from tandem.config.runner import RunnerConfig
from tandem.config.scheduler import SchedulerConfig
from tandem.config.speculative import SpeculativeConfig
from tandem.config.validate import check_bool


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    log_stats: bool = False

    def __post_init__(self) -> None:
        check_bool("log_stats", self.log_stats)
