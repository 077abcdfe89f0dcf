"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` on every route.

Handlers raise ``ApiError``; the middleware turns it (and aiohttp's own 404/405/413, and
``InvalidParam`` from ``SamplingParams.verify``) into that shape, so no client mistake ever
surfaces as a 500 or as aiohttp's plain-text pages.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from bastion.api.config import CONFIG_KEY
from bastion.ipc.messages import InvalidParam

logger = logging.getLogger(__name__)

# The class names the openai Python client raises for each status, as vLLM reports them.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "DeadlineExceededError",  # only ever a passed request deadline (code deadline_exceeded)
}


class ApiError(Exception):
    """A failure to report to the client; ``code`` is OpenAI's machine-readable string."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    fallback = "BadRequestError" if status < 500 else "InternalServerError"
    error_type = _ERROR_TYPES.get(status, fallback)
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error_body(error.status, error.message, error.param, error.code),
                             status=error.status, headers=error.headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    status = exc.status
    headers = {}
    if status == 404:
        message, code = f"Route {request.method} {request.path} not found", "not_found"
    elif status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        message = f"Method {request.method} is not allowed on {request.path}; allowed: {allowed}"
        code = "method_not_allowed"
        headers["Allow"] = allowed
    elif status == 413:
        max_size = request.app[CONFIG_KEY].max_body_bytes
        message = f"Request body is too large; the limit is {max_size} bytes"
        code = "request_too_large"
    else:
        message, code = exc.reason or exc.text or "HTTP error", None
    return ApiError(status, message, None, code, headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware: every error leaves in OpenAI's shape."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except InvalidParam as exc:
        return error_response(ApiError(400, str(exc), exc.param))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http_exception(exc, request))
    except Exception:
        # NOTE: CancelledError is a BaseException and passes through: a client that went away
        # needs no answer, and the handlers abort their engine requests themselves.
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(ApiError(500, "Internal server error", code="internal_error"))
