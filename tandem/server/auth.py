"""API-key check of the server: every route but ``/health`` needs ``Authorization: Bearer KEY`` when a key is set."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.server.protocol import error_body

OPEN_ROUTES = frozenset({"/health"})


class ApiKeyMiddleware:
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
