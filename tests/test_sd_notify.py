"""systemd integration of the daemon: sd_notify datagrams on a test-owned socket, and the
journald-friendly log format and progress reporting (procs/logs.py)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import socket
import tempfile
import uuid

import pytest

from bastion.core.progress import progress
from bastion.procs.logs import setup_logging
from bastion.procs.sd_notify import Notifier, ping_watchdog, watchdog_interval


@pytest.fixture
def notify_socket():
    """A datagram socket like the one systemd listens on; yields (socket, NOTIFY_SOCKET)."""
    # A short directory: unix socket paths are limited to 108 bytes.
    folder = tempfile.mkdtemp(prefix="bsd")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()
    os.unlink(path)
    os.rmdir(folder)


def receive_all(sock: socket.socket) -> list[bytes]:
    sock.setblocking(False)
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096))
        except BlockingIOError:
            return messages


def test_messages_arrive_in_order(notify_socket):
    sock, path = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.is_enabled
    assert notifier.ready("serving SmolLM2 on :8000")
    assert notifier.status("recovering\nengine 1")
    assert notifier.watchdog()
    assert notifier.mainpid(4242)
    assert notifier.extend_timeout(2.5)
    assert notifier.stopping("draining 3 requests")
    notifier.close()
    assert receive_all(sock) == [
        b"READY=1\nSTATUS=serving SmolLM2 on :8000",
        b"STATUS=recovering engine 1",  # a newline would start a bogus assignment
        b"WATCHDOG=1",
        b"MAINPID=4242",
        b"EXTEND_TIMEOUT_USEC=2500000",
        b"STOPPING=1\nSTATUS=draining 3 requests",
    ]


def test_abstract_socket():
    name = f"bastion-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_no_socket_is_a_no_op():
    notifier = Notifier({})
    assert not notifier.is_enabled
    assert not notifier.ready("x") and not notifier.watchdog() and not notifier.stopping()
    assert notifier._sock is None  # not even a socket was created
    assert notifier.watchdog_interval is None


def test_socket_gone_does_not_raise():
    notifier = Notifier({"NOTIFY_SOCKET": "/nonexistent/bastion/notify"})
    assert notifier.is_enabled
    assert notifier.ready() is False


def test_unset_environment_hides_socket_from_children(notify_socket):
    sock, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid()),
           "OTHER": "kept"}
    notifier = Notifier(env, unset_environment=True)
    assert env == {"OTHER": "kept"}
    assert notifier.watchdog_interval == 0.5
    assert notifier.ready()
    assert sock.recv(4096) == b"READY=1"


def test_watchdog_interval():
    pid = os.getpid()
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid)}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval({}) is None


class StopPinging(Exception):
    pass


def run_ping(monkeypatch, notifier: Notifier, num_sleeps: int, is_alive=None) -> list[float]:
    """Run ping_watchdog with a fake clock: returns the sleeps it asked for."""
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == num_sleeps:
            raise StopPinging

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    with pytest.raises(StopPinging):
        asyncio.run(ping_watchdog(notifier, is_alive))
    return sleeps


def test_ping_watchdog_at_half_the_period(notify_socket, monkeypatch):
    sock, path = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
    assert run_ping(monkeypatch, notifier, 3) == [0.05, 0.05, 0.05]
    assert receive_all(sock) == [b"WATCHDOG=1"] * 3
    alive = iter([True, False, True])
    assert run_ping(monkeypatch, notifier, 3, is_alive=lambda: next(alive)) == [0.05] * 3
    assert receive_all(sock) == [b"WATCHDOG=1"] * 2  # none while not alive


def test_ping_watchdog_returns_when_watchdog_off(notify_socket):
    _, path = notify_socket
    asyncio.run(asyncio.wait_for(ping_watchdog(Notifier({"NOTIFY_SOCKET": path})), 1.0))


# ----------------------------------------------------------------------------- logging


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_plain_format_outside_journald(monkeypatch, restore_root_logger):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    stream = io.StringIO()
    setup_logging("info", stream)
    setup_logging("info", stream)  # idempotent: still one line per record
    logging.getLogger("bastion.test").info("engine 0 ready in %.1f s", 1.25)
    logging.getLogger("bastion.test").debug("hidden")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO bastion\.test: "
                        r"engine 0 ready in 1\.2 s", lines[0]), lines[0]


def test_journal_format_with_priorities(monkeypatch, restore_root_logger, tmp_path):
    with open(tmp_path / "journal", "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        setup_logging("DEBUG", stream)
        log = logging.getLogger("bastion.test")
        log.debug("d")
        log.info("i")
        log.warning("w")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("engine 1 died")
        log.critical("c")
    lines = (tmp_path / "journal").read_text().splitlines()
    assert lines[:3] == ["<7>bastion.test: d", "<6>bastion.test: i", "<4>bastion.test: w"]
    assert lines[3] == "<3>bastion.test: engine 1 died"
    traceback_lines = lines[4:-1]
    assert traceback_lines[0] == "<3>Traceback (most recent call last):"
    assert traceback_lines[-1] == "<3>RuntimeError: boom"
    assert all(line.startswith("<3>") for line in traceback_lines)
    assert lines[-1] == "<2>bastion.test: c"


def test_journal_stream_of_another_file_is_ignored(monkeypatch, restore_root_logger, tmp_path):
    with open(tmp_path / "other", "w") as other, open(tmp_path / "log", "w") as stream:
        st = os.fstat(other.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        setup_logging("INFO", stream)
        logging.getLogger("bastion.test").info("hello")
    line = (tmp_path / "log").read_text()
    assert not line.startswith("<") and line.endswith(" INFO bastion.test: hello\n")


def test_progress_logs_three_lines_without_a_tty(caplog):
    caplog.set_level(logging.INFO, logger="bastion")
    assert list(progress(iter(range(10)), total=10, desc="loading weights")) == list(range(10))
    messages = [r.getMessage() for r in caplog.records if r.name == "bastion"]
    assert messages[:2] == ["loading weights: started (10 items)", "loading weights: 50% (5/10)"]
    assert re.fullmatch(r"loading weights: done, 10 items in \d+\.\d\d s", messages[2])
    assert len(messages) == 3


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_tty(caplog):
    caplog.set_level(logging.INFO, logger="bastion")
    stream = FakeTTY()
    assert list(progress(range(4), desc="capture", stream=stream)) == [0, 1, 2, 3]
    out = stream.getvalue()
    assert out.startswith("\rcapture [" + "." * 30 + "] 0/4 ")
    last = out.rstrip("\n").split("\r")[-1]
    assert re.fullmatch(r"capture \[#{30}\] 4/4 \d+\.\ds", last), last
    assert out.endswith("\n")
    assert not [r for r in caplog.records if r.name == "bastion"]
