"""The systemd notification protocol (``sd_notify(3)``), without python-systemd.

systemd passes ``NOTIFY_SOCKET`` (a filesystem path, or ``@name`` for an abstract socket) to a
``Type=notify`` service; the service sends newline-separated ``KEY=value`` assignments as one
datagram per call. With ``WatchdogSec=`` set, systemd also passes ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``), and kills the service when ``WATCHDOG=1`` stops arriving for that long.

Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op, so ``bastion serve`` runs the same
in a terminal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping

logger = logging.getLogger(__name__)


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None
                      ) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``WATCHDOG_USEC`` (as systemd advises), or
    ``None`` when the watchdog is off or meant for another process (``WATCHDOG_PID``)."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    watchdog_pid = env.get("WATCHDOG_PID")
    if watchdog_pid:
        try:
            if int(watchdog_pid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return usec / 2 / 1e6


def _socket_address(value: str) -> str | None:
    """``NOTIFY_SOCKET`` value -> AF_UNIX address; ``None`` for kinds we do not speak."""
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # e.g. ``vsock:`` (VMs); systemd does not hand that to ordinary services


class Notifier:
    """Sends state changes to systemd; a no-op when not started by a ``Type=notify`` unit.

    ``NOTIFY_SOCKET`` is read once, here. ``unset_environment`` removes it (and the watchdog
    variables) from ``os.environ`` so that child processes do not try to notify for us.
    Sending never raises: a lost notification must not take the server down, so failures are
    logged once and reported as ``False``.
    """

    def __init__(self, env: MutableMapping[str, str] | None = None,
                 unset_environment: bool = False) -> None:
        env = os.environ if env is None else env
        value = env.get("NOTIFY_SOCKET", "")
        self.address = _socket_address(value) if value else None
        if value and self.address is None:
            logger.warning("NOTIFY_SOCKET=%s is not a unix socket path; not notifying systemd",
                           value)
        self.watchdog_interval = watchdog_interval(env)
        if unset_environment:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(key, None)
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def is_enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` assignments in one datagram. True if systemd got it."""
        if self.address is None:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                # NOTE: non-blocking: a unix datagram queue holds 10 messages by default
                # (net.unix.max_dgram_qlen), and a reader that stops reading (a stalled
                # systemd, a test) would otherwise block the event loop inside sendto.
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            self._sock.sendto(message, self.address)
            return True
        except OSError as e:
            if not self._warned:
                logger.warning("could not notify systemd at %s: %s", self.address, e)
                self._warned = True
            return False

    def ready(self, status: str | None = None) -> bool:
        """Start-up finished: ``systemctl start`` returns and dependants start."""
        return self.notify("READY=1", *self._status(status))

    def status(self, status: str) -> bool:
        """Free-form one-line state shown by ``systemctl status``."""
        return self.notify(*self._status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown (the drain) began."""
        return self.notify("STOPPING=1", *self._status(status))

    def mainpid(self, pid: int) -> bool:
        return self.notify(f"MAINPID={pid}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start (or stop) timeout fires: long model loads
        and long drains report progress this way instead of needing huge unit timeouts."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @staticmethod
    def _status(status: str | None) -> list[str]:
        # NOTE: one assignment per line; a newline inside STATUS would start a bogus one.
        return [] if status is None else ["STATUS=" + " ".join(status.splitlines())]


async def ping_watchdog(notifier: Notifier, is_alive: Callable[[], bool] | None = None) -> None:
    """Send ``WATCHDOG=1`` every ``notifier.watchdog_interval`` seconds while ``is_alive()``
    holds; returns at once when the watchdog is off.

    Run it as a task on the API event loop: a stuck loop stops the pings, and systemd restarts
    the service. ``is_alive`` lets the caller stop pinging when it knows it is wedged.
    """
    interval = notifier.watchdog_interval
    if interval is None or not notifier.is_enabled:
        return
    while True:
        if is_alive is None or is_alive():
            notifier.watchdog()
        await asyncio.sleep(interval)
