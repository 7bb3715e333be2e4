"""Every failure leaves as OpenAI's error body with the right HTTP status.

The body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``. ``type`` keeps
vLLM's names (the ``openai`` SDK picks its exception class from the status, not from
``type``); ``code`` is a short string as OpenAI's specification requires (vLLM sends the
status as an integer there): a specific one where the failure has one (``model_not_found``,
``unsupported_parameter``...), else the status's default from ``_CODES``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.protocol import ErrorInfo, ErrorResponse
from server.engine.errors import EngineDeadError, RequestError, RequestFailedError
from server.log import current_request_id

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
    405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
    422: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# Default ``code`` per status; handlers pass a more specific one where they know it.
_CODES = {
    400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
    408: "request_timeout", 413: "request_too_large", 429: "rate_limit_exceeded",
    500: "internal_error", 503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers; carries what the error body needs, and the response's extra
    headers (``Retry-After`` on a 429 or a 503 at a limit)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers) if headers else None


def error_type(status: int) -> str:
    return _TYPES.get(status, HTTPStatus(status).phrase)


def error_code(status: int) -> str:
    return _CODES.get(status, HTTPStatus(status).phrase.lower().replace(" ", "_"))


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object as a dict (also used outside FastAPI: middleware, protocol),
    with the request's id when it answers one (the id its log lines carry)."""
    info = ErrorInfo(message=message, type=error_type(status), param=param,
                     code=code or error_code(status), request_id=current_request_id())
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=dict(headers) if headers else None)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """One readable line naming the field, from pydantic's structured errors."""
    errors = exc.errors()
    if not errors:
        return str(exc), None
    first = min(errors, key=_relevance)
    # pydantic names union members and constraint wrappers in ``loc`` ("str",
    # "list[int]", "function-after[...]"); a client only wants the field's path.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    kind = first.get("type")
    if kind == "json_invalid":
        return f"malformed JSON body: {message}", None
    if kind:  # pydantic's own tag, as vLLM's messages carry it ("[type=greater_than_equal")
        message = f"{message} [type={kind}]"
    return (f"{param}: {message}" if param else message), param


def _relevance(error: Any) -> int:
    """A value that fails a union (``stop: str | list[str]``) fails every member; the error
    worth reporting is the one about the value (a lone surrogate in item 1), not "Input
    should be a valid string" from the member it was never meant for."""
    kind = str(error.get("type", ""))
    if kind in ("invalid_unicode", "unsupported_content", "value_error"):
        return 0
    return 2 if kind.endswith(("_type", "_parsing")) else 1


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part.startswith("function-"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        is_json = any(e.get("type") == "json_invalid" for e in exc.errors()[:1])
        return error_response(400, message, param, "invalid_json" if is_json else None)

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
        return error_response(503, str(exc), code="engine_dead")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers carry headers that belong to them (405's ``Allow``).
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

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
