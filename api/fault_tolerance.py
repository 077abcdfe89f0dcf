"""``/fault_tolerance/*``: operator control of recovery (DESIGN.md §6).

The routes validate and authenticate (the auth middleware requires the admin key); the lead's
``FaultToleranceHandler`` does the work. Without a handler, ``status`` still reports the
engine client's view and ``apply``/``inject`` answer 503.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any, Protocol

from aiohttp import web

from bastion.api.config import CLIENT_KEY, CONFIG_KEY, FT_HANDLER_KEY
from bastion.api.errors import ApiError, bad_request
from bastion.api.protocol import get_int, read_json
from bastion.ipc.messages import EngineStatus, InvalidParam

INSTRUCTIONS = ("retry", "reinit")
FAULT_KINDS = ("raise", "worker_exit", "hang")

class FaultToleranceHandler(Protocol):
    """What the routes call. Methods may be plain or ``async``; raising ``ValueError``
    (or ``InvalidParam``) answers 400 with its message."""

    def apply(self, instruction: str, params: dict[str, Any]) -> str | Awaitable[str]:
        """Start ``retry`` or ``reinit`` of the whole DP group; returns an action request id."""

    def status(self) -> list[dict[str, Any]] | Awaitable[list[dict[str, Any]]]:
        """Per engine: id, state, fault info, epoch, last action and its error."""

    def inject(self, kind: str, engine: int) -> None | Awaitable[None]:
        """Inject a fault (``raise``, ``worker_exit`` or ``hang``) into one engine."""


async def _call(fn, *args: Any) -> Any:
    try:
        result = fn(*args)
        if inspect.isawaitable(result):
            result = await result
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return result


def _handler(request: web.Request) -> FaultToleranceHandler:
    handler = request.app.get(FT_HANDLER_KEY)
    if handler is None:
        raise ApiError(503, "Fault-tolerance control is not available on this server",
                       code="fault_tolerance_unavailable")
    return handler


def status_dict(status: EngineStatus) -> dict[str, Any]:
    return {"engine_id": status.engine_id, "state": status.state.name.lower(),
            "epoch": status.epoch, "fault_info": status.fault_info,
            "last_action": status.last_action, "last_action_id": status.last_action_id,
            "last_action_error": status.last_action_error}


async def apply_instruction(request: web.Request) -> web.Response:
    body = await read_json(request)
    instruction = body.get("instruction")
    if instruction not in INSTRUCTIONS:
        raise bad_request(f"instruction must be one of {', '.join(INSTRUCTIONS)}; "
                          f"got {instruction!r}", "instruction")
    params = body.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request("params must be an object", "params")
    request_id = await _call(_handler(request).apply, instruction, params)
    return web.json_response({"request_id": request_id, "instruction": instruction},
                             status=202)


async def get_status(request: web.Request) -> web.Response:
    handler = request.app.get(FT_HANDLER_KEY)
    if handler is not None:
        engines = await _call(handler.status)
    else:
        engines = [status_dict(s) for s in request.app[CLIENT_KEY].engine_statuses()]
    return web.json_response({"engines": engines})


async def inject_fault(request: web.Request) -> web.Response:
    if not request.app[CONFIG_KEY].enable_fault_injection:
        raise ApiError(404, "Fault injection is disabled; start the server with "
                       "--enable-fault-injection to use it", code="not_found")
    body = await read_json(request)
    kind = body.get("kind")
    if kind not in FAULT_KINDS:
        raise bad_request(f"kind must be one of {', '.join(FAULT_KINDS)}; got {kind!r}", "kind")
    engine = get_int(body, "engine", 0)
    num_engines = len(request.app[CLIENT_KEY].engine_statuses())
    if not 0 <= engine < max(num_engines, 1):
        raise bad_request(f"engine must be in [0, {max(num_engines, 1)}), got {engine}", "engine")
    await _call(_handler(request).inject, kind, engine)
    return web.json_response({"status": "injected", "kind": kind, "engine": engine})


def add_fault_tolerance_routes(app: web.Application) -> None:
    app.router.add_post("/fault_tolerance/apply", apply_instruction)
    app.router.add_get("/fault_tolerance/status", get_status)
    app.router.add_post("/fault_tolerance/inject", inject_fault)


def set_fault_tolerance_handler(app: web.Application, handler: FaultToleranceHandler) -> None:
    """Install the lead's handler; call before the app starts (aiohttp freezes its state)."""
    app[FT_HANDLER_KEY] = handler
