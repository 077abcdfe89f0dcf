"""Sentinel process (``bastion::sentinel-N``): one per engine; the engine's parent.

One loop, never blocked past a poll: it watches its engine (process exit, fault reports,
heartbeats that stop or show a stuck step) and reports faults to the coordinator, carries out
the coordinator's orders on its own engine (``OrderRunner``), forwards the group's status to
its API process and, on sentinel 0, feeds the coordinator's state machine (every message and a
tick per turn) and delivers the orders it returns. Rank 0 talks to its coordinator through the
same messages as every other rank.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from bastion.core.config import EngineConfig
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.control import (
    ApplyRequest,
    EngineProcesses,
    FaultReport,
    GroupFatal,
    GroupStatus,
    HandshakeInfo,
    InjectFault,
    InjectRequest,
    OrderDone,
    PauseOrder,
    PeerHello,
    PeerMessage,
    RecoverOrder,
    SentinelLaunch,
)
from bastion.ipc.messages import Ready
from bastion.sentinel.coordinator import Coordinator, Tick
from bastion.sentinel.engine_handle import EngineHandle
from bastion.sentinel.orders import OrderRunner
from bastion.sentinel.peers import PeerLink

logger = logging.getLogger(__name__)

_HEARTBEAT_S = 0.25
_TURN_S = 0.02


class Sentinel:
    def __init__(self, config: EngineConfig, info: HandshakeInfo, ctx: zmq.Context) -> None:
        launch = info.launch
        assert isinstance(launch, SentinelLaunch)
        self.config = config
        self.ft = config.fault_tolerance
        self.rank = info.rank
        self.ctx = ctx
        self.engine = EngineHandle(ctx, config, self.rank, launch)
        self.api_status = ctx.socket(zmq.PUSH)
        self.api_status.setsockopt(zmq.LINGER, 1000)
        self.api_status.connect(launch.status)
        self.api_cmd = ctx.socket(zmq.PULL)
        self.api_cmd.bind(launch.cmd)
        par = config.parallel
        # NOTE: only an expert-parallel group steps in lockstep and so pauses and recovers as
        # one (sentinel 0 coordinates it); dense DP engines share nothing, and each sentinel
        # coordinates its own engine alone, so a fault in one never pauses another.
        ranks = list(range(par.data_parallel_size)) if par.is_dp_coupled else [self.rank]
        self.peers = PeerLink(
            ctx, self.rank, par.data_parallel_address, par.data_parallel_rpc_port, len(ranks)
        )
        self.coordinator = Coordinator(self.ft, ranks) if self.rank == ranks[0] else None
        self.orders = OrderRunner(self.rank, self.engine, self.ft)
        self.reported: tuple[int, int] | None = None  # (incarnation, epoch) of the last report
        self.running = True
        self._last_heartbeat = 0.0
        self._processes: EngineProcesses | None = None  # as last sent to the API
        self.poller = zmq.Poller()
        for sock in (self.engine.control, self.api_cmd, self.peers.socket):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)

    # ------------------------------------------------------------------------- start-up

    def start(self, handshake: zmq.Socket) -> None:
        t0 = time.perf_counter()
        # The first start loads the model from scratch; the API's own --startup-timeout bounds it.
        self.engine.start(epoch=0, start_paused=False, timeout_s=3600.0)
        handshake.send_multipart(encode(Ready("sentinel", self.rank, os.getpid())))
        self.peers.to_coordinator(PeerHello(self.rank))
        logger.info(
            "sentinel %d: engine %d started in %.1f s",
            self.rank,
            self.rank,
            time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------------- main loop

    def run(self) -> None:
        while self.running:
            self.turn(_TURN_S)

    def turn(self, timeout_s: float) -> None:
        """One turn: serve every channel, watch the engine, advance orders and the timer."""
        if self.peers.loopback:
            timeout_s = 0.0
        self.poller.poll(timeout_s * 1000)
        self.engine.poll(0)
        for msg in self.peers.receive(0):
            self.on_peer(msg)
        while self.api_cmd.poll(0):
            kind, msg = decode(self.api_cmd.recv_multipart())
            if kind == MsgKind.PEER:
                self.on_api(msg)
            elif kind == MsgKind.SHUTDOWN:
                self.running = False
        now = time.monotonic()
        if now - self._last_heartbeat >= _HEARTBEAT_S:
            self._last_heartbeat = now
            self.engine.heartbeat()
        self._watch()
        self.engine.resend(now)
        self.engine.keep_spare()
        self._report_processes()
        for done in self.orders.tick(now):
            self.peers.to_coordinator(done)
        if self.coordinator is not None:
            self._carry_out(self.coordinator.on_event(Tick(), now))

    def _watch(self) -> None:
        """Report a fault of the engine once per incarnation and epoch."""
        fault = self.engine.check(self.ft.ft_hang_timeout_s)
        key = (self.engine.incarnation, self.engine.epoch)
        if fault is None or key == self.reported:
            return
        self.reported = key
        kind, info = fault
        logger.error("sentinel %d: fault detected: %s", self.rank, info)
        self.peers.to_coordinator(FaultReport(self.rank, self.engine.epoch, kind, info))

    def _report_processes(self) -> None:
        processes = self.engine.processes()
        if processes != self._processes:
            self._processes = processes
            self.api_status.send_multipart(encode(processes))

    def _carry_out(self, orders) -> None:
        for rank, msg in orders:
            self.peers.to_peer(rank, msg)

    # ------------------------------------------------------------------------- messages

    def on_peer(self, msg: PeerMessage) -> None:
        if isinstance(msg, (PeerHello, FaultReport, OrderDone, ApplyRequest)):
            if self.coordinator is not None:
                self._carry_out(self.coordinator.on_event(msg, time.monotonic()))
        elif isinstance(msg, (PauseOrder, RecoverOrder)):
            for done in self.orders.on_order(msg, time.monotonic()):
                self.peers.to_coordinator(done)
        elif isinstance(msg, (GroupStatus, GroupFatal)):
            self.api_status.send_multipart(encode(msg))

    def on_api(self, msg: PeerMessage) -> None:
        if isinstance(msg, InjectRequest):
            self.engine.send(InjectFault(0, msg.kind), track=False)
        elif isinstance(msg, ApplyRequest):
            msg.sender = self.rank
            self.peers.to_coordinator(msg)

    def close(self) -> None:
        self.engine.stop()
        self.engine.close()
        self.peers.close()
        self.api_cmd.close(linger=0)
        self.api_status.close()


def run_sentinel(
    config: EngineConfig, info: HandshakeInfo, handshake: zmq.Socket, ctx: zmq.Context
) -> None:
    sentinel = Sentinel(config, info, ctx)
    try:
        sentinel.start(handshake)
        sentinel.run()
    finally:
        sentinel.close()
