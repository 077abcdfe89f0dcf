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
from dataclasses import dataclass

import msgspec
import zmq

from bastion.core.config import ConfigError
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

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps."""
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


class Spares:
    """Children started ahead of need: past interpreter start, imports (and, on a GPU, device
    initialisation), each waiting for its HANDSHAKE on one shared address. ``promote`` hands
    every one its launch at once (the ranks of a group must start together) and waits for
    READY; until then they cost memory, no CPU.

    NOTE: spawn (and so create) them on a thread that lives as long as they must: a child's
    parent-death signal fires when the thread that forked it exits."""

    def __init__(self, ctx: zmq.Context, address: str, role: str,
                 settings: dict[int, SpareSettings]) -> None:
        self.server = HandshakeServer(ctx, address)
        self.children = [spawn_child(role, rank, f"bastion::spare-{s.title.split('::')[-1]}",
                                     address, spare=s) for rank, s in settings.items()]
        self.started_at = time.monotonic()

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.children)

    def promote(self, infos: dict[int, HandshakeInfo], timeout_s: float) -> dict[int, Ready]:
        try:
            return self.server.run(self.children, infos, timeout_s)
        finally:
            self.server.close()

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
            if not poller.poll(min(remaining, 0.2) * 1000):
                # NOTE: only once nothing is pending: a child that failed sent its FAILURE
                # before it exited, and that message says more than its exit code.
                for child in children:
                    if child.rank not in ready and not child.is_alive():
                        raise StartupError(f"{child.title} exited with code "
                                           f"{child.proc.returncode} during start-up (see its "
                                           "log above)")
                continue
            identity, *frames = self.socket.recv_multipart()
            kind, msg = decode(frames)
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
                    raise ConfigError(msg.message)
                raise StartupError(f"{name} failed to start: {msg.message}")
        return ready

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)


def child_handshake(ctx: zmq.Context, address: str, role: str, rank: int,
                    timeout_s: float | None = 60.0) -> tuple[zmq.Socket, HandshakeInfo]:
    """The child's side: say HELLO, receive what to run and where (a spare: whenever it is
    promoted, ``timeout_s=None``)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send_multipart(encode(Hello(role, rank, os.getpid())))
    if not sock.poll(None if timeout_s is None else timeout_s * 1000):
        raise StartupError(f"{role}-{rank}: no handshake reply from the parent")
    kind, msg = decode(sock.recv_multipart())
    assert kind == MsgKind.HANDSHAKE and isinstance(msg, HandshakeInfo)
    return sock, msg


def encode_config(config: object) -> bytes:
    return msgspec.json.encode(config)
