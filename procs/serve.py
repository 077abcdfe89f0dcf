"""``bastion serve``: the API process (``bastion::api``) and the life of the whole server.

Start-up: check the flags and bind the port (a user error ends here, in a second, before
anything loads; the bound port is held until HTTP serves on it), resolve the model and tokenizer, start the engine processes (each
starts its workers), then serve HTTP on uvloop. SIGTERM/SIGINT: stop admitting, drain in-flight requests
up to ``--drain-timeout``, stop the engines, exit 0; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import signal
import socket
import time

from aiohttp import web

from bastion import envs
from bastion.api.config import ApiConfig
from bastion.core.config import EngineConfig, build_engine_config
from bastion.core.loader import (
    ResolvedModel,
    get_max_model_len,
    load_generation_defaults,
    load_tokenizer,
    resolve_model,
)
from bastion.core.loader.embedded import EMBEDDED_HF_ID, EMBEDDED_NAME
from bastion.procs.engine_client import AsyncEngineClient
from bastion.procs.lifecycle import make_runtime_dir, remove_runtime_dir, set_process_title
from bastion.procs.logs import setup_logging
from bastion.procs.sd_notify import Notifier, ping_watchdog

logger = logging.getLogger("bastion.serve")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=envs.get("BASTION_API_KEY"))
    parser.add_argument("--admin-key", default=envs.get("BASTION_ADMIN_KEY"))
    parser.add_argument("--enable-fault-injection", action="store_true")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish on SIGTERM")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--metrics-prefix", default="bastion",
                        help="prefix of the /metrics series; vllm serves vLLM's names "
                             "(vllm:num_requests_waiting, ...) for its dashboards")
    parser.add_argument("--http-header-timeout", type=float, default=10.0,
                        help="seconds a connection may take to send a complete request head, "
                             "from its opening or its previous response; idle keep-alive "
                             "connections close after as long (0: never)")
    parser.add_argument("--http-idle-timeout", type=float, default=60.0,
                        help="seconds a request may go without progress while its body is "
                             "read or its response written, before it is dropped (0: never)")
    parser.add_argument("--max-connections", type=int, default=1000,
                        help="open HTTP connections at most; more get 503 at once")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let tool_choice "auto" parse the model\'s tool calls (needs '
                             "--tool-call-parser)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes; "
                             "SmolLM2 with configs/chat_templates/"
                             "tool_chat_template_smollm2_hermes.jinja) or llama3_json")
    parser.add_argument("--reasoning-parser", default=None,
                        help="move <think>...</think> into reasoning_content: qwen3 or "
                             "deepseek_r1")


def cmd_serve(args: argparse.Namespace) -> int:
    from bastion.procs.args import UserError, engine_kwargs, no_effect_notes

    setup_logging(args.log_level)
    for note in no_effect_notes(args):
        logger.info(note)
    set_process_title("bastion::api")
    config = build_engine_config("serve", **engine_kwargs(args))
    api_config = ApiConfig(host=args.host, port=args.port, api_key=args.api_key,
                           admin_key=args.admin_key, metrics_prefix=args.metrics_prefix,
                           enable_fault_injection=args.enable_fault_injection,
                           enable_lora=config.lora.enable_lora,
                           http_header_timeout_s=args.http_header_timeout,
                           http_idle_timeout_s=args.http_idle_timeout,
                           max_connections=args.max_connections,
                           enable_auto_tool_choice=args.enable_auto_tool_choice,
                           tool_call_parser=args.tool_call_parser,
                           reasoning_parser=args.reasoning_parser)
    error = lora_modules_error(config.lora.lora_modules)
    if error is not None:
        raise UserError(error)
    sock = reserve_port(args.host, args.port)
    if isinstance(sock, str):
        raise UserError(sock)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        logger.warning("uvloop is not installed; using asyncio's default loop")
    return asyncio.run(Server(args, config, api_config, sock).run())


def lora_modules_error(values: tuple[str, ...]) -> str | None:
    """Why ``--lora-modules`` cannot be loaded as given (before the model loads), or None."""
    from bastion.api.lora import parse_lora_modules

    try:
        modules = parse_lora_modules(values)
    except ValueError as exc:
        return str(exc)
    for name, path in modules:
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return f"--lora-modules {name}={path}: no adapter_config.json in {path}"
    return None


def reserve_port(host: str, port: int) -> socket.socket | str:
    """A socket bound to ``host:port`` and not yet listening, held from before the model loads
    until the API serves on it; or why the address cannot be served (taken, or not ours).

    NOTE: bound before anything else starts, as vLLM does: a port merely checked here could be
    taken while the model loads (an ephemeral port of one of the server's own connections, say)
    and the bind after loading would fail. Until ``listen`` a client's connect is refused, as
    when nothing is bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host!r} is not an address of this machine ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    # As aiohttp binds: SO_REUSEADDR, so a port in TIME_WAIT counts as free.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return (f"port {port} on {host} is already in use (another server?); "
                    "stop it or pick another --port")
        return f"cannot listen on {host}:{port}: {exc.strerror}"
    return sock


def served_model_names(config: EngineConfig, resolved: ResolvedModel) -> tuple[str, ...]:
    """The names clients may send as ``model``, the one answers carry first.

    ``--served-model-name`` when given; else the model's file or folder name, with the path
    as given (vLLM's default name) as an alias. The embedded model is SmolLM2-135M-Instruct,
    also under its GGUF file name (bastion's earlier name) and its Hugging Face id."""
    if config.model.served_model_name:
        return config.model.served_model_name
    if config.model.model is None:
        names = (EMBEDDED_NAME, os.path.basename(resolved.path), EMBEDDED_HF_ID)
    else:
        names = (os.path.basename(os.path.normpath(resolved.path)), config.model.model)
    return tuple(dict.fromkeys(names))


