"""A sentinel's handle on its engine process: start it, watch it, command it, restart it."""

from __future__ import annotations

import itertools
import logging
import time

import zmq

from bastion.core.config import EngineConfig
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.messages import ControlReply, ControlRequest, HandshakeInfo
from bastion.procs.lifecycle import Child, HandshakeServer, encode_config, ipc_address, spawn_child

logger = logging.getLogger(__name__)


class EngineHandle:
    """Owns the engine child process and the sentinel end of its control channel."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig, engine_id: int,
                 api_addresses: dict[str, str], runtime_dir: str) -> None:
        self.ctx = ctx
        self.config = config
        self.engine_id = engine_id
        self.api_addresses = api_addresses
        self.runtime_dir = runtime_dir
        self.control_address = ipc_address(runtime_dir, f"engine{engine_id}-control")
        self.control = ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(self.control_address)
        self.peer_identity: bytes | None = None
        self.child: Child | None = None
        self._seq = itertools.count(1)
        self.last_reply: ControlReply | None = None
        self.last_reply_time = 0.0
        self.pending_faults: list[str] = []
        self.num_blocks: int | None = None  # measured at the first start, reused on restarts

    # ------------------------------------------------------------------------ lifecycle

    def start(self, epoch: int, start_paused: bool, timeout_s: float) -> None:
        """Spawn the engine (it spawns its workers) and wait for READY."""
        handshake = HandshakeServer(self.ctx, ipc_address(
            self.runtime_dir, f"engine{self.engine_id}-hs-{epoch}-{time.monotonic_ns()}"))
        addresses = {**self.api_addresses, "control": self.control_address,
                     "runtime_dir": self.runtime_dir, "epoch": str(epoch),
                     "start_paused": "1" if start_paused else "0",
                     "num_blocks": str(self.num_blocks or "")}
        info = HandshakeInfo(encode_config(self.config), addresses, self.engine_id)
        self.child = spawn_child("engine", self.engine_id, f"bastion::engine-{self.engine_id}",
                                 handshake.address)
        self.peer_identity = None
        try:
            ready = handshake.run([self.child], {self.engine_id: info}, timeout_s)
        finally:
            handshake.close()
        self.num_blocks = self.num_blocks or ready[self.engine_id].info.get("num_blocks")
        self._await_identity(5.0)
        self.last_reply_time = time.monotonic()

    def _await_identity(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.peer_identity is None and time.monotonic() < deadline:
            self.poll(0.05)
        if self.peer_identity is None:
            raise RuntimeError(f"engine {self.engine_id} did not open its control channel")

    def is_alive(self) -> bool:
        return self.child is not None and self.child.is_alive()

    def exit_code(self) -> int | None:
        return None if self.child is None else self.child.proc.poll()

    def kill(self) -> None:
        """SIGKILL the engine; its workers follow it (they die with their parent)."""
        if self.child is not None and self.child.is_alive():
            self.child.proc.kill()
            self.child.proc.wait()
        time.sleep(0.2)  # let the workers' parent-death signal land before ports are reused

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.child is None:
            return
        if self.child.is_alive() and self.peer_identity is not None:
            self._send(ControlRequest(next(self._seq), "shutdown"))
        try:
            self.child.proc.wait(timeout_s)
        except Exception:
            self.child.kill(timeout=2.0)

    # --------------------------------------------------------------------------- control

    def _send(self, req: ControlRequest) -> None:
        if self.peer_identity is None:
            raise RuntimeError(f"engine {self.engine_id} has no control channel")
        self.control.send_multipart([self.peer_identity, *encode(req)])

    def poll(self, timeout_s: float) -> list[ControlReply]:
        """Receive whatever the engine said; unsolicited fault reports are queued."""
        replies = []
        if not self.control.poll(timeout_s * 1000):
            return replies
        while self.control.poll(0):
            identity, *frames = self.control.recv_multipart()
            kind, msg = decode(frames)
            if kind != MsgKind.CONTROL_REPLY:
                continue
            assert isinstance(msg, ControlReply)
            self.peer_identity = identity
            self.last_reply, self.last_reply_time = msg, time.monotonic()
            if msg.seq == -1 and msg.fault_info:
                self.pending_faults.append(msg.fault_info)
            replies.append(msg)
        return replies

    def command(self, command: str, timeout_s: float, **args: object) -> ControlReply:
        """Send a command and wait for its reply; raises ``TimeoutError`` or ``RuntimeError``."""
        seq = next(self._seq)
        self._send(ControlRequest(seq, command, dict(args)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise RuntimeError(f"engine {self.engine_id} exited with code "
                                   f"{self.exit_code()} during {command}")
            for reply in self.poll(0.05):
                if reply.seq == seq:
                    if not reply.ok:
                        raise RuntimeError(f"engine {self.engine_id}: {command}: {reply.error}")
                    return reply
        raise TimeoutError(f"engine {self.engine_id} did not answer {command} "
                           f"within {timeout_s:.0f} s")

    def heartbeat(self) -> None:
        if self.peer_identity is not None and self.is_alive():
            self._send(ControlRequest(next(self._seq), "heartbeat"))

    def busy_for(self) -> float:
        """How long the engine has been inside one step, by its last heartbeat."""
        reply = self.last_reply
        if reply is None:
            return 0.0
        return reply.busy_for_s + (time.monotonic() - self.last_reply_time
                                   if reply.busy_for_s > 0 else 0.0)

    def check(self, hang_timeout_s: float) -> str | None:
        """A fault, if one is visible: a dead process, a report, or a hang."""
        if self.child is not None and not self.child.is_alive():
            return f"engine {self.engine_id} process exited with code {self.exit_code()}"
        if self.pending_faults:
            return self.pending_faults.pop(0)
        now = time.monotonic()
        if now - self.last_reply_time > hang_timeout_s:
            return f"engine {self.engine_id} stopped answering heartbeats (hang)"
        reply = self.last_reply
        if reply is not None and reply.busy_for_s > hang_timeout_s:
            return (f"engine {self.engine_id} made no progress for {reply.busy_for_s:.1f} s "
                    "(hang: a step or collective is stuck)")
        return None

    def close(self) -> None:
        self.control.close(linger=0)
