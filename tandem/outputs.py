"""What a step produces: ``ModelRunnerOutput`` (executor → scheduler and output processor) and what
the engine hands back to callers, vLLM-shaped ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.sample.logprobs import Logprob

SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One executed step's results on the host, per scheduled request, in the order of
    ``SchedulerOutput.scheduled``.

    A request that sampled gets its accepted drafts followed by exactly one sampled token (the
    recovered or bonus token; a plain decode is the k = 0 case); a prefill chunk that does not reach
    the end of the prompt gets none. Tokens past a stop are still here: the output processor drops
    them. Rejected drafts are ``len(spec_token_ids) - num_accepted``.
    """

    sampled_token_ids: tuple[tuple[int, ...], ...]  # per request; () when it did not sample
    num_accepted: tuple[int, ...]  # per request: accepted drafts (0 without drafts)
    logprobs: tuple[SampleLogprobs | None, ...]  # per request: one entry per sampled token, if asked
    # per request: entries for the prompt positions scored in this step (a chunked prefill gets a
    # slice per chunk), if asked; the position-0 ``None`` is not included
    prompt_logprobs: tuple[PromptLogprobs | None, ...]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string / token that ended it
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    synthetic: bool = False  # True when speculation ran with synthetic acceptance: NOT the target's output
    error: str | None = None  # set when this request could not be served (others were)