class Server:
    def __init__(self, args: argparse.Namespace, config: EngineConfig,
                 api_config: ApiConfig, sock: socket.socket) -> None:
        self.args = args
        self.sock = sock
        self.config = config
        self.api_config = api_config
        # Children must not inherit NOTIFY_SOCKET: only this process speaks to systemd.
        self.notifier = Notifier(unset_environment=True)
        self.stop_event = asyncio.Event()
        self.num_signals = 0
        self.exit_code = 0

    def _on_signal(self, signum: int) -> None:
        self.num_signals += 1
        if self.num_signals == 1:
            logger.info("received %s: draining", signal.Signals(signum).name)
            self.stop_event.set()
        else:
            logger.warning("second signal: stopping now")
            self.force_stop = True
            self.stop_event.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.force_stop = False
        t0 = time.perf_counter()
        watchdog = loop.create_task(ping_watchdog(self.notifier, self._is_making_progress))
        self.notifier.status("loading")
        config = self.config
        resolved = resolve_model(config.model)
        max_model_len = get_max_model_len(resolved.hf_config, config.model.max_model_len)
        tokenizer = load_tokenizer(config.model, resolved)
        self.model_names = served_model_names(config, resolved)
        self.generation_defaults = load_generation_defaults(config.model, resolved)
        model_name = self.model_names[0]
        runtime_dir = make_runtime_dir()
        client = AsyncEngineClient(config, tokenizer, model_name, max_model_len,
                                   tokenizer.eos_token_id, runtime_dir)
        self.client = client
        runner = None
        try:
            # NOTE: spawn from the main thread: a child's parent-death signal fires when the
            # *thread* that forked it exits, so a pool thread would doom the sentinels.
            client.start(self.args.startup_timeout)
            client.start_output_loop()
            if not await client.wait_until_healthy(self.args.startup_timeout):
                raise RuntimeError("the engine group did not become healthy")
            logger.info("engines ready in %.1f s", time.perf_counter() - t0)
            app = self._build_app(client)
            await self._load_lora_modules(app)
            from bastion.api.server import CONFIG_KEY, start_server

            runner = await start_server(app, app[CONFIG_KEY], sock=self.sock)
            logger.info("serving %s on http://%s:%d", model_name, self.args.host, self.args.port)
            self.notifier.ready()
            self.notifier.status("serving")
            await self._wait_until_stopped(client, app)
        except BaseException:
            self.exit_code = 1
            raise
        finally:
            watchdog.cancel()
            self.notifier.stopping()
            if runner is not None:
                await runner.cleanup()
            self.sock.close()
            await client.shutdown()
            remove_runtime_dir(runtime_dir)
            logger.info("stopped (exit code %d)", self.exit_code)
        return self.exit_code

    def _is_making_progress(self) -> bool:
        client = getattr(self, "client", None)
        # A hung engine keeps its process alive, so liveness is not enough: ping while the
        # group is healthy or a recovery is under way, not while it sits faulted.
        if client is None:
            return True
        return client.children_alive() and client.fatal is None and client.is_progressing()

    async def _load_lora_modules(self, app: web.Application) -> None:
        from bastion.api.errors import ApiError
        from bastion.api.lora import load_adapter, parse_lora_modules
        from bastion.procs.args import UserError

        for name, path in parse_lora_modules(self.config.lora.lora_modules):
            try:
                await load_adapter(app, name, path)
            except ApiError as exc:
                raise UserError(f"--lora-modules {name}={path}: {exc}") from None

    def _build_app(self, client: AsyncEngineClient) -> web.Application:
        from bastion.api.server import build_app

        api_config = dataclasses.replace(self.api_config, served_model_name=client.model_name,
                                         model_aliases=self.model_names[1:],
                                         generation_defaults=self.generation_defaults)
        app = build_app(client, api_config, ft_handler=client)
        from bastion.api.server import METRICS_KEY

        metrics = app[METRICS_KEY]
        metrics.set_cache_config(self.config.cache)
        if self.config.lora.enable_lora:
            metrics.set_lora_config(self.config.lora.max_loras)
        client.on_stats = metrics.observe_scheduler_stats
        client.on_status = metrics.observe_statuses
        return app

    def _phase(self, client: AsyncEngineClient) -> str:
        states = {s.state.name.lower() for s in client.engine_statuses()}
        for phase in ("dead", "recovering", "unhealthy", "starting"):
            if phase in states:
                return phase
        return "serving"

    async def _wait_until_stopped(self, client: AsyncEngineClient, app: web.Application) -> None:
        phase = "serving"
        while not self.stop_event.is_set():
            try:
                await asyncio.wait_for(self.stop_event.wait(), timeout=0.25)
            except TimeoutError:
                pass
            if self._phase(client) != phase:
                phase = self._phase(client)
                self.notifier.status(phase)
                logger.info("status: %s", phase)
            if client.fatal is not None or not client.children_alive():
                logger.error("the engine group cannot be recovered (%s); exiting",
                             client.fatal or "a sentinel process died")
                self.exit_code = 1
                return
        from bastion.api.server import STATE_KEY

        app[STATE_KEY].is_draining = True
        self.notifier.status("draining")
        deadline = time.monotonic() + self.args.drain_timeout
        while client.num_unfinished and time.monotonic() < deadline and not self.force_stop:
            await asyncio.sleep(0.05)
