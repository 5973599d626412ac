"""SchedulerConfig: batch limits, admission in groups and asynchronous scheduling."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.validate import check_int
from tandem.errors import ConfigError

DEFAULT_TOKEN_BUDGET = 8192  # max_num_batched_tokens when unset


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: DEFAULT_TOKEN_BUDGET
    # Queue the next decode step before reading this one's tokens (engine/async_decode.py).
    # None: on with CUDA (the host work then overlaps the GPU), off on CPU (nothing to overlap).
    async_scheduling: bool | None = None
    # While requests run and more wait than seats are free, admit waiting ones only once this many
    # seats are free (scheduler.py). None: max_num_seqs // 8 with CUDA graphs (an admitting step
    # carries prefill, runs eagerly and breaks the asynchronous chain), 1 otherwise (admit at once).
    admission_group: int | None = None

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1, optional=True)
        check_int("admission_group", self.admission_group, minimum=1, optional=True)
        if self.async_scheduling not in (None, True, False):
            raise ConfigError("async_scheduling", f"got {self.async_scheduling!r}; null means auto (on with CUDA)",
                              allowed=(True, False, None))

    def resolved_admission_group(self, graphs: bool) -> int:
        """``admission_group``, its default resolved for a runner with (``graphs``) or without CUDA graphs."""
        if self.admission_group is not None:
            return self.admission_group
        return max(1, self.max_num_seqs // 8) if graphs else 1

    def token_budget(self, num_speculative_tokens: int) -> int:
        budget = self.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET
        if budget < num_speculative_tokens + 1:
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be at least num_speculative_tokens + 1 = {num_speculative_tokens + 1}, got {budget}",
            )
        return budget
