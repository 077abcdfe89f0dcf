"""``/fault_tolerance/*``: operator control of recovery (DESIGN.md §6).

The routes validate and authenticate (the auth middleware requires the admin key); the lead's
``FaultToleranceHandler`` does the work. Without a handler, ``status`` still reports the
engine client's view and ``apply``/``inject`` answer 503.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any, Protocol

import msgspec
from aiohttp import web

from bastion.api.config import CLIENT_KEY, CONFIG_KEY, FT_HANDLER_KEY
from bastion.api.errors import ApiError, bad_request
from bastion.api.protocol import decode_json, read_body
from bastion.ipc.messages import EngineStatus, InvalidParam

FAULT_KINDS = ("raise", "worker_exit", "hang")


# NOTE: the bodies are strict on purpose: these routes restart processes, so a field the
# server would ignore (a typo, a param of another version) must fail loudly, not be dropped.
class RetryParams(msgspec.Struct, forbid_unknown_fields=True):
    """``retry``: re-create the group's process groups at a new epoch. No parameters."""


class ReinitParams(msgspec.Struct, forbid_unknown_fields=True):
    """``reinit``: also replace dead engine or worker processes. No parameters."""


# Each instruction and the only params it accepts.
INSTRUCTION_PARAMS: dict[str, type[msgspec.Struct]] = {"retry": RetryParams,
                                                       "reinit": ReinitParams}
INSTRUCTIONS = tuple(INSTRUCTION_PARAMS)


class ApplyBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /fault_tolerance/apply``; ``params`` is decoded by the instruction's type."""

    instruction: str
    params: msgspec.Raw = msgspec.Raw(b"{}")


class InjectBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /fault_tolerance/inject``."""

    kind: str
    engine: int = 0


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
    body: ApplyBody = decode_json(await read_body(request), ApplyBody)
    params_type = INSTRUCTION_PARAMS.get(body.instruction)
    if params_type is None:
        raise bad_request(f"instruction must be one of {', '.join(INSTRUCTIONS)}; "
                          f"got {body.instruction!r}", "instruction")
    try:
        params = msgspec.json.decode(body.params, type=params_type)
    except msgspec.DecodeError as exc:  # ValidationError included
        fields = ", ".join(params_type.__struct_fields__) or "none"
        raise bad_request(f"params of {body.instruction} must be an object with only the "
                          f"fields it defines ({fields}): {exc}", "params") from None
    request_id = await _call(_handler(request).apply, body.instruction,
                             msgspec.structs.asdict(params))
    return web.json_response({"request_id": request_id, "instruction": body.instruction},
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
    body: InjectBody = decode_json(await read_body(request), InjectBody)
    if body.kind not in FAULT_KINDS:
        raise bad_request(f"kind must be one of {', '.join(FAULT_KINDS)}; got {body.kind!r}",
                          "kind")
    num_engines = max(len(request.app[CLIENT_KEY].engine_statuses()), 1)
    if not 0 <= body.engine < num_engines:
        raise bad_request(f"engine must be in [0, {num_engines}), got {body.engine}", "engine")
    await _call(_handler(request).inject, body.kind, body.engine)
    return web.json_response({"status": "injected", "kind": body.kind, "engine": body.engine})


def add_fault_tolerance_routes(app: web.Application) -> None:
    app.router.add_post("/fault_tolerance/apply", apply_instruction)
    app.router.add_get("/fault_tolerance/status", get_status)
    app.router.add_post("/fault_tolerance/inject", inject_fault)


def set_fault_tolerance_handler(app: web.Application, handler: FaultToleranceHandler) -> None:
    """Install the lead's handler; call before the app starts (aiohttp freezes its state)."""
    app[FT_HANDLER_KEY] = handler
