"""The OpenAI-compatible HTTP API (FastAPI): ``build_app(async_engine, served_model_names, api_key)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, and the admin route
``POST /reset_prefix_cache`` (drops cached KV blocks no request holds; 200 when the cache is now
empty, 400 ``prefix_cache_in_use`` — after dropping what it could — while requests hold blocks, like
vLLM which only succeeds with nothing running).

Invariants:

- Every error is OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``: 400 for
  invalid values (FastAPI's validation errors included), 400 + ``context_length_exceeded`` for a
  prompt that does not fit (or prompt + max_tokens over ``max_model_len``), 401 without the API key
  (when one is set; every route but ``/health``), 404 for an unknown model or route, 500 when the
  engine fails while serving (the server stays up), 503 when the engine thread is down.
- A request is validated and tokenized here and accepted by the engine thread *before* a
  streaming response starts, so engine-side rejections are still a 400, never a broken stream.
- Streaming sends one SSE chunk per engine output that carries new text (a verify step releasing
  several tokens is one chunk). With stop strings, the last ``max(len(stop)) - 1`` characters are
  held back until the request finishes (a stop string may still cut them), so the streamed text
  always concatenates to exactly the non-streamed text.
- A client that disconnects (streaming or not) has its requests aborted, freeing their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.errors import RequestError, SamplingParamsError, TandemError
from tandem.loader.tokenizer import apply_chat_template
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    RequestStream,
    final_outputs,
    merge_streams,
)
from tandem.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    ProtocolError,
    StreamState,
    TokenizeRequest,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    error_body,
    now_s,
    random_id,
    stop_holdback,
    usage_of,
)

logger = logging.getLogger("tandem.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPEN_ROUTES = frozenset({"/health"})


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def api_error(exc: BaseException) -> ApiError:
    """Map an exception raised while serving a request to its HTTP error."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return ApiError(400, str(exc), param=exc.field)
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineStepError):
        return ApiError(500, str(exc), type_="server_error")
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), type_="server_error", code="engine_unavailable")
    if isinstance(exc, TandemError):
        return ApiError(400, str(exc))
    logger.error("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}", type_="server_error")


