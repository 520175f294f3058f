"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with a
4xx status, and the FastAPI handlers that turn every failure into one."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import ErrorInfo, ErrorResponse


class ClientDisconnected(Exception):
    """The client went away before its response was ready (its request is aborted)."""


class APIError(Exception):
    """An error answered as OpenAI-style JSON with HTTP status `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI-style error body with HTTP status `status` (and extra headers)."""
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
        return error_response(400, message, param=param)

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                              "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                              headers=exc.headers)  # e.g. Allow on a 405

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {exc}", "internal_server_error")
