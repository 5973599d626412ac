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

This module holds the routes; the pieces they use: ``api_errors.py`` (the error envelope),
``auth.py`` (the API key), ``serving.py`` (prompt checks, submission, disconnects, SSE) and
``responses.py`` (response bodies and stream events).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.errors import TandemError
from tandem.loader.tokenizer import apply_chat_template
from tandem.server.api_errors import ApiError, api_error, validation_api_error
from tandem.server.async_engine import AsyncEngine
from tandem.server.auth import ApiKeyMiddleware
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    random_id,
)
from tandem.server.protocol_logprobs import TokenText
from tandem.server.responses import chat_events, chat_response, completion_events, completion_response
from tandem.server.serving import Prompt, ServerState, event_stream, submit, unless_disconnected
from tandem.server.tools import ToolConfig, template_messages, tool_mode

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def build_app(async_engine: AsyncEngine, served_model_names: list[str], api_key: str | None = None, *,
              model_aliases: Sequence[str] = (), tools: ToolConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``async_engine``.

    ``served_model_names``: the names reported by ``/v1/models`` and in responses (first = default).
    ``model_aliases``: further ``model`` values accepted (e.g. the checkpoint path or alias).
    ``tools``: ``--tool-call-parser`` / ``--enable-auto-tool-choice`` (default: no parser, no auto).
    """
    from tandem import __version__

    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    server = ServerState(async_engine, list(served_model_names), set(served_model_names) | set(model_aliases),
                         TokenText(async_engine.engine.tokenizer), tools=tools or ToolConfig())
    app = FastAPI(title="tandem", version=__version__)
    app.state.server = server
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    # ---- errors ----------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(TandemError)
    async def _tandem_error(_: Request, exc: TandemError) -> JSONResponse:
        return api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_api_error(exc).response()

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
        prompts: list[Prompt] = []
        for item in req.prompts():
            text, ids = (item, server.encode(item)) if isinstance(item, str) else (
                None, server.check_ids(item, "prompt"))
            max_tokens = server.fit(ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
            prompts.append(Prompt(text, ids, req.to_sampling_params(max_tokens)))
        base_id = random_id("cmpl")
        streams = await submit(server, base_id, prompts, arrival)
        if req.stream:
            return event_stream(completion_events(server, req, model, base_id, prompts, streams))
        outs = await unless_disconnected(raw, streams)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(completion_response(server, req, model, base_id, prompts, outs).model_dump())

    # ---- chat --------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = server.model_name(req.model)
        mode = tool_mode(req.tools, req.tool_choice, server.tools)
        template_kw = {"tools": list(mode.tools)} if mode.tools else {}
        msgs = template_messages(req.template_messages(), mode.tools, getattr(server.tokenizer, "chat_template", None))
        ids = apply_chat_template(server.tokenizer, msgs, add_generation_prompt=req.add_generation_prompt,
                                  **template_kw)
        max_tokens = server.fit(ids, req.requested_max_tokens, None)
        prompt = Prompt(None, ids, req.to_sampling_params(max_tokens, mode.schema()))
        base_id = random_id("chatcmpl")
        streams = await submit(server, base_id, [prompt], arrival)
        if req.stream:
            return event_stream(chat_events(server, req, model, base_id, prompt, streams[0], mode))
        outs = await unless_disconnected(raw, streams)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(chat_response(server, req, model, base_id, outs[0], mode).model_dump())

    return app


__all__ = ["build_app"]
