"""Every failure leaves as OpenAI's error body with the right HTTP status."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.protocol import ErrorInfo, ErrorResponse
from server.engine.errors import EngineDeadError, RequestError, RequestFailedError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
    405: "MethodNotAllowedError", 413: "RequestTooLargeError", 422: "BadRequestError",
    500: "InternalServerError", 503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by handlers; carries what the error body needs."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_type(status: int) -> str:
    return _TYPES.get(status, HTTPStatus(status).phrase)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=error_type(status), param=param, code=status)
    )
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """One readable line naming the field, from pydantic's structured errors."""
    errors = exc.errors()
    if not errors:
        return str(exc), None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {message}", None
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(ValidationError)
    async def _params_validation(_: Request, exc: ValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")


def stream_error(exc: BaseException) -> tuple[int, str]:
    """(status, message) for a failure that happens after a stream's first chunk."""
    if isinstance(exc, EngineDeadError):
        return 503, str(exc)
    if isinstance(exc, RequestFailedError):
        return 500, str(exc)
    logger.error("stream failed", exc_info=exc)
    return 500, f"internal error: {type(exc).__name__}"
