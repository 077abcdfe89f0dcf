"""The API process's client of its engine-core processes (``EngineClient`` over ZeroMQ).

It starts the engines, sends ADD/ABORT to the least-loaded one, and routes OUTPUTS back to
each request's stream through the ``OutputProcessor`` (detokenization, stop strings).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from bastion.core.config import EngineConfig
from bastion.core.output_processor import OutputProcessor, SeqDelta, child_id, fan_out
from bastion.ipc.codec import MsgKind, decode, encode, shutdown_frames
from bastion.ipc.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineState,
    EngineStatus,
    HandshakeInfo,
    SamplingParams,
    SchedulerStats,
)
from bastion.procs.lifecycle import Child, HandshakeServer, encode_config, ipc_address, spawn_child

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One client request's deltas (all ``n`` choices), fed by the output loop."""

    client: AsyncEngineClient
    request_id: str
    num_prompt_tokens: int
    engine_id: int
    child_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_cached_tokens: int = 0
    num_open: int = 0

    def __aiter__(self) -> AsyncIterator[SeqDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SeqDelta]:
        while self.num_open > 0:
            delta: SeqDelta = await self.queue.get()
            if delta.finish_reason is not None:
                self.num_open -= 1
            yield delta
        self.client._streams.pop(self.request_id, None)

    async def abort(self) -> None:
        if self.num_open > 0:
            self.num_open = 0
            await self.client._abort(self)


class AsyncEngineClient:
    """Implements ``api.engine_protocol.EngineClient``."""

    def __init__(self, config: EngineConfig, tokenizer, model_name: str, max_model_len: int,
                 eos_token_id: int | None, runtime_dir: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.runtime_dir = runtime_dir
        self.num_engines = config.parallel.data_parallel_size
        self.ctx = zmq.asyncio.Context()
        self.processor = OutputProcessor(tokenizer)
        self._streams: dict[str, _Stream] = {}
        self._child_to_stream: dict[str, _Stream] = {}
        self._stats: list[SchedulerStats] = [SchedulerStats() for _ in range(self.num_engines)]
        self._inflight = [0] * self.num_engines
        self._statuses = [EngineStatus(i, EngineState.STARTING) for i in range(self.num_engines)]
        self.engines: list[Child] = []
        self._output_task: asyncio.Task | None = None
        self.on_stats = None  # called with (engine_id, stats) on every report (metrics)

    # ------------------------------------------------------------------------------ start-up

    def start(self, timeout_s: float = 600.0) -> dict[int, dict[str, int]]:
        """Spawn the engines and wait until every one is READY (blocking; call before serving)."""
        out_addr = ipc_address(self.runtime_dir, "api-output")
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(out_addr)
        self.input_sockets = []
        infos = {}
        for engine_id in range(self.num_engines):
            addr = ipc_address(self.runtime_dir, f"engine{engine_id}-input")
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self.input_sockets.append(sock)
            infos[engine_id] = HandshakeInfo(encode_config(self.config),
                                             {"input": addr, "output": out_addr,
                                              "runtime_dir": self.runtime_dir}, engine_id)
        sync_ctx = zmq.Context.instance()
        handshake = HandshakeServer(sync_ctx, ipc_address(self.runtime_dir, "engines-hs"))
        self.engines = [spawn_child("engine", i, f"bastion::engine-{i}", handshake.address)
                        for i in range(self.num_engines)]
        try:
            ready = handshake.run(self.engines, infos, timeout_s)
        except Exception:
            self.kill_engines()
            raise
        finally:
            handshake.close()
        for i in range(self.num_engines):
            self._statuses[i] = EngineStatus(i, EngineState.HEALTHY)
        return {rank: r.info for rank, r in ready.items()}

    def start_output_loop(self) -> None:
        self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    # ------------------------------------------------------------------------------ requests

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 deadline: float | None = None) -> _Stream:
        engine_id = self._pick_engine()
        children = fan_out(request_id, prompt_token_ids, params, self.eos_token_id, time.time(),
                           deadline)
        stream = _Stream(self, request_id, len(prompt_token_ids), engine_id,
                         [c.request_id for c in children])
        stream.num_open = len(children)
        self._streams[request_id] = stream
        for i, child in enumerate(children):
            self.processor.add(child, request_id, i)
            self._child_to_stream[child.request_id] = stream
            self.input_sockets[engine_id].send_multipart(encode(child))
        self._inflight[engine_id] += len(children)
        return stream

    def _pick_engine(self) -> int:
        """Least loaded by the engines' last report plus what was sent since."""
        def load(i: int) -> int:
            return self._inflight[i] * 4 + self._stats[i].num_waiting_reqs

        candidates = [i for i in range(self.num_engines)
                      if self._statuses[i].state != EngineState.DEAD] or [0]
        return min(candidates, key=load)

    async def _abort(self, stream: _Stream) -> None:
        open_ids = [cid for cid in stream.child_ids if cid in self._child_to_stream]
        for cid in open_ids:
            self.processor.remove(cid)
            self._child_to_stream.pop(cid, None)
            self._inflight[stream.engine_id] -= 1
        self._streams.pop(stream.request_id, None)
        if open_ids:
            await self.input_sockets[stream.engine_id].send_multipart(
                encode(AbortRequests(open_ids)))

    async def _output_loop(self) -> None:
        while True:
            frames = await self.output_socket.recv_multipart()
            kind, msg = decode(frames)
            if kind == MsgKind.OUTPUTS:
                self._on_outputs(msg)
            elif kind == MsgKind.STATUS:
                self._statuses[msg.engine_id] = msg

    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        if outs.stats is not None:
            self._stats[outs.engine_id] = outs.stats
            if self.on_stats is not None:
                self.on_stats(outs.engine_id, outs.stats)
        to_abort: list[str] = []
        for out in outs.outputs:
            stream = self._child_to_stream.get(out.request_id)
            if stream is None:
                continue
            delta, must_abort = self.processor.process(out)
            if delta is None:
                continue
            stream.num_cached_tokens = max(stream.num_cached_tokens, out.num_cached_tokens)
            if delta.finish_reason is not None:
                self._child_to_stream.pop(out.request_id, None)
                self._inflight[outs.engine_id] -= 1
            if must_abort:
                to_abort.append(out.request_id)
            stream.queue.put_nowait(delta)
        if to_abort:
            self.input_sockets[outs.engine_id].send_multipart(encode(AbortRequests(to_abort)))

    # ------------------------------------------------------------------------------- status

    def is_ready(self) -> bool:
        return all(s.state == EngineState.HEALTHY for s in self._statuses)

    def engine_statuses(self) -> list[EngineStatus]:
        return list(self._statuses)

    def scheduler_stats(self) -> list[SchedulerStats]:
        return list(self._stats)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # ----------------------------------------------------------------------------- shutdown

    def engines_alive(self) -> bool:
        return all(e.is_alive() for e in self.engines)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for sock in self.input_sockets:
            try:
                await sock.send_multipart(shutdown_frames(), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout_s
        while any(e.is_alive() for e in self.engines) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.kill_engines()
        if self._output_task is not None:
            self._output_task.cancel()
        self.ctx.destroy(linger=0)

    def kill_engines(self) -> None:
        for engine in self.engines:
            engine.kill(timeout=5.0)


__all__ = ["AsyncEngineClient", "child_id"]
