"""Pure ASGI middlewares (for app.add_middleware) that answer errors as
OpenAI-style JSON ({"error": {message, type, param, code}}) through
errors.error_response, like the app's own error handlers."""

from __future__ import annotations

import secrets
import uuid

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response


def body_too_large(max_body_bytes: int, path: str = "") -> JSONResponse:
    """The 413 answer to a body over max_body_bytes (error_response's shape for path)."""
    return error_response(413, f"The request body is larger than the limit of {max_body_bytes} bytes.",
                          code="request_too_large", path=path)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <api_key>` (or Anthropic's `x-api-key:
    <api_key>`) on HTTP paths under protected_prefix.

    Anything else (/health, /metrics, /version, /tokenize, CORS preflight OPTIONS
    requests) stays open. Does nothing when api_key is None or "" (as vLLM). A missing or wrong
    key gets 401 with type "authentication_error", code "invalid_api_key".
    """

    def __init__(self, app: ASGIApp, api_key: str | None, protected_prefix: str = "/v1") -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.prefix = protected_prefix.rstrip("/")

    def _protected(self, scope: Scope) -> bool:
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return path == self.prefix or path.startswith(self.prefix + "/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.api_key is None or scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not self._protected(scope)):
            await self.app(scope, receive, send)
            return
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        token = token.strip() or (_header(scope, b"x-api-key") or b"").strip()
        if token and secrets.compare_digest(token, self.api_key):
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if token else
                   "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'.")
        response = error_response(401, message, "authentication_error", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"}, path=scope["path"])
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 (type "invalid_request_error") to HTTP requests whose body is over
    max_body_bytes: at once when Content-Length says so, or, for a body without one
    (chunked), as soon as the bytes read pass the limit. From then on the app gets
    http.disconnect instead of more body, and its own response is dropped in favour
    of the 413 (unless it had already started responding). Other scopes pass through.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> JSONResponse:
        return body_too_large(self.max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            await self._too_large()(scope, receive, send)
            return

        received, over, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over and not started:
                return  # the 413 below replaces the app's answer
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over or started:
                raise
        if over and not started:
            await self._too_large()(scope, receive, send)


REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128


def _usable_request_id(value: bytes | None) -> str | None:
    """A client's X-Request-Id when it is 1..MAX_REQUEST_ID_CHARS visible ASCII characters, else None."""
    if value is None or not 0 < len(value) <= MAX_REQUEST_ID_CHARS or not all(33 <= b < 127 for b in value):
        return None
    return value.decode("ascii")


class RequestIdMiddleware:
    """X-Request-Id, as vLLM and most proxies use it: every HTTP response carries
    the request's id in that header: the client's own when it sent a usable one
    (1..128 visible ASCII characters), else a fresh uuid4 hex. Handlers read it
    as request.state.request_id (the completion ids are built from it) and
    request.state.request_id_given (whether the client chose it). Add it last:
    the outermost middleware, so errors from the others carry it too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _usable_request_id(_header(scope, REQUEST_ID_HEADER))
        request_id = given or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_given"] = request_id, given is not None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id.encode("ascii"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)
