"""Every failure a route can meet, as an OpenAI-shaped error body: 400 bad input, 401 key, 404 model or route,
405 method, 413 too large, 500 a failure while running the request, 503 engine down (restarting). Tracebacks go to
the log, never out."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fovea.frontend.async_llm import EngineDeadError, RequestFailed
from fovea.multimodal.fetch import ImageTooLarge
from fovea.server.protocol import InvalidBody, error_body

HTTP_ERROR_KINDS = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class ClientDisconnected(Exception):
    """The client left while its request was prepared or ran; the request is aborted."""


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status, param), status_code=status)


# exception type -> (status, OpenAI error type); the message is the exception's text
STATUS = {
    InvalidBody: (400, "BadRequestError"),
    ValueError: (400, "BadRequestError"),
    ImageTooLarge: (413, "RequestEntityTooLargeError"),
    EngineDeadError: (503, "ServiceUnavailableError"),
    RequestFailed: (500, "InternalServerError"),
}


async def _on_api_error(_, exc: APIError):
    return error_response(exc.status, exc.message, exc.kind, exc.param)


async def _on_known(_, exc: Exception):
    status, kind = next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)
    return error_response(status, str(exc), kind, getattr(exc, "param", None))


async def _on_http_error(_, exc: StarletteHTTPException):
    return error_response(exc.status_code, str(exc.detail), HTTP_ERROR_KINDS.get(exc.status_code, "BadRequestError"))


async def _on_disconnected(_, exc: ClientDisconnected):
    return Response(status_code=499)  # nobody reads it; the request is already aborted


async def _on_unexpected(_, exc: Exception):
    # a bug hit while handling this request: it fails alone (uvicorn logs the traceback), the server goes on
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}"[:1000], "InternalServerError")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    for exception in STATUS:
        app.add_exception_handler(exception, _on_known)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientDisconnected, _on_disconnected)
    app.add_exception_handler(Exception, _on_unexpected)
