"""OpenAI's error envelope for every failure: ``ApiError`` and the mapping from what went wrong to it.

Every error body is ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid values
(FastAPI's validation errors included), 500 when the engine fails while serving, 503 when the engine
thread is down. Errors after a streaming response started are sent in-band as one SSE event.
"""

from __future__ import annotations

import json
import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tandem.errors import RequestError, SamplingParamsError, TandemError
from tandem.server.async_engine import EngineDeadError, EngineStepError
from tandem.server.protocol import error_body

logger = logging.getLogger("tandem.server")


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


def validation_api_error(exc: RequestValidationError) -> ApiError:
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


def stream_error(exc: BaseException) -> str:
    err = api_error(exc)
    if err.status >= 500:
        logger.error("request failed mid-stream: %s", err.message)
    return f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"
