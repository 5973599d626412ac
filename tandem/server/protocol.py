"""OpenAI-compatible request/response shapes (with vLLM's extra sampling fields) and their mapping.

Requests: :class:`CompletionRequest` (``/v1/completions``) and :class:`ChatCompletionRequest`
(``/v1/chat/completions``) accept OpenAI's fields plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``seed``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``prompt_logprobs``). Unknown fields are
ignored, as by vLLM. Structured output (``response_format``, ``structured_outputs``, ``guided_*``) is
read by ``server/guided.py``; chat ``tools`` / ``tool_choice`` by ``server/tools.py``.
``to_sampling_params`` builds a validated :class:`SamplingParams`; every bad
value raises :class:`ProtocolError` or :class:`~tandem.errors.SamplingParamsError`, which the API
turns into HTTP 400 — nothing here asserts.

Responses are shaped exactly like OpenAI's (``id``, ``object``, ``created``, ``model``,
``choices``, ``usage``), and streaming chunks like OpenAI's SSE chunks. ``stop_reason`` (the stop
string or token that ended a choice) is vLLM's extra field.

Logprobs come from the engine as ``{token_id: Logprob}`` per generated token; ``protocol_logprobs.TokenText``
turns ids into the token strings OpenAI clients expect.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from tandem.errors import RequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.guided import GUIDED, structured_outputs_of
from tandem.server.tool_parsers import DeltaToolCall, ToolCall
from tandem.structured.params import StructuredOutputsParams

STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED)
MAX_LOGPROBS = 20  # SamplingParams' limit; OpenAI's own is 5 (completions) / 20 (chat)


class ProtocolError(RequestError):
    """A request that is well-formed JSON but asks for something invalid or unsupported (HTTP 400)."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---- requests -------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # structured output (server/guided.py): OpenAI's response_format, vLLM's structured_outputs / guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", param="stream_options")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of other than n is not supported", param="best_of")

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise ProtocolError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            bias[tid] = max(-100.0, min(100.0, float(value)))  # OpenAI clamps to [-100, 100]
        return bias

    def structured(self, tool_schema: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
        """The request's output constraint (400 naming the field if bad or given twice)."""
        own = structured_outputs_of({k: getattr(self, k) for k in STRUCTURED_FIELDS})
        if own is not None and tool_schema is not None:
            raise ProtocolError("tool_choice 'required' or a named function cannot be combined with "
                                "response_format / structured_outputs", param="tool_choice")
        return own or tool_schema

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                structured: StructuredOutputsParams | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop or (),  # type: ignore[arg-type]  # normalised by SamplingParams
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self._logit_bias(),
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured,
        )


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One clear message instead of pydantic's four union-branch errors.
        ok = isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(x, str) for x in v)
            or all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in v)))
        if not ok:
            raise ValueError("must be a string, a list of strings, a list of token ids, "
                             "or a list of lists of token ids")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif not p:
            raise ProtocolError("prompt must not be empty", param="prompt")
        elif all(isinstance(t, int) for t in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        for i, item in enumerate(items):
            if len(item) == 0:
                raise ProtocolError(f"prompt[{i}] is empty", param="prompt")
        return items

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """``max_tokens``: the resolved limit (the request's, or what the context leaves)."""
        self._check_common()
        if self.suffix:
            raise ProtocolError("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
        prompt_lp = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, self.logprobs)
        return self._params(max_tokens, self.logprobs, prompt_lp, self.structured())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_input(self, index: int) -> dict[str, Any]:
        """A {role, content[, name]} dict with content flattened to text."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(
                        f"messages[{index}].content[{j}]: only parts of type 'text' are supported, "
                        f"got {part.get('type')!r}", param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        extra = self.model_extra or {}
        if extra.get("tool_call_id") is not None:
            out["tool_call_id"] = extra["tool_call_id"]
        if isinstance(extra.get("tool_calls"), list):  # arguments as objects for templates (as vLLM)
            out["tool_calls"] = [_template_call(c) for c in extra["tool_calls"]]
        return out


def _template_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return call


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise ProtocolError("messages must not be empty", param="messages")
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None,
                           tool_schema: StructuredOutputsParams | None = None) -> SamplingParams:
        """``tool_schema``: the grammar of tool_choice required / named (server/tools.py)."""
        self._check_common()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ProtocolError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, self.prompt_logprobs, self.structured(tool_schema))


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @staticmethod
    def of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:  # OpenAI deltas carry only the fields that changed
        out = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_of(outs: Sequence[RequestOutput]) -> UsageInfo:
    """Usage of finished (or latest) outputs: prompts counted once each, all choices' tokens."""
    return UsageInfo.of(sum(len(o.prompt_token_ids) for o in outs),
                        sum(len(c.token_ids) for o in outs for c in o.outputs),
                        sum(o.num_cached_tokens for o in outs))


# ---- streaming ------------------------------------------------------------------------------------
def stop_holdback(params: SamplingParams) -> int:
    """Characters a stream must hold back until the end: a stop string found later may cut up to
    ``len(stop) - 1`` already-released characters (none when the stop string is kept)."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


@dataclass
class StreamState:
    """What one streamed choice has sent so far.

    Invariant: the text sent is always a prefix of the choice's final text, so the concatenated
    deltas equal the non-streamed text.
    """

    sent_text: int = 0
    sent_tokens: int = 0
    echoed: bool = False
    echo_len: int = 0
    done: bool = False

    def advance(self, text: str, finished: bool, hold: int) -> str:
        """The new text to send for cumulative ``text``, holding back ``hold`` chars until finished."""
        end = len(text) if finished else max(self.sent_text, len(text) - hold)
        delta = text[self.sent_text:end]
        self.sent_text = end
        return delta
