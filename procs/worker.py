"""Worker process (``bastion::worker-E-R``): one per device; runs the model runner.

It receives every EXECUTE and WORKER_CALL on its own PULL socket; rank 0 answers EXECUTE with
the sampled tokens, every rank answers WORKER_CALLs. A failure is reported, not fatal: the
worker waits to be reset (fault recovery) or shut down.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

import zmq

from bastion.core.config import EngineConfig
from bastion.core.model_runner import ModelRunner
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.messages import Failure, HandshakeInfo, Ready, WorkerCall, WorkerReply

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.rank = rank
        self.runner = ModelRunner(config)

    def kv_info(self) -> dict[str, int]:
        return {"bytes_per_block": self.runner.kv_cache_bytes_per_block(),
                "available_bytes": self.runner.available_kv_cache_bytes()}

    def init_kv(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def reset(self) -> None:
        self.runner.reset()

    def inject_fault(self, kind: str) -> None:
        """Fault drills only (the engine gates this behind --enable-fault-injection)."""
        if kind == "worker_exit":
            os._exit(17)
        if kind == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault in worker {self.rank}")

    def handle_call(self, call: WorkerCall) -> WorkerReply:
        if call.method not in ("kv_info", "init_kv", "reset", "inject_fault"):
            return WorkerReply(call.call_id, self.rank, failure=f"unknown method {call.method}")
        try:
            result = getattr(self, call.method)(*call.args)
            return WorkerReply(call.call_id, self.rank, result)
        except Exception as exc:  # reported to the engine, which decides
            logger.exception("worker %d: %s failed", self.rank, call.method)
            return WorkerReply(call.call_id, self.rank, failure=f"{type(exc).__name__}: {exc}")


def run_worker(config: EngineConfig, info: HandshakeInfo, handshake: zmq.Socket,
               ctx: zmq.Context) -> None:
    worker = Worker(config, info.rank)
    worker.runner.load_model()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(info.addresses["execute"])
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.connect(info.addresses["worker_out"])
    handshake.send_multipart(encode(Ready("worker", info.rank, os.getpid())))
    while True:
        kind, msg = decode(inbox.recv_multipart())
        if kind == MsgKind.SHUTDOWN:
            return
        if kind == MsgKind.WORKER_CALL:
            outbox.send_multipart(encode(worker.handle_call(msg)))
            continue
        try:
            result = worker.runner.execute_model(msg)
        except Exception:
            logger.exception("worker %d: step failed", info.rank)
            outbox.send_multipart(encode(Failure("worker", info.rank, traceback.format_exc())))
            continue
        if info.rank == 0:
            outbox.send_multipart(encode(result))
