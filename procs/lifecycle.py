"""Process plumbing shared by every role: titles, dying with the parent, spawning children and
the HELLO / HANDSHAKE / READY start-up protocol."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.control import HandshakeInfo
from bastion.ipc.messages import Failure, Hello, Ready

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A child failed to start; the message names the child."""


def set_process_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # the title is cosmetic; never fail start-up over it
        pass


def exit_now(code: int) -> None:
    """End the process once its work is done: logs and stdio flushed, then ``os._exit``,
    without the interpreter's teardown (about 0.5 s with torch loaded, paid by every process
    on every stop and restart, one after the other down the process tree). Nothing is lost
    that a normal exit keeps: pyzmq does not flush unsent messages at interpreter exit either."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when the parent dies; a watcher thread covers the race
    where the parent died before the request took effect (and non-Linux systems)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def make_runtime_dir() -> str:
    """A private (0700) directory for this server's ipc:// sockets."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    # NOTE: a unix socket path is at most 107 bytes; our names add about 40 to the directory.
    if base and (not os.access(base, os.W_OK) or len(base) > 60):
        base = None
    path = tempfile.mkdtemp(prefix="bastion-", dir=base)
    os.chmod(path, 0o700)
    return path


def remove_runtime_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def ipc_address(runtime_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(runtime_dir, name)}"


