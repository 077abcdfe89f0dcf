"""The API process's client of its engines (``EngineClient`` over ZeroMQ).

It starts one sentinel per engine it serves (each sentinel starts its engine), sends ADD and
ABORT to the least-loaded healthy engine, and routes OUTPUTS back to each request's stream
through the ``OutputProcessor`` (detokenization, stop strings).

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
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from bastion.core.config import EngineConfig
from bastion.core.output_processor import OutputProcessor, SeqDelta, fan_out
from bastion.ipc.codec import MsgKind, decode, encode, shutdown_frames
from bastion.ipc.control import (
    ApplyRequest,
    EngineProcesses,
    FaultInjection,
    GroupFatal,
    GroupStatus,
    HandshakeInfo,
    InjectRequest,
    Instruction,
    SentinelLaunch,
)
from bastion.ipc.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineState,
    EngineStatus,
    FinishReason,
    LoRARequest,
    SamplingParams,
    SchedulerStats,
    UtilityCall,
)
from bastion.procs.lifecycle import Child, HandshakeServer, encode_config, ipc_address, spawn_child

logger = logging.getLogger(__name__)

# CPU the output loop spends on one step's outputs before it lets other tasks run.
OUTPUT_SLICE_S = 0.005


@dataclass
class _Seq:
    """One engine-side sequence (a choice of a client request), across epochs."""

    child_id: str
    request: EngineCoreRequest
    stream: _Stream
    engine_id: int = -1
    engine_request_id: str = ""


@dataclass
class _Stream:
    """One client request's deltas (all ``n`` choices), fed by the output loop."""

    client: AsyncEngineClient
    request_id: str
    num_prompt_tokens: int
    seqs: list[_Seq] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_cached_tokens: int = 0
    num_open: int = 0

    def __aiter__(self) -> AsyncIterator[SeqDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SeqDelta]:
        try:
            while self.num_open > 0:
                delta: SeqDelta = await self.queue.get()
                if delta.finish_reason is not None:
                    self.num_open -= 1
                yield delta
        finally:
            # NOTE: also when the reader stops early (an error delta, a client gone): a stream
            # whose last delta was read must not stay in the client's tables.
            self.client._release_stream(self)

    async def abort(self) -> None:
        """Stop every open choice in its engine and forget the request. Safe to call more
        than once and after the stream ended (then it only makes sure nothing is left)."""
        self.num_open = 0
        self.client._release_stream(self)


