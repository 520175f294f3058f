"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with a
4xx status, and the FastAPI handlers that turn every failure into one. Under
/v1/messages (Anthropic's Messages API) the same errors take Anthropic's
shape: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic_protocol import AnthropicError, AnthropicErrorInfo
from .protocol import ErrorInfo, ErrorResponse


class ClientDisconnected(Exception):
    """The client went away before its response was ready (its request is aborted)."""


class APIError(Exception):
    """An error answered as OpenAI-style JSON with HTTP status `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error types by status (its API documents these)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error body with HTTP status `status` (and extra headers): OpenAI's
    shape, or Anthropic's for a request whose path is under /v1/messages."""
    if path.startswith(ANTHROPIC_PREFIX):
        body = AnthropicError(error=AnthropicErrorInfo(type=_ANTHROPIC_TYPES.get(status, type_), message=message))
        return JSONResponse(body.model_dump(), status_code=status, headers=headers)
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('msg')}", None
    if tuple(e.get("loc", ())) == ("body",):  # not a JSON object (or sent without a JSON content type)
        return f"the request body must be a JSON object (Content-Type: application/json): {e.get('msg')}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    return f"{param}: {e.get('msg')}" if param else str(e.get("msg")), param


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of a request becomes an OpenAI-style JSON error."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param, path=request.url.path)

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, path=request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                              "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                              headers=exc.headers, path=request.url.path)  # e.g. Allow on a 405

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {exc}", "internal_server_error", path=request.url.path)
