"""Every HTTP request's first stop: the API key is checked (on every path but /health), and the
response's status is counted under the request's route (metrics.route_label: a fixed set).

A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one runs the endpoint in a task of
its own and does not pass the client's disconnect through, so an endpoint awaiting a completion
never saw its client leave before the first byte, and the request decoded to its end."""

from __future__ import annotations

import hmac

from .api import ApiError
from .metrics import Metrics

OPEN_PATHS = frozenset({"/health"})  # load balancers and orchestrators probe it without a key


class Access:
    def __init__(self, app, metrics: Metrics, api_key: str | None):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    def _authorized(self, scope) -> bool:
        if self.expected is None or scope["path"] in OPEN_PATHS:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.count(path, message["status"])
            await send(message)

        if not self._authorized(scope):
            refusal = ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key", kind="authentication_error").response()
            return await refusal(scope, receive, counted)
        await self.app(scope, receive, counted)
