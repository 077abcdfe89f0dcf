"""Engine-core process (``bastion::engine-N``): the busy loop.

Socket I/O runs on daemon threads feeding queues, so the loop never waits on a socket:

    while running:
        drain_inputs()      # block only when there is no work
        step()              # schedule, execute, update
        emit_outputs()
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import zmq

from bastion.core.config import EngineConfig
from bastion.core.engine_core import EngineCore
from bastion.core.loader import get_max_model_len, resolve_model
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    Failure,
    HandshakeInfo,
    Ready,
    UtilityCall,
    UtilityResult,
)
from bastion.procs.executor import MultiprocExecutor

logger = logging.getLogger(__name__)


class EngineProc:
    """Wraps an ``EngineCore`` with its input and output threads and the busy loop."""

    def __init__(self, core: EngineCore, ctx: zmq.Context, input_addr: str,
                 output_addr: str) -> None:
        self.core = core
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.running = True
        threading.Thread(target=self._input_thread, args=(ctx, input_addr), daemon=True,
                         name="engine-input").start()
        threading.Thread(target=self._output_thread, args=(ctx, output_addr), daemon=True,
                         name="engine-output").start()

    def _input_thread(self, ctx: zmq.Context, address: str) -> None:
        sock = ctx.socket(zmq.PULL)
        sock.connect(address)
        while True:
            frames = sock.recv_multipart()
            try:
                self.inputs.put(decode(frames))
            except Exception:  # a malformed frame must not kill the engine
                logger.exception("engine %d: dropped an undecodable message",
                                 self.core.engine_id)

    def _output_thread(self, ctx: zmq.Context, address: str) -> None:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        while True:
            msg = self.outputs.get()
            if msg is None:
                break
            sock.send_multipart(encode(msg), copy=False)
        sock.close()

    def run_busy_loop(self) -> None:
        while self.running:
            self._drain_inputs()
            if not self.running:
                break
            if self.core.has_unfinished_requests or self.core.scheduler.rejected:
                out = self.core.step()
                self.outputs.put(out)

    def _drain_inputs(self) -> None:
        block = not (self.core.has_unfinished_requests or self.core.scheduler.rejected)
        while True:
            try:
                kind, msg = self.inputs.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                if block:
                    continue
                return
            self._handle(kind, msg)
            block = False

    def _handle(self, kind: MsgKind, msg: object) -> None:
        if kind == MsgKind.ADD:
            assert isinstance(msg, EngineCoreRequest)
            self.core.add_request(msg)
        elif kind == MsgKind.ABORT:
            assert isinstance(msg, AbortRequests)
            aborted = self.core.abort_requests(msg.request_ids)
            if aborted:
                self.outputs.put(EngineCoreOutputs(self.core.engine_id, aborted,
                                                   self.core.scheduler.make_stats(), time.time()))
        elif kind == MsgKind.UTILITY:
            assert isinstance(msg, UtilityCall)
            self.outputs.put(EngineCoreOutputs(self.core.engine_id,
                                               utility_result=self._utility(msg)))
        elif kind == MsgKind.SHUTDOWN:
            self.running = False

    def _utility(self, call: UtilityCall) -> UtilityResult:
        methods = {"reset_prefix_cache": self.core.scheduler.kv.pool.reset_prefix_cache,
                   "num_free_blocks": lambda: self.core.scheduler.kv.num_free_blocks,
                   "num_blocks": lambda: self.core.num_blocks,
                   "ping": lambda: "pong"}
        if call.method not in methods:
            return UtilityResult(call.call_id, failure=f"unknown utility {call.method!r}")
        try:
            return UtilityResult(call.call_id, methods[call.method](*call.args))
        except Exception as exc:
            return UtilityResult(call.call_id, failure=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.outputs.put(None)


def run_engine(config: EngineConfig, info: HandshakeInfo, handshake: zmq.Socket,
               ctx: zmq.Context) -> None:
    engine_id = info.rank
    start = time.perf_counter()
    resolved = resolve_model(config.model)
    max_model_len = get_max_model_len(resolved.hf_config, config.model.max_model_len)
    executor = MultiprocExecutor(config, info.addresses["runtime_dir"], engine_id)
    try:
        core = EngineCore(config, executor, max_model_len, engine_id)
    except Exception as exc:
        executor.shutdown()
        handshake.send_multipart(encode(Failure("engine", engine_id, str(exc))))
        raise SystemExit(1) from exc
    proc = EngineProc(core, ctx, info.addresses["input"], info.addresses["output"])
    handshake.send_multipart(encode(Ready("engine", engine_id, os.getpid(),
                                          {"num_blocks": core.num_blocks,
                                           "max_model_len": max_model_len})))
    logger.info("engine %d ready in %.1f s", engine_id, time.perf_counter() - start)
    try:
        proc.run_busy_loop()
    finally:
        proc.close()
        executor.shutdown()
