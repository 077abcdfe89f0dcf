"""Bearer-token auth: ``api_key`` on ``/v1/*``, ``/tokenize`` and ``/detokenize``, ``admin_key`` on
``/fault_tolerance/*`` and the LoRA load/unload routes.

Without an admin key the control routes answer loopback clients only: they restart processes,
and a server bound to a public address must not hand that to anyone who can reach its port.
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from bastion.api.config import CONFIG_KEY, ApiConfig
from bastion.api.errors import ApiError, Handler

# Routes that change what the server runs (vLLM guards its LoRA routes the same way).
_CONTROL_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# vLLM serves these outside /v1; they expose the model's tokenizer, so they take the API key.
_TOKENIZER_PATHS = ("/tokenize", "/detokenize")


def is_control_path(path: str) -> bool:
    return (path == "/fault_tolerance" or path.startswith("/fault_tolerance/")
            or path in _CONTROL_ROUTES)


def required_key(config: ApiConfig, path: str) -> tuple[str | None, str]:
    """The key guarding ``path`` (None: open) and its name for the error message."""
    if is_control_path(path):
        return config.admin_key or config.api_key, "admin key"
    if path == "/v1" or path.startswith("/v1/") or path in _TOKENIZER_PATHS:
        return config.api_key, "API key"
    return None, ""


def is_authorized(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # NOTE: constant-time, so response timing does not reveal how much of a guess matched.
    # A header's bytes that are not UTF-8 reach us as surrogates (aiohttp decodes them with
    # surrogateescape): encoded back the same way they are bytes no key equals, not a 500.
    return hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key.encode())


def is_loopback(remote: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for anything else (a
    non-IP peer included), so an unknown peer is never trusted."""
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    config = request.app[CONFIG_KEY]
    if (is_control_path(request.path) and config.admin_key is None
            and not is_loopback(request.remote)):
        raise ApiError(403, "The control routes (/fault_tolerance/*, LoRA loading) answer only "
                       "loopback clients while "
                       "no admin key is set; start the server with --admin-key (or "
                       "BASTION_ADMIN_KEY) to use them from elsewhere",
                       code="admin_key_required")
    key, name = required_key(config, request.path)
    if key is not None and not is_authorized(request.headers.get("Authorization"), key):
        raise ApiError(401, f"Invalid or missing {name}: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)
