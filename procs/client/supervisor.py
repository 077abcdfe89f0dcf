"""Supervision: the sentinels of the engines this API process serves (each starts its engine),
the channels to and from them, the operator's commands to them, and their shutdown."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from bastion.core.config import EngineConfig
from bastion.ipc.codec import encode, shutdown_frames
from bastion.ipc.control import (
    ApplyRequest,
    EngineProcesses,
    FaultInjection,
    HandshakeInfo,
    InjectRequest,
    Instruction,
    SentinelLaunch,
)
from bastion.procs.lifecycle import Child, HandshakeServer, encode_config, ipc_address, spawn_child


class EngineSupervisor:
    """Spawns one sentinel per engine id and owns every socket of the API process's side.

    ``output_socket`` (steps' outputs and utility results) and ``status_socket`` (the sentinels'
    reports) are read by the client's loops; ``send_input`` reaches an engine, ``send_command``
    its sentinel."""

    def __init__(self, config: EngineConfig, engine_ids: list[int], runtime_dir: str) -> None:
        self.config = config
        self.engine_ids = engine_ids
        self.runtime_dir = runtime_dir
        self.ctx = zmq.asyncio.Context()
        self.sentinels: dict[int, Child] = {}
        self.input_sockets: dict[int, zmq.asyncio.Socket] = {}
        self.cmd_sockets: dict[int, zmq.asyncio.Socket] = {}
        self.processes = {i: EngineProcesses(i) for i in engine_ids}  # by its sentinel

    def start(self, timeout_s: float) -> None:
        """Spawn the sentinels (which start the engines); block until every one is READY."""
        rd = self.runtime_dir
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(ipc_address(rd, "api-output"))
        self.status_socket = self.ctx.socket(zmq.PULL)
        self.status_socket.bind(ipc_address(rd, "api-status"))
        infos = {}
        for i in self.engine_ids:
            self.input_sockets[i] = self._push(ipc_address(rd, f"engine{i}-input"), bind=True)
            cmd = ipc_address(rd, f"sentinel{i}-cmd")
            self.cmd_sockets[i] = self._push(cmd, bind=False)
            infos[i] = HandshakeInfo(encode_config(self.config), SentinelLaunch(
                ipc_address(rd, f"engine{i}-input"), ipc_address(rd, "api-output"),
                ipc_address(rd, "api-status"), cmd, rd), i)
        handshake = HandshakeServer(zmq.Context.instance(), ipc_address(rd, "sentinels-hs"))
        children = [spawn_child("sentinel", i, f"bastion::sentinel-{i}", handshake.address)
                    for i in self.engine_ids]
        self.sentinels = {c.rank: c for c in children}
        try:
            handshake.run(children, infos, timeout_s)
        except Exception:
            self.kill_children()
            raise
        finally:
            handshake.close()

    def _push(self, address: str, bind: bool) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        (sock.bind if bind else sock.connect)(address)
        return sock

    def send_input(self, engine_id: int, msg: msgspec.Struct) -> None:
        """ADD, ABORT or a utility call to an engine."""
        self.input_sockets[engine_id].send_multipart(encode(msg))

    def send_command(self, engine_id: int, msg: msgspec.Struct) -> None:
        """A control message to an engine's sentinel."""
        self.cmd_sockets[engine_id].send_multipart(encode(msg))

    # ---------------------------------------------------------------------- operator commands

    def apply(self, instruction: str, is_coupled: bool) -> str:
        """``POST /fault_tolerance/apply``: one call recovers the whole group."""
        request_id = f"ft-{uuid.uuid4().hex[:16]}"
        # A coupled group's coordinator hears it through any sentinel; dense engines are each
        # their own group.
        for engine_id in self.engine_ids[:1] if is_coupled else self.engine_ids:
            self.send_command(engine_id,
                              ApplyRequest(engine_id, request_id, Instruction[instruction.upper()]))
        return request_id

    def inject(self, kind: str, engine: int) -> None:
        if engine not in self.cmd_sockets:
            raise ValueError(f"engine {engine} is not served by this process; it serves "
                             f"{self.engine_ids}")
        self.send_command(engine, InjectRequest(engine, FaultInjection[kind.upper()]))

    def observe_processes(self, msg: EngineProcesses) -> None:
        if msg.engine_id in self.processes:
            self.processes[msg.engine_id] = msg

    def processes_dict(self, engine_id: int) -> dict:
        """The engine's serving pids and its warm spare (``off``, ``none``, ``warming``,
        ``ready``), as its sentinel last said; nothing for an engine of another server."""
        procs = self.processes.get(engine_id)
        if procs is None:
            return {}
        return {"pid": procs.pid or None, "worker_pids": procs.worker_pids,
                "spare": procs.spare.name.lower()}

    # ------------------------------------------------------------------------------ shutdown

    def children_alive(self) -> bool:
        return all(c.is_alive() for c in self.sentinels.values())

    async def shutdown(self, timeout_s: float) -> None:
        """Tell every sentinel to stop, the lowest engine last; kill what is left at the end."""
        engines = sorted(self.cmd_sockets)
        start = time.monotonic()
        # The lowest engine last, given at least half the time: with expert parallelism its
        # rank-0 worker hosts the store of the workers' groups that span engines, which the
        # other engines' NCCL monitors poll (each engine orders its own workers the same way).
        for group, deadline in ((engines[1:], start + timeout_s / 2),
                                (engines[:1], start + timeout_s)):
            for i in group:
                try:
                    await self.cmd_sockets[i].send_multipart(shutdown_frames(), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            children = [self.sentinels[i] for i in group if i in self.sentinels]
            while any(c.is_alive() for c in children) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.kill_children()

    def kill_children(self) -> None:
        for child in self.sentinels.values():
            child.kill(timeout=5.0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
