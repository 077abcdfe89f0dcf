"""The API process's client of its engines (``EngineClient`` over ZeroMQ).

``AsyncEngineClient`` is a facade over the pieces in ``procs/client/``, each with one job:

- ``EngineSupervisor``: spawns one sentinel per engine (each starts its engine), owns the
  sockets, sends the operator's commands, shuts everything down;
- ``Router``: the engines' health and load; which engines serve (dense DP engines each on its
  own, an expert-parallel group only all together) and which one gets a sequence;
- ``OutputDemux``: each client request's stream, fed from the steps' outputs through the
  ``OutputProcessor`` (detokenization, stop strings);
- ``HoldResume``: where each sequence is (held, or in an engine under an engine request id) and
  what it is resubmitted with;
- ``UtilityCalls``: engine utilities (LoRA load/unload) awaiting their results.

Fault tolerance, front-end side: the sentinels push each engine's status here. When an engine
stops serving (a fault) or comes back at a new epoch, every sequence it had is taken back and
resubmitted, with the tokens it already streamed, to an engine that serves, under a fresh
engine request id, so a stale output can never be mistaken for a new one. Dense DP engines are
independent: the others keep serving and take the moved sequences at once. An expert-parallel
group serves only when all its engines do, so its sequences (and new requests) wait for the
group's recovery.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from bastion.core.config import EngineConfig
from bastion.ipc.codec import MsgKind, decode
from bastion.ipc.control import EngineProcesses, GroupFatal, GroupStatus
from bastion.ipc.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineState,
    EngineStatus,
    FinishReason,
    LoRARequest,
    SamplingParams,
    SchedulerStats,
)
from bastion.procs.client.holds import HoldResume
from bastion.procs.client.router import Router
from bastion.procs.client.streams import OutputDemux, RequestStream
from bastion.procs.client.supervisor import EngineSupervisor
from bastion.procs.client.utility_calls import UtilityCalls

logger = logging.getLogger(__name__)


class AsyncEngineClient:
    """Implements ``api.engine_protocol.EngineClient`` and the fault-tolerance handler."""

    def __init__(self, config: EngineConfig, tokenizer, model_name: str, max_model_len: int,
                 eos_token_id: int | None, runtime_dir: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        par = config.parallel
        # External load-balancer mode: this server owns one rank; internal: all of them.
        self.engine_ids = ([par.data_parallel_rank] if par.data_parallel_rank is not None
                           else list(range(par.data_parallel_size)))
        self.supervisor = EngineSupervisor(config, self.engine_ids, runtime_dir)
        self.router = Router(self.engine_ids, par.data_parallel_size, par.is_dp_coupled)
        self.holds = HoldResume(self.engine_ids)
        self.demux = OutputDemux(tokenizer, self.holds, self._send_abort)
        self.utility_calls = UtilityCalls(self.supervisor.send_input)
        self.on_stats = None  # called with (engine index, stats) on every report (metrics)
        self.on_status = None  # called with the statuses on every status report (metrics)
        self._tasks: list[asyncio.Task] = []

    @property
    def fatal(self) -> str | None:
        """Why the engine group is dead (recovery failed), or None."""
        return self.router.fatal

    # ------------------------------------------------------------------------------ start-up

    def start(self, timeout_s: float = 600.0) -> None:
        """Spawn the sentinels (which start the engines); block until every one is READY."""
        self.supervisor.start(timeout_s)

    def start_output_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._output_loop()),
                       loop.create_task(self._status_loop()),
                       loop.create_task(self._deadline_loop())]

    async def wait_until_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready() and time.monotonic() < deadline and self.fatal is None:
            await asyncio.sleep(0.05)
        return self.is_ready()

    # ------------------------------------------------------------------------------ requests

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 deadline: float | None = None,
                 lora_request: LoRARequest | None = None) -> RequestStream:
        if self.fatal is not None:
            raise RuntimeError(f"the engines are dead: {self.fatal}")
        stream = self.demux.open(request_id, prompt_token_ids, params, self.eos_token_id,
                                 deadline, lora_request)
        self._dispatch_held()
        return stream

    async def call_utility(self, method: str, *args: object,
                           timeout_s: float = 120.0) -> list[object]:
        """Run a whitelisted engine utility on every engine of this server; results in engine
        order. An engine's failure raises ``ValueError`` with its message."""
        return await self.utility_calls.call(self.engine_ids, method, list(args), timeout_s)

    def _dispatch_held(self) -> None:
        """Submit every held sequence to an engine that serves, if any does."""
        serving = self.router.serving()
        if not serving:
            return
        for seq in self.holds.take_held():
            engine_id = self.router.pick(serving, self.holds.num_inflight)
            request = self.holds.submit(seq, engine_id, self.demux.streamed(seq))
            self.supervisor.send_input(engine_id, request)

    def _send_abort(self, engine_id: int, engine_request_ids: list[str]) -> None:
        self.supervisor.send_input(engine_id, AbortRequests(engine_request_ids))

    # ------------------------------------------------------------------------------- loops

    async def _output_loop(self) -> None:
        while True:
            kind, msg = decode(await self.supervisor.output_socket.recv_multipart())
            if kind == MsgKind.OUTPUTS and msg.utility_result is not None:
                self.utility_calls.resolve(msg.utility_result)
            elif kind == MsgKind.OUTPUTS:
                self._observe_stats(msg)
                await self.demux.route(msg)

    def _observe_stats(self, outs: EngineCoreOutputs) -> None:
        if outs.stats is None or not self.router.observe_stats(outs.engine_id, outs.stats):
            return
        if self.on_stats is not None:
            self.on_stats(self.engine_ids.index(outs.engine_id), outs.stats)

    async def _status_loop(self) -> None:
        while True:
            _, msg = decode(await self.supervisor.status_socket.recv_multipart())
            if isinstance(msg, GroupFatal):
                self._on_fatal(msg.info or "recovery failed")
            elif isinstance(msg, GroupStatus):
                self._on_status(msg)
            elif isinstance(msg, EngineProcesses):
                self.supervisor.observe_processes(msg)

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for seq in self.holds.expired(time.time()):
                self.demux.finish(seq, FinishReason.TIMEOUT, "the request's deadline passed "
                                  "while the engines were recovering")

    # ------------------------------------------------------------------- fault tolerance

    def _on_status(self, msg: GroupStatus) -> None:
        taken_back = self.router.update(msg.statuses)
        if self.on_status is not None:
            self.on_status(self.engine_statuses())
        for engine_id in taken_back:
            self._take_back(engine_id)
        self._dispatch_held()

    def _take_back(self, engine_id: int) -> None:
        """Engine ``engine_id`` stopped serving (or restarted): its sequences wait for, or move
        at once to, an engine that serves; or end, with ``--ft-inflight abort``."""
        seqs = self.holds.take_back(engine_id)
        status = self.router.statuses[engine_id]
        if status.state != EngineState.HEALTHY:
            logger.warning("engine %d stopped serving (%s): %d sequence(s) %s", engine_id,
                           status.fault_info or status.state.name.lower(), len(seqs),
                           "move to another engine" if self.router.serving() else "wait")
        else:
            logger.warning("engine %d serves again at epoch %d: resuming %d sequence(s)",
                           engine_id, status.epoch, len(seqs))
        abort = self.config.fault_tolerance.ft_inflight == "abort"
        for seq in seqs:
            if abort:
                self.demux.finish(seq, FinishReason.ABORT,
                                  "aborted: an engine faulted (--ft-inflight abort)")
            else:
                self.holds.hold(seq)

    def _on_fatal(self, reason: str) -> None:
        logger.critical("the engine group is dead: %s", reason)
        self.router.fatal = reason
        for seq in list(self.holds.open.values()):
            self.demux.finish(seq, FinishReason.ERROR, f"the engines are dead: {reason}")

    def apply(self, instruction: str, params: dict) -> str:
        """``POST /fault_tolerance/apply``: one call recovers the whole group."""
        return self.supervisor.apply(instruction, self.router.is_coupled)

    def status(self) -> list[dict]:
        return [msgspec.structs.asdict(s) | {"state": s.state.name.lower(),
                                             "fault_kind": s.fault_kind.label,
                                             "num_requests": self.holds.num_submitted.get(
                                                 s.engine_id)}
                | self.supervisor.processes_dict(s.engine_id) for s in self.engine_statuses()]

    def inject(self, kind: str, engine: int) -> None:
        self.supervisor.inject(kind, engine)

    # ------------------------------------------------------------------------------- status

    def is_ready(self) -> bool:
        return self.router.is_ready()

    def is_progressing(self) -> bool:
        return self.router.is_progressing()

    def engine_statuses(self) -> list[EngineStatus]:
        return list(self.router.statuses.values())

    def scheduler_stats(self) -> list[SchedulerStats]:
        return list(self.router.stats.values())

    @property
    def num_unfinished(self) -> int:
        return len(self.demux.streams)

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table; all 0 when no request is in flight (a leak
        shows here first, so ``/metrics`` exports it)."""
        demux, holds = self.demux.table_sizes(), self.holds.table_sizes()
        return {"streams": demux["streams"], "sequences": holds["sequences"],
                "engine_requests": holds["engine_requests"], "held": holds["held"],
                "output_states": demux["output_states"], "inflight": holds["inflight"]}

    def children_alive(self) -> bool:
        return self.supervisor.children_alive()

    # ----------------------------------------------------------------------------- shutdown

    async def shutdown(self, timeout_s: float = 15.0) -> None:
        await self.supervisor.shutdown(timeout_s)
        for task in self._tasks:
            task.cancel()
        self.supervisor.close()

    def kill_children(self) -> None:
        self.supervisor.kill_children()