class _ApiKeyMiddleware:
    """Pure ASGI middleware (does not interfere with streaming or disconnect detection)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                          "invalid_request_error", code="invalid_api_key")
        await JSONResponse(body, status_code=401)(scope, receive, send)


@dataclass
class _Prompt:
    """One prompt, tokenized and checked, with its sampling params."""

    text: str | None
    ids: list[int]
    params: SamplingParams


@dataclass
class _Server:
    engine: AsyncEngine
    served: list[str]
    accepted: set[str]
    token_text: TokenText
    created: int = field(default_factory=now_s)

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


# ---- engine plumbing --------------------------------------------------------------------------------
async def _submit(server: _Server, base_id: str, prompts: list[_Prompt], arrival: float) -> list[RequestStream]:
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


async def _unless_disconnected(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
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


def _sse(obj: Any) -> str:
    data = obj.model_dump() if hasattr(obj, "model_dump") else dict(obj)
    if data.get("usage", 0) is None:
        del data["usage"]  # OpenAI: usage appears only on the usage chunk (or all, with continuous stats)
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---- the app ------------------------------------------------------------------------------------------
def build_app(async_engine: AsyncEngine, served_model_names: list[str], api_key: str | None = None, *,
              model_aliases: Sequence[str] = ()) -> FastAPI:
    """The FastAPI app serving ``async_engine``.

    ``served_model_names``: the names reported by ``/v1/models`` and in responses (first = default).
    ``model_aliases``: further ``model`` values accepted (e.g. the checkpoint path or alias).
    """
    from tandem import __version__

    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    server = _Server(async_engine, list(served_model_names), set(served_model_names) | set(model_aliases),
                     TokenText(async_engine.engine.tokenizer))
    app = FastAPI(title="tandem", version=__version__)
    app.state.server = server
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    # ---- errors ----------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(TandemError)
    async def _tandem_error(_: Request, exc: TandemError) -> JSONResponse:
        return api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    # ---- simple routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if async_engine.healthy:
            return Response(status_code=200)
        return ApiError(503, f"engine unhealthy: {async_engine.last_error or 'not running'}",
                        type_="server_error", code="engine_unavailable").response()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=async_engine.metrics.content_type)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        # Safe beside the engine thread: the block pool serialises its operations with a lock.
        r = async_engine.engine.reset_prefix_cache()
        if not r.complete:
            raise ApiError(400, f"prefix cache only partly reset: dropped {r.evicted_blocks} cached free block(s); "
                                f"{r.held_blocks} block(s) are in use by running requests ({r.held_cached_blocks} "
                                "of them cached, kept). Retry when no request is running.",
                           code="prefix_cache_in_use")
        return {"success": True, "evicted_blocks": r.evicted_blocks}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": server.created, "owned_by": "tandem",
             "root": name, "parent": None, "max_model_len": server.max_model_len}
            for name in server.served]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        server.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            msgs = [m.as_template_input(i) for i, m in enumerate(req.messages)]
            ids = apply_chat_template(server.tokenizer, msgs, add_generation_prompt=req.add_generation_prompt)
        else:
            ids = server.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        server.model_name(req.model)
        ids = server.check_ids(req.tokens, "tokens")
        return {"prompt": server.tokenizer.decode(ids)}

    # ---- completions -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = server.model_name(req.model)
        prompts: list[_Prompt] = []
        for item in req.prompts():
            text, ids = (item, server.encode(item)) if isinstance(item, str) else (
                None, server.check_ids(item, "prompt"))
            max_tokens = server.fit(ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
            prompts.append(_Prompt(text, ids, req.to_sampling_params(max_tokens)))
        base_id = random_id("cmpl")
        streams = await _submit(server, base_id, prompts, arrival)
        if req.stream:
            return _event_stream(_completion_events(server, req, model, base_id, prompts, streams))
        outs = await _unless_disconnected(raw, streams)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(_completion_response(server, req, model, base_id, prompts, outs).model_dump())

    # ---- chat --------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = server.model_name(req.model)
        ids = apply_chat_template(server.tokenizer, req.template_messages(),
                                  add_generation_prompt=req.add_generation_prompt)
        max_tokens = server.fit(ids, req.requested_max_tokens, None)
        prompt = _Prompt(None, ids, req.to_sampling_params(max_tokens))
        base_id = random_id("chatcmpl")
        streams = await _submit(server, base_id, [prompt], arrival)
        if req.stream:
            return _event_stream(_chat_events(server, req, model, base_id, prompt, streams[0]))
        outs = await _unless_disconnected(raw, streams)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(_chat_response(server, req, model, base_id, outs[0]).model_dump())

    return app


def _validation_api_error(exc: RequestValidationError) -> ApiError:
    """FastAPI/pydantic validation errors → one 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return ApiError(400, f"the request body is not valid JSON: {detail}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return ApiError(400, f"{where + ': ' if where else ''}{msg}{more}", param=param)


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _stream_error(exc: BaseException) -> str:
    err = api_error(exc)
    if err.status >= 500:
        logger.error("request failed mid-stream: %s", err.message)
    return f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"


# ---- completions: responses ---------------------------------------------------------------------------
def _completion_response(server: _Server, req: CompletionRequest, model: str, rid: str,
                         prompts: list[_Prompt], outs: list[RequestOutput]) -> CompletionResponse:
    choices = []
    n = prompts[0].params.n
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        prefix = _echo_text(server, p) if req.echo else ""
        for c in out.outputs:
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(c.token_ids, c.logprobs or [], req.logprobs, server.token_text,
                                         initial_offset=len(prefix))
                if req.echo:
                    pl = completion_logprobs(p.ids, out.prompt_logprobs or [None] * len(p.ids), req.logprobs,
                                             server.token_text)
                    lp = type(lp)(text_offset=pl.text_offset + lp.text_offset,
                                  token_logprobs=pl.token_logprobs + lp.token_logprobs,
                                  tokens=pl.tokens + lp.tokens, top_logprobs=pl.top_logprobs + lp.top_logprobs)
            choices.append(CompletionChoice(index=i * n + c.index, text=prefix + c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=rid, created=now_s(), model=model, choices=choices, usage=usage_of(outs))


def _echo_text(server: _Server, p: _Prompt) -> str:
    return p.text if p.text is not None else server.tokenizer.decode(p.ids)


async def _completion_events(server: _Server, req: CompletionRequest, model: str, rid: str,
                             prompts: list[_Prompt], streams: list[RequestStream]) -> AsyncIterator[str]:
    created = now_s()
    n = prompts[0].params.n
    states = {(i, j): StreamState() for i in range(len(prompts)) for j in range(n)}
    latest: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge_streams(streams):
            latest[i] = out
            p = prompts[i]
            hold = stop_holdback(p.params)
            for c in out.outputs:
                st = states[(i, c.index)]
                if st.done:
                    continue
                finished = c.finish_reason is not None
                prefix = ""
                if req.echo and not st.echoed:
                    prefix = _echo_text(server, p)
                    st.echoed, st.echo_len = True, len(prefix)
                offset = st.sent_text + (st.echo_len if req.echo else 0)
                delta = st.advance(c.text, finished, hold)
                if not delta and not prefix and not finished:
                    continue
                lp = None
                if req.logprobs is not None:
                    new = c.token_ids[st.sent_tokens:]
                    lp = completion_logprobs(new, (c.logprobs or [])[st.sent_tokens:], req.logprobs,
                                             server.token_text, initial_offset=offset + len(prefix))
                st.sent_tokens = len(c.token_ids)
                st.done = finished
                chunk = CompletionStreamResponse(id=rid, created=created, model=model, choices=[CompletionChoice(
                    index=i * n + c.index, text=prefix + delta, logprobs=lp,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
                if req.continuous_usage:
                    chunk.usage = usage_of(list(latest.values()))
                yield _sse(chunk)
        if req.include_usage:
            yield _sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                usage=usage_of(list(latest.values()))))
    except Exception as e:  # headers are sent: report in-band, as OpenAI does
        yield _stream_error(e)
    finally:
        for s in streams:
            s.abort()
    yield "data: [DONE]\n\n"


# ---- chat: responses --------------------------------------------------------------------------------
def _chat_response(server: _Server, req: ChatCompletionRequest, model: str, rid: str,
                   out: RequestOutput) -> ChatCompletionResponse:
    num_top = req.top_logprobs or 0
    choices = [
        ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                   logprobs=chat_logprobs(c.token_ids, c.logprobs or [], num_top, server.token_text)
                   if req.logprobs else None,
                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in out.outputs
    ]
    return ChatCompletionResponse(id=rid, created=now_s(), model=model, choices=choices, usage=usage_of([out]))


async def _chat_events(server: _Server, req: ChatCompletionRequest, model: str, rid: str, prompt: _Prompt,
                       stream: RequestStream) -> AsyncIterator[str]:
    created = now_s()
    n = prompt.params.n
    num_top = req.top_logprobs or 0
    hold = stop_holdback(prompt.params)
    states = [StreamState() for _ in range(n)]
    last: RequestOutput | None = None

    def chunk(index: int, delta: DeltaMessage, **kw: Any) -> ChatCompletionStreamResponse:
        out = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[
            ChatStreamChoice(index=index, delta=delta, logprobs=kw.get("logprobs"),
                             finish_reason=kw.get("finish_reason"), stop_reason=kw.get("stop_reason"))])
        if req.continuous_usage and last is not None:
            out.usage = usage_of([last])
        return out

    try:
        for j in range(n):  # OpenAI: the first chunk of each choice carries the role
            yield _sse(chunk(j, DeltaMessage(role="assistant", content="")))
        async for _, out in merge_streams([stream]):
            last = out
            for c in out.outputs:
                st = states[c.index]
                if st.done:
                    continue
                finished = c.finish_reason is not None
                delta = st.advance(c.text, finished, hold)
                if not delta and not finished:
                    continue
                lp = None
                if req.logprobs:
                    lp = chat_logprobs(c.token_ids[st.sent_tokens:], (c.logprobs or [])[st.sent_tokens:], num_top,
                                       server.token_text)
                st.sent_tokens = len(c.token_ids)
                st.done = finished
                yield _sse(chunk(c.index, DeltaMessage(content=delta if delta or not finished else None),
                                 logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        if req.include_usage and last is not None:
            yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                    usage=usage_of([last])))
    except Exception as e:  # headers are sent: report in-band, as OpenAI does
        yield _stream_error(e)
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"


__all__ = ["ApiError", "ProtocolError", "api_error", "build_app"]
