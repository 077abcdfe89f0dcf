"""HTTP connection hygiene: a bound on open connections, timeouts for slow or idle clients,
and one rate-limited log line for malformed HTTP instead of a traceback per request.

``serve(app, config)`` binds the app with all of it; the API launcher and the tests use it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web

from bastion.api.config import ApiConfig

T = TypeVar("T")

# aiohttp logs every unparsable request ("Error handling request", with a traceback) to the
# logger it is given; this one reaches the journal through ``RateLimitFilter``.
protocol_logger = logging.getLogger("bastion.api.http")

_BUSY_BODY = (b'{"error": {"message": "Too many open connections; retry later", '
              b'"type": "ServiceUnavailableError", "param": null, "code": "too_many_connections"}}')
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                  + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class RateLimitFilter(logging.Filter):
    """Lets one record through per ``interval_s``, without its traceback, and says how many it
    held back since the last one: a client sending garbage in a loop costs one line a minute."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._next_at = 0.0
        self.num_suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now < self._next_at:
            self.num_suppressed += 1
            return False
        self._next_at = now + self.interval_s
        reason = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if reason is not None:
            message += f": {type(reason).__name__}: {' '.join(str(reason).split())[:200]}"
        if self.num_suppressed:
            message += f" ({self.num_suppressed} more like it suppressed)"
        self.num_suppressed = 0
        record.msg, record.args = message, None
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


if not any(isinstance(f, RateLimitFilter) for f in protocol_logger.filters):
    protocol_logger.addFilter(RateLimitFilter())


class _Refuse(asyncio.Protocol):
    """What a connection past ``max_connections`` gets: a 503 and a close, before any read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_BUSY_RESPONSE)  # type: ignore[attr-defined]  # a stream transport
        transport.close()


class BoundedTCPSite(web.TCPSite):
    """A ``TCPSite`` that answers connections beyond ``max_connections`` with a 503."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 max_connections: int, sock: socket.socket | None = None) -> None:
        super().__init__(runner, host, port)
        self.max_connections = max_connections
        self._sock = sock

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.Protocol:
            if len(server.connections) >= self.max_connections:
                protocol_logger.warning("refusing a connection: %d are open (--max-connections)",
                                        len(server.connections))
                return _Refuse()
            return server()

        loop = asyncio.get_running_loop()
        if self._sock is not None:
            self._server = await loop.create_server(protocol, sock=self._sock,
                                                    backlog=self._backlog)
        else:
            self._server = await loop.create_server(protocol, self._host, self._port,
                                                    backlog=self._backlog)


async def serve(app: web.Application, config: ApiConfig, handle_signals: bool = False,
                sock: socket.socket | None = None) -> web.AppRunner:
    """Serve on ``sock`` (bound, not yet listening) or else bind ``config.host:config.port``;
    ``await runner.cleanup()`` stops it.

    NOTE: handler_cancellation=True is what turns a client disconnect during a non-streamed
    request into a CancelledError in its handler, and so into an engine abort.
    """
    runner = web.AppRunner(
        app, handle_signals=handle_signals, access_log=None, handler_cancellation=True,
        logger=protocol_logger,
        # aiohttp's keep-alive timer runs from a connection's opening and from the end of each
        # response until the next request head is complete, so it bounds a slow head as much
        # as an idle connection (its own default is an hour).
        keepalive_timeout=config.http_header_timeout_s)
    await runner.setup()
    await BoundedTCPSite(runner, config.host, config.port, config.max_connections,
                         sock).start()
    return runner


async def with_idle_timeout(awaitable: Awaitable[T], config: ApiConfig, what: str) -> T:
    """Await a read of the body or a write to the client, which a stalled peer could hold up
    forever; past ``http_idle_timeout_s`` without progress it raises ``TimeoutError``."""
    timeout = config.http_idle_timeout_s or None
    try:
        if sys.version_info >= (3, 11):
            # NOTE: asyncio.timeout, not wait_for: this wraps every chunk of every stream, and
            # wait_for starts a task per call before Python 3.12.
            async with asyncio.timeout(timeout):
                return await awaitable
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"the client made no progress {what} for {timeout:g} s") from None