@dataclass
class Child:
    role: str
    rank: int
    title: str
    proc: subprocess.Popen

    _exit_fd: int | None = field(default=None, repr=False)

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def exit_fd(self) -> int | None:
        """A file descriptor that becomes readable when the process exits (a pidfd, so a
        poller wakes at the death instead of at its next check), or None where the kernel
        has none."""
        if self._exit_fd is None and hasattr(os, "pidfd_open") and self.proc.poll() is None:
            try:
                self._exit_fd = os.pidfd_open(self.proc.pid)
            except OSError:
                return None
        return self._exit_fd

    def close_exit_fd(self) -> None:
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None

    def kill(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps."""
        self.close_exit_fd()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn_child(role: str, rank: int, title: str, handshake_address: str,
                env: dict[str, str] | None = None, spare: SpareSettings | None = None) -> Child:
    """Start ``python -m bastion.procs.child``; it says HELLO on ``handshake_address``
    (``spare``: once it has imported its role's modules, then it waits for HANDSHAKE)."""
    cmd = [sys.executable, "-m", "bastion.procs.child", role, str(rank), title,
           handshake_address, str(os.getpid())]
    if spare is not None:
        cmd.append(msgspec.json.encode(spare).decode())
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    return Child(role, rank, title, proc)


class SpareSettings(msgspec.Struct, omit_defaults=True):
    """What a warm spare needs before it knows its launch (the child's last argument)."""

    title: str  # the title it takes once promoted
    device: str = "cpu"
    num_workers: int = 0  # an engine spare starts this many worker spares of its own
    runtime_dir: str = ""
    engine_id: int = 0
    tp_size: int = 1
    # The config it will most likely be launched with: the spare resolves its model ahead
    # (the file's digest, the converted cache, the HF config); the launch's config rules.
    config_json: str = ""
    spawned_at: float = 0.0  # the parent's time.time() at the spawn (the spare logs its age)


class SpareLost(RuntimeError):
    """A spare process exited while it waited."""


class Spares:
    """Children started ahead of need: past interpreter start, imports (and, on a GPU, device
    initialisation), each waiting for its HANDSHAKE on one shared address. A spare is ready
    once it said HELLO (``poll`` reads the HELLOs without answering them). ``promote`` hands
    every one its launch at once (the ranks of a group must start together), waiting for a
    spare still warming up, and waits for READY; until then they cost memory, no CPU.

    NOTE: spawn (and so create) them on a thread that lives as long as they must: a child's
    parent-death signal fires when the thread that forked it exits. Only one thread at a time
    may use a ``Spares`` (its socket): the sentinel's loop polls it, then hands it over."""

    def __init__(self, ctx: zmq.Context, address: str, role: str,
                 settings: dict[int, SpareSettings]) -> None:
        self.server = HandshakeServer(ctx, address)
        self.settings = settings
        self.started_at = time.monotonic()
        self.ready_at: float | None = None  # when ``poll`` first saw every spare warm
        self.waited_s = 0.0  # how long ``promote`` waited for a spare still warming up
        self.children = []
        for rank, s in settings.items():
            s = msgspec.structs.replace(s, spawned_at=time.time())
            self.children.append(spawn_child(role, rank,
                                             f"bastion::spare-{s.title.split('::')[-1]}",
                                             address, spare=s))

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.children)

    def check_alive(self) -> None:
        """Raise ``SpareLost`` naming a spare that exited."""
        for child in self.children:
            if not child.is_alive():
                raise SpareLost(f"{child.title} exited with code {child.proc.returncode}")

    def poll(self) -> bool:
        """True once every spare has said HELLO (is warm)."""
        if self.ready_at is None:
            self.server.poll_hellos()
            if len(self.server.hello_at) == len(self.children):
                self.ready_at = max(self.server.hello_at.values())
        return self.ready_at is not None

    def wait_ready(self) -> None:
        """Block until every spare is warm; ``SpareLost`` if one exits first."""
        while not self.poll():
            self.check_alive()
            self.server.socket.poll(200)

    def promote(self, infos: dict[int, HandshakeInfo], timeout_s: float) -> dict[int, Ready]:
        t0 = time.monotonic()
        try:
            ready = self.server.run(self.children, infos, timeout_s)
        finally:
            self.server.close()
        self.waited_s = max(0.0, max(self.server.hello_at.values(), default=t0) - t0)
        # Promoted, a spare takes its role's title (also in the messages naming it).
        for child in self.children:
            child.title = self.settings[child.rank].title
        return ready

    def kill(self) -> None:
        for child in self.children:
            if child.is_alive():
                child.proc.kill()
                child.proc.wait()
        self.server.close()


class HandshakeServer:
    """The parent's side of start-up: answers each child's HELLO, then waits for READY."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = address
        self.hello_at: dict[int, float] = {}  # rank -> when its HELLO arrived
        self._unanswered: list[tuple[bytes, MsgKind, object]] = []  # read by poll_hellos

    def _recv(self) -> tuple[bytes, MsgKind, object]:
        identity, *frames = self.socket.recv_multipart()
        kind, msg = decode(frames)
        if kind == MsgKind.HELLO:
            self.hello_at.setdefault(msg.rank, time.monotonic())
        return identity, kind, msg

    def poll_hellos(self) -> None:
        """Read what the children sent so far without answering it (``run`` answers)."""
        while not self.socket.closed and self.socket.poll(0):
            self._unanswered.append(self._recv())

    def run(self, children: list[Child], info_for: dict[int, HandshakeInfo],
            timeout_s: float) -> dict[int, Ready]:
        """Drive every child through HELLO -> HANDSHAKE -> READY, or raise naming the child."""
        deadline = time.monotonic() + timeout_s
        by_rank = {c.rank: c for c in children}
        ready: dict[int, Ready] = {}
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while len(ready) < len(children):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [c.title for c in children if c.rank not in ready]
                raise StartupError(f"{', '.join(missing)} did not become ready within "
                                   f"{timeout_s:.0f} s")
            if not self._unanswered and not poller.poll(min(remaining, 0.2) * 1000):
                # NOTE: only once nothing is pending: a child that failed sent its FAILURE
                # before it exited, and that message says more than its exit code.
                for child in children:
                    if child.rank not in ready and not child.is_alive():
                        raise StartupError(f"{child.title} exited with code "
                                           f"{child.proc.returncode} during start-up (see its "
                                           "log above)")
                continue
            identity, kind, msg = (self._unanswered.pop(0) if self._unanswered
                                   else self._recv())
            if kind == MsgKind.HELLO:
                assert isinstance(msg, Hello)
                self.socket.send_multipart([identity, *encode(info_for[msg.rank])])
            elif kind == MsgKind.READY:
                assert isinstance(msg, Ready)
                ready[msg.rank] = msg
            elif kind == MsgKind.FAILURE:
                assert isinstance(msg, Failure)
                name = by_rank[msg.rank].title if msg.rank in by_rank else msg.role
                if msg.is_user_error:
                    # NOTE: imported here: a warm spare spawns its own spares before anything
                    # pulls in torch (bastion.core.config does), so this module stays light.
                    from bastion.core.config import ConfigError

                    raise ConfigError(msg.message)
                raise StartupError(f"{name} failed to start: {msg.message}")
        return ready

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)


def child_handshake(ctx: zmq.Context, address: str, role: str, rank: int,
                    timeout_s: float | None = 60.0,
                    check: Callable[[], None] | None = None) -> tuple[zmq.Socket, HandshakeInfo]:
    """The child's side: say HELLO, receive what to run and where (a spare: whenever it is
    promoted, ``timeout_s=None``). ``check`` runs now and then while it waits (and may raise)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send_multipart(encode(Hello(role, rank, os.getpid())))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not sock.poll(500):
        if check is not None:
            check()
        if deadline is not None and time.monotonic() > deadline:
            raise StartupError(f"{role}-{rank}: no handshake reply from the parent")
    kind, msg = decode(sock.recv_multipart())
    assert kind == MsgKind.HANDSHAKE and isinstance(msg, HandshakeInfo)
    return sock, msg


def encode_config(config: object) -> bytes:
    return msgspec.json.encode(config)
