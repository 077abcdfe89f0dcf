"""Sentinel process (``bastion::sentinel-N``): one per engine; the engine's parent.

It watches its engine (process exit, fault reports, heartbeats that stop or show a stuck
step), tells the coordinator (sentinel 0) about faults, carries out the coordinator's pause
and recover orders on its own engine (restarting it when reinit calls for it), and forwards
the group's status to its API process.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from bastion.core.config import EngineConfig
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.messages import EngineState, HandshakeInfo, PeerMessage, Ready
from bastion.sentinel.coordinator import Coordinator
from bastion.sentinel.engine_handle import EngineHandle
from bastion.sentinel.peers import PeerLink

logger = logging.getLogger(__name__)

_HEARTBEAT_S = 0.25
_STUCK_S = 2.0


class Sentinel:
    def __init__(self, config: EngineConfig, info: HandshakeInfo, ctx: zmq.Context) -> None:
        self.config = config
        self.ft = config.fault_tolerance
        self.rank = info.rank
        self.ctx = ctx
        addrs = info.addresses
        self.engine = EngineHandle(ctx, config, self.rank,
                                   {"input": addrs["input"], "output": addrs["output"]},
                                   addrs["runtime_dir"])
        self.api_status = ctx.socket(zmq.PUSH)
        self.api_status.setsockopt(zmq.LINGER, 1000)
        self.api_status.connect(addrs["status"])
        self.api_cmd = ctx.socket(zmq.PULL)
        self.api_cmd.bind(addrs["cmd"])
        par = config.parallel
        self.peers = PeerLink(ctx, self.rank, par.data_parallel_address, par.data_parallel_rpc_port,
                              par.data_parallel_size)
        self.coordinator = Coordinator(self) if self.rank == 0 else None
        self.fault_reported = False
        self.running = True
        self._last_heartbeat = 0.0

    # ------------------------------------------------------------------------- start-up

    def start(self, handshake: zmq.Socket) -> None:
        t0 = time.perf_counter()
        # The first start loads the model from scratch; the API's own --startup-timeout bounds it.
        self.engine.start(epoch=0, start_paused=False, timeout_s=3600.0)
        handshake.send_multipart(encode(Ready("sentinel", self.rank, os.getpid())))
        if self.coordinator is None:
            self.peers.to_coordinator(PeerMessage("hello", self.rank))
        logger.info("sentinel %d: engine %d started in %.1f s", self.rank, self.rank,
                    time.perf_counter() - t0)

    # ------------------------------------------------------------------------- main loop

    def run(self) -> None:
        while self.running:
            self.pump(0.05)
            now = time.monotonic()
            if now - self._last_heartbeat >= _HEARTBEAT_S:
                self._last_heartbeat = now
                self.engine.heartbeat()
            if not self.fault_reported:
                fault = self.engine.check(self.ft.ft_hang_timeout_s)
                if fault is not None:
                    self.report_fault(fault)
            if self.coordinator is not None:
                self.coordinator.tick()

    def pump(self, timeout_s: float) -> None:
        """Serve every channel once: engine replies, peer messages, API commands."""
        self.engine.poll(0)
        for msg in self.peers.receive(timeout_s):
            self.on_peer(msg)
        while self.api_cmd.poll(0):
            kind, msg = decode(self.api_cmd.recv_multipart())
            if kind == MsgKind.PEER:
                self.on_api(msg)
            elif kind == MsgKind.SHUTDOWN:
                self.running = False

    def report_fault(self, info: str) -> None:
        logger.error("sentinel %d: fault detected: %s", self.rank, info)
        self.fault_reported = True
        msg = PeerMessage("fault", self.rank, info=info)
        if self.coordinator is not None:
            self.coordinator.on_message(msg)
        else:
            self.peers.to_coordinator(msg)

    # ------------------------------------------------------------------------- messages

    def on_peer(self, msg: PeerMessage) -> None:
        if self.coordinator is not None:
            self.coordinator.on_message(msg)
        elif msg.kind == "pause":
            ok, info = self.prepare_local(msg.instruction or "retry", msg.epoch)
            self.peers.to_coordinator(PeerMessage("paused", self.rank, msg.epoch, info, ok=ok))
        elif msg.kind == "recover":
            ok, info = self.recover_local(msg.epoch)
            self.peers.to_coordinator(PeerMessage("recovered", self.rank, msg.epoch, info,
                                                  ok=ok))
        elif msg.kind in ("status", "fatal"):
            self.publish(msg)

    def on_api(self, msg: PeerMessage) -> None:
        if msg.kind == "inject":
            try:
                self.engine.command("inject", 10.0, kind=msg.info)
            except Exception as exc:
                logger.error("sentinel %d: inject failed: %s", self.rank, exc)
        elif msg.kind == "apply":
            msg.sender = self.rank
            if self.coordinator is not None:
                self.coordinator.on_message(msg)
            else:
                self.peers.to_coordinator(msg)

    def publish(self, msg: PeerMessage) -> None:
        """Forward the group's status to this sentinel's API process."""
        if msg.kind == "status" and all(s.state == EngineState.HEALTHY for s in msg.statuses):
            self.fault_reported = False
            self.engine.pending_faults.clear()
        self.api_status.send_multipart(encode(msg))

    # ---------------------------------------------------------------- orders on own engine

    def prepare_local(self, instruction: str, epoch: int) -> tuple[bool, str | None]:
        """Pause the engine; for reinit, restart it if it is dead, hung or cannot pause."""
        try:
            # NOTE: an engine already stuck in one step for seconds (a hang, or a collective
            # waiting on a dead peer) cannot obey a pause; under reinit, restart it at once.
            stuck = self.engine.busy_for() >= _STUCK_S
            if self.engine.is_alive() and not (stuck and instruction == "reinit"):
                try:
                    self.engine.command("pause", min(10.0, self.ft.ft_hang_timeout_s))
                    return True, None
                except Exception as exc:
                    if instruction != "reinit":
                        return False, str(exc)
                    logger.warning("sentinel %d: pause failed (%s); restarting", self.rank, exc)
            elif instruction != "reinit":
                return False, (f"engine {self.rank} process is dead (exit code "
                               f"{self.engine.exit_code()}); reinit is needed")
            self.engine.kill()
            self.engine.start(epoch, start_paused=True, timeout_s=self.ft.ft_recovery_timeout_s)
            return True, "restarted"
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"

    def recover_local(self, epoch: int) -> tuple[bool, str | None]:
        try:
            self.engine.command("recover", self.ft.ft_recovery_timeout_s, epoch=epoch)
            return True, None
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.engine.stop()
        self.engine.close()
        self.peers.close()
        self.api_cmd.close(linger=0)
        self.api_status.close()


def run_sentinel(config: EngineConfig, info: HandshakeInfo, handshake: zmq.Socket,
                 ctx: zmq.Context) -> None:
    sentinel = Sentinel(config, info, ctx)
    try:
        sentinel.start(handshake)
        sentinel.run()
    finally:
        sentinel.close()