class AsyncEngineClient:
    """Implements ``api.engine_protocol.EngineClient`` and the fault-tolerance handler."""

    def __init__(self, config: EngineConfig, tokenizer, model_name: str, max_model_len: int,
                 eos_token_id: int | None, runtime_dir: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.runtime_dir = runtime_dir
        par = config.parallel
        self.dp_size = par.data_parallel_size
        # External load-balancer mode: this server owns one rank; internal: all of them.
        self.engine_ids = ([par.data_parallel_rank] if par.data_parallel_rank is not None
                           else list(range(self.dp_size)))
        self.ctx = zmq.asyncio.Context()
        self.processor = OutputProcessor(tokenizer)
        self._streams: dict[str, _Stream] = {}
        self._open: dict[str, _Seq] = {}  # child id -> seq
        self._by_engine_id: dict[str, _Seq] = {}  # engine request id -> seq
        self._held: list[_Seq] = []  # waiting for the group to be healthy
        self._stats = {i: SchedulerStats() for i in self.engine_ids}
        self._inflight = {i: 0 for i in self.engine_ids}
        self._num_submitted = {i: 0 for i in self.engine_ids}  # load-balancing record
        # An expert-parallel group needs every engine to serve; dense engines only themselves.
        self.is_coupled = par.is_dp_coupled
        shown = range(self.dp_size) if self.is_coupled else self.engine_ids
        self._statuses = {i: EngineStatus(i, EngineState.STARTING) for i in shown}
        self._epochs = {i: 0 for i in self.engine_ids}  # the epoch each engine serves at
        self._processes = {i: EngineProcesses(i) for i in self.engine_ids}  # by its sentinel
        self._submission_ids = itertools.count()
        self.fatal: str | None = None
        self.on_stats = None  # called with (engine index, stats) on every report (metrics)
        self.on_status = None  # called with the statuses on every status report (metrics)
        self.sentinels: dict[int, Child] = {}
        self._tasks: list[asyncio.Task] = []
        self._call_ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}  # utility calls awaiting their results

    # ------------------------------------------------------------------------------ start-up

    def start(self, timeout_s: float = 600.0) -> None:
        """Spawn the sentinels (which start the engines); block until every one is READY."""
        rd = self.runtime_dir
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(ipc_address(rd, "api-output"))
        self.status_socket = self.ctx.socket(zmq.PULL)
        self.status_socket.bind(ipc_address(rd, "api-status"))
        self.input_sockets, self.cmd_sockets, infos = {}, {}, {}
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
                 lora_request: LoRARequest | None = None) -> _Stream:
        if self.fatal is not None:
            raise RuntimeError(f"the engines are dead: {self.fatal}")
        stream = _Stream(self, request_id, len(prompt_token_ids))
        for i, req in enumerate(fan_out(request_id, prompt_token_ids, params, self.eos_token_id,
                                        time.time(), deadline, lora_request=lora_request)):
            self.processor.add(req, request_id, i)
            seq = _Seq(req.request_id, req, stream)
            stream.seqs.append(seq)
            self._open[seq.child_id] = seq
            self._held.append(seq)
        self._dispatch_held()
        stream.num_open = len(stream.seqs)
        self._streams[request_id] = stream
        return stream

    async def call_utility(self, method: str, *args: object,
                           timeout_s: float = 120.0) -> list[object]:
        """Run a whitelisted engine utility on every engine of this server; results in engine
        order. An engine's failure raises ``ValueError`` with its message."""
        loop = asyncio.get_running_loop()
        calls = {}
        for engine_id in self.engine_ids:
            call_id = next(self._call_ids)
            calls[engine_id] = self._calls[call_id] = loop.create_future()
            self.input_sockets[engine_id].send_multipart(
                encode(UtilityCall(call_id, method, list(args))))
        try:
            async with asyncio.timeout(timeout_s):
                results = [await calls[i] for i in self.engine_ids]
        finally:
            for call_id in [c for c, f in self._calls.items() if f in calls.values()]:
                del self._calls[call_id]
        for engine_id, result in zip(self.engine_ids, results):
            if result.failure is not None:
                raise ValueError(result.failure.partition(": ")[2] or result.failure)
        return [r.result for r in results]

    def _submit(self, seq: _Seq, engine_id: int) -> None:
        """Send (or resend after a fault) one sequence, resuming after its streamed tokens."""
        produced = self.processor.output_token_ids(seq.child_id)
        seq.engine_id = engine_id
        seq.engine_request_id = f"{seq.child_id}@{next(self._submission_ids)}"
        request = msgspec.structs.replace(seq.request, request_id=seq.engine_request_id,
                                          resumed_output_token_ids=list(produced))
        self._by_engine_id[seq.engine_request_id] = seq
        self._inflight[engine_id] += 1
        self._num_submitted[engine_id] += 1
        self.input_sockets[engine_id].send_multipart(encode(request))

    def _serving(self) -> list[int]:
        """The engines that take requests now."""
        if self.fatal is not None:
            return []
        healthy = [i for i in self.engine_ids if self._statuses[i].state == EngineState.HEALTHY]
        if self.is_coupled and any(s.state != EngineState.HEALTHY
                                   for s in self._statuses.values()):
            return []
        return healthy

    def _pick_engine(self, serving: list[int]) -> int:
        """Least loaded by the engines' last report plus what was sent since."""
        return min(serving, key=lambda i: self._inflight[i] * 4 + self._stats[i].num_waiting_reqs)

    def _dispatch_held(self) -> None:
        """Submit every waiting sequence to an engine that serves, if any does."""
        serving = self._serving()
        if not serving or not self._held:
            return
        held, self._held = self._held, []
        for seq in held:
            self._submit(seq, self._pick_engine(serving))

    def _release_stream(self, stream: _Stream) -> None:
        """Drop every trace of a client request; abort its sequences still in an engine."""
        by_engine: dict[int, list[str]] = {}
        for seq in stream.seqs:
            self.processor.remove(seq.child_id)
            if seq.child_id in self._open and self._close(seq):
                by_engine.setdefault(seq.engine_id, []).append(seq.engine_request_id)
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        for engine_id, ids in by_engine.items():
            self.input_sockets[engine_id].send_multipart(encode(AbortRequests(ids)))

    def _finish_seq(self, seq: _Seq, reason: FinishReason, error: str) -> None:
        """End a sequence from the front end (deadline, fatal fault, --ft-inflight abort)."""
        out = EngineCoreOutput(seq.child_id, [], reason, error=error)
        delta, _ = self.processor.process(out)
        self._close(seq)
        if delta is not None:
            seq.stream.queue.put_nowait(delta)

    def _close(self, seq: _Seq) -> bool:
        """Stop tracking a sequence; True when an engine still had it (to abort there)."""
        self._open.pop(seq.child_id, None)
        if seq in self._held:
            self._held.remove(seq)
        return self._detach(seq)

    def _detach(self, seq: _Seq) -> bool:
        """Forget the engine-side request of a sequence (its outputs become stale)."""
        if self._by_engine_id.pop(seq.engine_request_id, None) is None:
            return False
        self._inflight[seq.engine_id] -= 1
        return True

    # ------------------------------------------------------------------------------ outputs

    async def _output_loop(self) -> None:
        while True:
            kind, msg = decode(await self.output_socket.recv_multipart())
            if kind == MsgKind.OUTPUTS and msg.utility_result is not None:
                call = self._calls.pop(msg.utility_result.call_id, None)
                if call is not None and not call.done():
                    call.set_result(msg.utility_result)
            elif kind == MsgKind.OUTPUTS:
                await self._on_outputs(msg)

    async def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        """Detokenize and match stop strings for one step's outputs, in slices of at most
        ``OUTPUT_SLICE_S`` of CPU between which the event loop serves everything else."""
        if outs.stats is not None and outs.engine_id in self._stats:
            self._stats[outs.engine_id] = outs.stats
            if self.on_stats is not None:
                self.on_stats(self.engine_ids.index(outs.engine_id), outs.stats)
        to_abort: list[str] = []
        slice_end = time.perf_counter() + OUTPUT_SLICE_S
        for out in outs.outputs:
            if time.perf_counter() > slice_end:
                # NOTE: a step of a full batch (hundreds of sequences, each with stop strings
                # and logprobs) costs tens of ms here; in one go it would hold up /health and
                # every other request's chunks for as long (vLLM V1 chunks its output handler
                # the same way). What runs meanwhile may abort or resubmit sequences: each
                # output is looked up again below, so a dropped one is skipped.
                await asyncio.sleep(0)
                slice_end = time.perf_counter() + OUTPUT_SLICE_S
            engine_request_id = out.request_id
            if self._on_output(out):
                to_abort.append(engine_request_id)
        if to_abort:
            self.input_sockets[outs.engine_id].send_multipart(encode(AbortRequests(to_abort)))

    def _on_output(self, out: EngineCoreOutput) -> bool:
        """Route one output to its stream; True when the engine must abort it (a stop string
        matched, which only the front end sees)."""
        seq = self._by_engine_id.get(out.request_id)
        if seq is None:
            return False  # aborted, finished, or a stale output of an earlier epoch
        out.request_id = seq.child_id
        delta, must_abort = self.processor.process(out)
        if delta is None:
            return False
        seq.stream.num_cached_tokens = max(seq.stream.num_cached_tokens, out.num_cached_tokens)
        if delta.finish_reason is not None:
            self._close(seq)
        seq.stream.queue.put_nowait(delta)
        return must_abort

    # ------------------------------------------------------------------- fault tolerance

    async def _status_loop(self) -> None:
        while True:
            _, msg = decode(await self.status_socket.recv_multipart())
            if isinstance(msg, GroupFatal):
                self._on_fatal(msg.info or "recovery failed")
            elif isinstance(msg, GroupStatus):
                self._on_status(msg)
            elif isinstance(msg, EngineProcesses) and msg.engine_id in self._processes:
                self._processes[msg.engine_id] = msg

    def _on_status(self, msg: GroupStatus) -> None:
        was_serving = set(self._serving())
        for status in msg.statuses:
            if status.engine_id in self._statuses:
                self._statuses[status.engine_id] = status
        if self.on_status is not None:
            self.on_status(list(self._statuses.values()))
        serving = set(self._serving())
        for engine_id in self.engine_ids:
            status = self._statuses[engine_id]
            stopped = engine_id in was_serving and engine_id not in serving
            moved_on = engine_id in serving and status.epoch != self._epochs[engine_id]
            if stopped or moved_on:
                self._take_back(engine_id, status)
            if engine_id in serving:
                self._epochs[engine_id] = status.epoch
        self._dispatch_held()

    def _take_back(self, engine_id: int, status: EngineStatus) -> None:
        """Engine ``engine_id`` stopped serving (or restarted): its sequences wait for, or move
        at once to, an engine that serves; their engine-side state is gone."""
        seqs = [s for s in self._open.values() if s.engine_id == engine_id and s not in self._held
                and s.engine_request_id in self._by_engine_id]
        self._stats[engine_id] = SchedulerStats()
        if status.state != EngineState.HEALTHY:
            logger.warning("engine %d stopped serving (%s): %d sequence(s) %s", engine_id,
                           status.fault_info or status.state.name.lower(), len(seqs),
                           "move to another engine" if self._serving() else "wait")
        else:
            logger.warning("engine %d serves again at epoch %d: resuming %d sequence(s)",
                           engine_id, status.epoch, len(seqs))
        abort = self.config.fault_tolerance.ft_inflight == "abort"
        for seq in seqs:
            self._detach(seq)
            if abort:
                self._finish_seq(seq, FinishReason.ABORT,
                                 "aborted: an engine faulted (--ft-inflight abort)")
            else:
                self._held.append(seq)

    def _on_fatal(self, reason: str) -> None:
        logger.critical("the engine group is dead: %s", reason)
        self.fatal = reason
        for seq in list(self._open.values()):
            self._finish_seq(seq, FinishReason.ERROR, f"the engines are dead: {reason}")

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for seq in list(self._held):
                deadline = seq.request.deadline
                if deadline is not None and deadline < now:
                    self._finish_seq(seq, FinishReason.TIMEOUT,
                                     "the request's deadline passed while the engines were "
                                     "recovering")

    def apply(self, instruction: str, params: dict) -> str:
        """``POST /fault_tolerance/apply``: one call recovers the whole group."""
        request_id = f"ft-{uuid.uuid4().hex[:16]}"
        # A coupled group's coordinator hears it through any sentinel; dense engines are each
        # their own group.
        for engine_id in self.engine_ids[:1] if self.is_coupled else self.engine_ids:
            msg = ApplyRequest(engine_id, request_id, Instruction[instruction.upper()])
            self.cmd_sockets[engine_id].send_multipart(encode(msg))
        return request_id

    def status(self) -> list[dict]:
        return [msgspec.structs.asdict(s) | {"state": s.state.name.lower(),
                                             "fault_kind": s.fault_kind.label,
                                             "num_requests": self._num_submitted.get(s.engine_id)}
                | self._processes_dict(s.engine_id) for s in self._statuses.values()]

    def _processes_dict(self, engine_id: int) -> dict:
        """The engine's serving pids and its warm spare (``off``, ``none``, ``warming``,
        ``ready``), as its sentinel last said; nothing for an engine of another server."""
        procs = self._processes.get(engine_id)
        if procs is None:
            return {}
        return {"pid": procs.pid or None, "worker_pids": procs.worker_pids,
                "spare": procs.spare.name.lower()}

    def inject(self, kind: str, engine: int) -> None:
        if engine not in self.cmd_sockets:
            raise ValueError(f"engine {engine} is not served by this process; it serves "
                             f"{self.engine_ids}")
        self.cmd_sockets[engine].send_multipart(
            encode(InjectRequest(engine, FaultInjection[kind.upper()])))

    # ------------------------------------------------------------------------------- status

    def is_ready(self) -> bool:
        """Serving: some engine takes requests (dense DP: the others may be recovering, a
        degraded state that ``/fault_tolerance/status`` and the metrics show), and none is
        still starting."""
        return bool(self._serving()) and all(s.state != EngineState.STARTING
                                             for s in self._statuses.values())

    def is_progressing(self) -> bool:
        """Serving, starting or recovering: anything but sitting faulted."""
        return self.is_ready() or all(
            s.state in (EngineState.HEALTHY, EngineState.STARTING, EngineState.RECOVERING)
            for s in self._statuses.values())

    def engine_statuses(self) -> list[EngineStatus]:
        return list(self._statuses.values())

    def scheduler_stats(self) -> list[SchedulerStats]:
        return list(self._stats.values())

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table; all 0 when no request is in flight (a leak
        shows here first, so ``/metrics`` exports it)."""
        return {"streams": len(self._streams), "sequences": len(self._open),
                "engine_requests": len(self._by_engine_id), "held": len(self._held),
                "output_states": len(self.processor.seqs),
                "inflight": sum(self._inflight.values())}

    def children_alive(self) -> bool:
        return all(c.is_alive() for c in self.sentinels.values())

    # ----------------------------------------------------------------------------- shutdown

    async def shutdown(self, timeout_s: float = 15.0) -> None:
        engines = sorted(getattr(self, "cmd_sockets", {}))
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
        for task in self._tasks:
            task.cancel()
        self.ctx.destroy(linger=0)

    def kill_children(self) -> None:
        for child in self.sentinels.values():
            child.kill(timeout=5.0)
