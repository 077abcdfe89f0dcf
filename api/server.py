"""The aiohttp application: routes, middlewares and the runner the launcher starts.

``build_app(client, config)`` wires everything against an ``EngineClient``; ``start_server``
runs it with handler cancellation on, so a client that disconnects from a non-streamed request
cancels its handler and the engine request is aborted, and with the connection limits of
api/connections.py.
"""

from __future__ import annotations

import socket
import time

from aiohttp import web

from bastion import __version__
from bastion.api.auth import auth_middleware
from bastion.api.chat import create_chat_completion
from bastion.api.completions import create_completion
from bastion.api.config import (
    CLIENT_KEY,
    CONFIG_KEY,
    FT_HANDLER_KEY,
    METRICS_KEY,
    MODEL_NAME_KEY,
    MODEL_NAMES_KEY,
    STATE_KEY,
    ApiConfig,
    ServerState,
)
from bastion.api.connections import serve
from bastion.api.engine_protocol import EngineClient
from bastion.api.errors import error_body, error_middleware
from bastion.api.fault_tolerance import (
    FaultToleranceHandler,
    add_fault_tolerance_routes,
    set_fault_tolerance_handler,
)
from bastion.api.lora import add_lora_routes, model_entries
from bastion.api.metrics import CONTENT_TYPE, ApiMetrics
from bastion.api.openapi import openapi_document
from bastion.api.tokenize import detokenize, tokenize

_STARTED_KEY = web.AppKey("bastion_started", int)


async def list_models(request: web.Request) -> web.Response:
    root = request.app[MODEL_NAME_KEY]
    created = request.app[_STARTED_KEY]
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": created,
        "owned_by": "bastion", "root": root,
        "max_model_len": request.app[CLIENT_KEY].max_model_len}
        for name in request.app[MODEL_NAMES_KEY]] + model_entries(request.app, created, root)})


async def health(request: web.Request) -> web.Response:
    client = request.app[CLIENT_KEY]
    if request.app[STATE_KEY].is_draining:
        body = error_body(503, "The server is shutting down", None, "server_draining")
        return web.json_response(body, status=503)
    if client.is_ready():
        return web.json_response({"status": "ok"})
    states = ", ".join(f"engine {s.engine_id}: {s.state.name.lower()}"
                       for s in client.engine_statuses()) or "no engine reported yet"
    body = error_body(503, f"Not every engine is healthy ({states})", None, "engine_unavailable")
    return web.json_response(body, status=503, headers={"Retry-After": "1"})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[CONFIG_KEY],
                                              request.app[MODEL_NAME_KEY]))


def build_app(client: EngineClient, config: ApiConfig,
              ft_handler: FaultToleranceHandler | None = None) -> web.Application:
    """The whole HTTP surface. ``app[METRICS_KEY]`` is the ``ApiMetrics``, whose
    ``observe_scheduler_stats`` the engine client may call on every stats report;
    ``app[STATE_KEY].is_draining = True`` makes new requests and ``/health`` answer 503."""
    app = web.Application(middlewares=[error_middleware, auth_middleware],
                          client_max_size=config.max_body_bytes)
    model_name = config.served_model_name or client.model_name
    app[CONFIG_KEY] = config
    app[CLIENT_KEY] = client
    app[MODEL_NAME_KEY] = model_name
    app[MODEL_NAMES_KEY] = (model_name, *config.model_aliases)
    app[METRICS_KEY] = ApiMetrics(client, model_name, config.metrics_prefix)
    app[FT_HANDLER_KEY] = None
    app[STATE_KEY] = ServerState()
    app[_STARTED_KEY] = int(time.time())
    if ft_handler is not None:
        set_fault_tolerance_handler(app, ft_handler)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    add_fault_tolerance_routes(app)
    add_lora_routes(app, config.enable_lora)
    return app


async def start_server(app: web.Application, config: ApiConfig, handle_signals: bool = False,
                       sock: socket.socket | None = None) -> web.AppRunner:
    """Serve on ``sock`` (bound, not listening) or else bind ``config.host:config.port``, with
    the connection limits and timeouts of ``config`` (api/connections.py);
    ``await runner.cleanup()`` stops it."""
    return await serve(app, config, handle_signals, sock)


__all__ = ["CONFIG_KEY", "STATE_KEY", "ApiConfig", "ServerState", "build_app",
           "set_fault_tolerance_handler", "start_server"]
