"""Bearer-token auth: ``api_key`` on ``/v1/*``, ``admin_key`` on ``/fault_tolerance/*``."""

from __future__ import annotations

import hmac

from aiohttp import web

from bastion.api.config import CONFIG_KEY, ApiConfig
from bastion.api.errors import ApiError, Handler


def required_key(config: ApiConfig, path: str) -> tuple[str | None, str]:
    """The key guarding ``path`` (None: open) and its name for the error message."""
    if path.startswith("/fault_tolerance"):
        return config.admin_key or config.api_key, "admin key"
    if path == "/v1" or path.startswith("/v1/"):
        return config.api_key, "API key"
    return None, ""


def is_authorized(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # NOTE: constant-time, so response timing does not reveal how much of a guess matched.
    return hmac.compare_digest(token.strip().encode(), key.encode())


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key, name = required_key(request.app[CONFIG_KEY], request.path)
    if key is not None and not is_authorized(request.headers.get("Authorization"), key):
        raise ApiError(401, f"Invalid or missing {name}: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)
