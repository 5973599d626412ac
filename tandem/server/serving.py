"""What every generation route does with a request: check and fit its prompts, submit them to the engine,
wait for the outputs unless the client goes away, and write server-sent events.

A request is accepted by the engine thread *before* a streaming response starts, so engine-side
rejections are still a 400, never a broken stream; a client that disconnects has its requests aborted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.api_errors import ApiError
from tandem.server.async_engine import AsyncEngine, RequestStream, final_outputs
from tandem.server.protocol import now_s
from tandem.server.protocol_logprobs import TokenText
from tandem.server.tools import ToolConfig


@dataclass
class Prompt:
    """One prompt, tokenized and checked, with its sampling params."""

    text: str | None
    ids: list[int]
    params: SamplingParams


@dataclass
class ServerState:
    """What every route of one app shares: the engine, the model names it serves and accepts."""

    engine: AsyncEngine
    served: list[str]
    accepted: set[str]
    token_text: TokenText
    created: int = field(default_factory=now_s)
    tools: ToolConfig = field(default_factory=ToolConfig)  # --tool-call-parser, --enable-auto-tool-choice

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        arch = getattr(self.engine.engine, "arch", None)
        return int(getattr(arch, "vocab_size", 0) or len(self.tokenizer))

    def model_name(self, requested: str | None) -> str:
        """The name to report; 404 if ``requested`` names no model served here."""
        if requested is None or requested in self.accepted:
            return requested if requested in self.served else self.served[0]
        raise ApiError(404, f"The model `{requested}` does not exist. Served: {', '.join(self.served)}.",
                       param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param=param)
        return list(ids)

    def fit(self, ids: list[int], requested: int | None, default: int | None) -> int:
        """max_tokens for a prompt of ``ids``; 400 context_length_exceeded if it cannot fit."""
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                f"has {n} tokens, which leaves no room to generate. Please reduce the length "
                                "of the prompt.", param="prompt", code="context_length_exceeded")
        if requested is not None:
            if requested >= 1 and n + requested > limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {n + requested} tokens ({n} in the prompt, {requested} in the "
                                    "completion). Please reduce the length of the prompt or completion.",
                               param="max_tokens", code="context_length_exceeded")
            return requested
        room = limit - n
        return room if default is None else min(default, room)


async def submit(server: ServerState, base_id: str, prompts: list[Prompt], arrival: float) -> list[RequestStream]:
    """Add every prompt to the engine (one batch of commands); if any is rejected, abort the others
    and raise the first rejection."""
    ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
    results = await asyncio.gather(
        *(server.engine.add_request(rid, p.text, p.params, prompt_token_ids=p.ids, arrival_time=arrival)
          for rid, p in zip(ids, prompts, strict=True)),
        return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, RequestStream):
                r.abort()
        raise errors[0]
    return [r for r in results if isinstance(r, RequestStream)]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """Final outputs, or None if the client went away first (its requests are then aborted)."""
    work = asyncio.ensure_future(final_outputs(streams))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        return None
    finally:
        for t in (work, watch):
            t.cancel()
        for s in streams:
            s.abort()


def sse(obj: Any) -> str:
    data = obj.model_dump() if hasattr(obj, "model_dump") else dict(obj)
    if data.get("usage", 0) is None:
        del data["usage"]  # OpenAI: usage appears only on the usage chunk (or all, with continuous stats)
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
