"""Request: the engine's mutable record of one sequence being generated.

Invariants:
- ``token_ids`` = prompt + the output tokens the host knows. ``num_output_placeholders`` more output
  tokens were sampled by steps still running on the device (asynchronous decode,
  engine/async_decode.py); they trail ``token_ids`` and are read into it in order.
- ``num_tokens`` = ``len(token_ids) + num_output_placeholders``: the sequence's length, placeholders
  included, so the scheduler schedules a placeholder's decode like any other token. The first
  ``num_computed_tokens`` positions have KV in the cache (or being written by a launched step);
  they never exceed the known tokens by more than the placeholders.
- In the decode phase ``num_computed_tokens == num_tokens - 1`` (the last token is fed next).
- ``spec_token_ids`` are drafts proposed for the next step; they are query tokens only and never part
  of ``token_ids`` until accepted. Rejected drafts roll back by count: their KV slots are simply
  overwritten later. A verify launched with its tokens left on the device (a chained verify)
  counts as k + 1 placeholders, as if it accepted all k drafts, until it is read
  (``Scheduler.settle_launched``); drafts for the step after it may be proposed meanwhile.
- ``draft_num_computed`` is the same counter for a draft model's own KV cache (shares block_ids).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.sample.seeded import SeededStream
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.structured.matcher import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED  # (hot: checked per token; ``.name`` is a slower descriptor)


_FINISHED = frozenset(s.value for s in RequestStatus if s.name.startswith("FINISHED"))


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    generator: SeededStream | None = None  # params.seed given: randomness keyed by output position
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None  # [k, V] draft q when the draft samples
    num_output_placeholders: int = 0  # sampled tokens still on the device (not in token_ids yet)
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    draft_num_computed: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # speculation counters (per request)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # logprobs collected per output token / prompt position
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    error: str | None = None
    grammar: RequestGrammar | None = None  # structured output: advanced by the output processor only

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens + placeholders (sampled on the device, not read yet)."""
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, placeholders included."""
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens the host knows."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Caught up with its tokens: the next step feeds the last token (plus drafts)."""
        return self.num_computed_tokens == self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        """Append the next output token; it takes the place of the oldest placeholder, if any."""
        self.token_ids.append(token_id)
        if self.num_output_placeholders:
            self.num_output_placeholders -= 1

    @property
    def max_output_tokens(self) -> int:
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.params.max_tokens
        return room if mt is None else min(mt, room)
