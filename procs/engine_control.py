"""The engine's control channel, served on its own thread (STYLE.md: control never waits
behind a step).

Heartbeats are answered here directly from ``EngineHealth``, so a sentinel sees a stuck step
as a heartbeat whose ``busy_for_s`` keeps growing. Commands that change the engine (pause,
recover, inject) are queued to the busy loop, which replies when it has carried them out.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import zmq

from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.control import EngineFault, EngineReply, Heartbeat
from bastion.ipc.messages import FailureKind

logger = logging.getLogger(__name__)


class EngineHealth:
    """What the busy loop publishes about itself (read by the control thread).

    NOTE: plain attribute writes of ints/floats/None are atomic under the GIL; nothing here
    needs a lock."""

    RUNNING, PAUSED, FAULTED = "running", "paused", "faulted"

    def __init__(self, epoch: int = 0) -> None:
        self.state = self.PAUSED
        self.epoch = epoch
        self.num_steps = 0
        self.busy_since: float | None = None
        self.fault_info: str | None = None

    @property
    def is_running(self) -> bool:
        return self.state == self.RUNNING

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark a region (a step, a collective) whose duration the hang detector watches."""
        self.busy_since = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None

    def busy_for(self) -> float:
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def set_faulted(self, info: str) -> None:
        self.state, self.fault_info = self.FAULTED, info

    def set_paused(self) -> None:
        self.state = self.PAUSED

    def set_running(self, epoch: int) -> None:
        self.state, self.epoch, self.fault_info, self.num_steps = self.RUNNING, epoch, None, 0


class ControlThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, address: str, health: EngineHealth,
                 loop_inputs: queue.Queue, incarnation: int,
                 dead_worker: Callable[[], str | None] = lambda: None) -> None:
        """``dead_worker``: a message naming a worker process that is gone, else None; asked
        on every heartbeat, so a worker's death is reported even while the loop is idle."""
        super().__init__(daemon=True, name="engine-control")
        self.dead_worker = dead_worker
        self._reported_dead_worker = False
        self.ctx = ctx
        self.address = address
        self.health = health
        self.loop_inputs = loop_inputs
        self.incarnation = incarnation
        self.outbox: queue.Queue[EngineReply | EngineFault] = queue.Queue()

    def _check_workers(self) -> None:
        if self._reported_dead_worker:
            return
        message = self.dead_worker()
        if message is not None:
            self._reported_dead_worker = True
            self.report_fault(FailureKind.PROCESS_EXIT, message)

    def report_fault(self, kind: FailureKind, info: str) -> None:
        self.outbox.put(EngineFault(self.incarnation, self.health.epoch, kind, info))

    def reply(self, seq: int, ok: bool, error: str | None = None,
              kind: FailureKind = FailureKind.NONE) -> None:
        self.outbox.put(self._status(seq, ok, error, kind))

    def _status(self, seq: int, ok: bool = True, error: str | None = None,
                kind: FailureKind = FailureKind.NONE) -> EngineReply:
        h = self.health
        return EngineReply(seq, self.incarnation, ok, error, kind, h.num_steps, h.busy_for(),
                           h.epoch, h.is_running)

    def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        sock.send_multipart(encode(self._status(0)))  # announce ourselves
        while True:
            while not self.outbox.empty():
                sock.send_multipart(encode(self.outbox.get_nowait()))
            if not sock.poll(20):
                continue
            kind, msg = decode(sock.recv_multipart())
            if kind != MsgKind.CONTROL:
                continue
            if isinstance(msg, Heartbeat):
                sock.send_multipart(encode(self._status(msg.seq)))
                self._check_workers()
            else:
                self.loop_inputs.put((MsgKind.CONTROL, msg))
