"""The engine's client of its worker processes (one per TP rank), over ZeroMQ.

Implements ``core.executor.Executor``. Every call watches the workers: a worker that dies or
reports a failure raises ``WorkerFailure`` so the engine (and its sentinel) can act.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import time

import zmq
from bastion.core.config import EngineConfig
from bastion.core.loader import resolve_model
from bastion.ipc.codec import MsgKind, decode, encode, shutdown_frames
from bastion.ipc.control import HandshakeInfo, WorkerLaunch
from bastion.ipc.messages import (
    Failure,
    FailureKind,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerCall,
    WorkerReply,
)
from bastion.procs.distributed import (
    check_parallel_divisibility,
    pick_free_port,
    recovery_rendezvous_timeout_s,
    spans_engines,
    worker_group_port,
)
from bastion.procs.faults import WorkerFailure
from bastion.procs.lifecycle import (
    Child,
    HandshakeServer,
    Spares,
    encode_config,
    ipc_address,
    spawn_child,
)

logger = logging.getLogger(__name__)

# How often a wait for the workers checks that they are alive where the kernel gives no pidfd
# (with one, a death wakes the wait at once): a worker's death is seen within this (it was 0.5 s,
# about a quarter of the time a moved stream waited in the dense DP=2 drill); a check is one
# waitpid per worker.
WORKER_CHECK_INTERVAL_MS = 50


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, runtime_dir: str, engine_id: int,
                 startup_timeout_s: float = 300.0, epoch: int = 0,
                 defer_groups: bool = False, spares: Spares | None = None) -> None:
        """``defer_groups``: a restarted engine's workers load their shards without joining
        the cross-engine groups, which they join at the group's next ``recover``.
        ``spares``: warm worker spares (one per rank) to promote instead of starting anew."""
        self.config = config
        self.epoch = epoch
        self.engine_id = engine_id
        self.ctx = zmq.Context.instance()
        self.num_workers = config.parallel.tensor_parallel_size
        self._call_ids = itertools.count()
        check_parallel_divisibility(resolve_model(config.model).hf_config, config.parallel)
        dist_host, dist_port = self._group_address(epoch)
        prefix = f"engine{engine_id}"
        out_addr = ipc_address(runtime_dir, f"{prefix}-worker-out")
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(out_addr)
        self.inboxes = []
        self._poller: zmq.Poller | None = None
        infos = {}
        for rank in range(self.num_workers):
            addr = ipc_address(runtime_dir, f"{prefix}-execute-{rank}")
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self.inboxes.append(sock)
            infos[rank] = HandshakeInfo(encode_config(config), WorkerLaunch(
                addr, out_addr, runtime_dir, dist_host, dist_port, engine_id,
                config.parallel.data_parallel_size, epoch, defer_groups), rank)
        if spares is not None and spares.is_alive() and len(spares.children) == self.num_workers:
            self.workers: list[Child] = spares.children
            run = spares.promote
            logger.info("engine %d: promoting %d worker(s) started ahead of it (warm spares, or "
                        "a cold start's)", engine_id, self.num_workers)
        else:
            if spares is not None:
                spares.kill()
            handshake = HandshakeServer(self.ctx, ipc_address(runtime_dir, f"{prefix}-workers-hs"))
            self.workers = [spawn_child("worker", rank, f"bastion::worker-{engine_id}-{rank}",
                                        handshake.address) for rank in range(self.num_workers)]

            def run(infos: dict, timeout_s: float) -> dict:
                try:
                    return handshake.run(self.workers, infos, timeout_s)
                finally:
                    handshake.close()
        try:
            self.ready = run(infos, startup_timeout_s)
        except Exception:
            self.shutdown()
            raise

    # -------------------------------------------------------------------------- plumbing

    def _broadcast(self, frames: list[bytes]) -> None:
        for sock in self.inboxes:
            sock.send_multipart(frames, copy=False)

    def _watch(self) -> zmq.Poller:
        """A poller of the workers' messages and of their exits (where the kernel gives
        pidfds), built once: a worker's death wakes a wait at once."""
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self.outbox, zmq.POLLIN)
            for worker in self.workers:
                fd = worker.exit_fd()
                if fd is not None:
                    self._poller.register(fd, zmq.POLLIN)
        return self._poller

    def _recv(self, timeout_s: float | None) -> tuple[MsgKind, object]:
        """Next worker message; raises if a worker died or ``timeout_s`` passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        poller = self._watch()
        while self.outbox not in dict(poller.poll(WORKER_CHECK_INTERVAL_MS)):
            self.check_workers()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerFailure(f"no answer from the workers of engine {self.engine_id} "
                                    f"within {timeout_s:.0f} s", FailureKind.HANG)
        return decode(self.outbox.recv_multipart())

    def dead_worker(self) -> str | None:
        """A message naming a worker process that exited, else None (any thread may ask)."""
        for worker in self.workers:
            code = worker.proc.poll()
            if code is not None:
                return f"{worker.title} exited with code {code}"
        return None

    def check_workers(self) -> None:
        for worker in self.workers:
            if not worker.is_alive():
                raise WorkerFailure(f"{worker.title} exited with code {worker.proc.returncode}",
                                    FailureKind.PROCESS_EXIT)

    def call(self, method: str, *args: object, timeout_s: float | None = 600.0) -> list[object]:
        """Run ``method`` on every worker; results by rank."""
        call_id = next(self._call_ids)
        self._broadcast(encode(WorkerCall(call_id, method, list(args))))
        results: dict[int, object] = {}
        while len(results) < self.num_workers:
            kind, msg = self._recv(timeout_s)
            # NOTE: a failed step makes every rank report it, and the engine raises on the
            # first; the others' reports (and replies to an abandoned call) are stale here.
            # Each worker's messages arrive in order, so once every rank has answered this
            # call nothing older is left in the queue.
            if kind != MsgKind.WORKER_REPLY or msg.call_id != call_id:
                continue
            assert isinstance(msg, WorkerReply)
            if msg.failure is not None:
                raise WorkerFailure(f"worker {self.engine_id}-{msg.rank}: {method}: {msg.failure}")
            results[msg.rank] = msg.result
        return [results[r] for r in range(self.num_workers)]

    # -------------------------------------------------------------------- Executor interface

    def kv_cache_bytes_per_block(self) -> int:
        self._kv_info = self.call("kv_info")
        return self._kv_info[0]["bytes_per_block"]

    def available_kv_cache_bytes(self) -> int:
        # NOTE: every rank holds a 1/TP slice of the heads; the smallest budget bounds them all.
        return min(info["available_bytes"] for info in self._kv_info)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_timings = self.call("init_kv", num_blocks)

    def execute_model_async(self, sched: SchedulerOutput) -> _PendingStep:
        """Send the step to every worker; its tokens are read when ``output()`` is called,
        so the engine can schedule (and send) the next step first."""
        self._broadcast(encode(sched))
        return _PendingStep(self, sched.step_id)

    def _wait_output(self, step_id: int) -> ModelRunnerOutput:
        while True:
            kind, msg = self._recv(timeout_s=None)
            if kind == MsgKind.FAILURE:
                assert isinstance(msg, Failure)
                raise WorkerFailure(f"worker {self.engine_id}-{msg.rank} failed:\n{msg.message}",
                                    msg.kind)
            # Older steps' outputs (abandoned by a fault) arrive first and are skipped.
            if kind == MsgKind.RUNNER_OUTPUT and msg.step_id == step_id:
                return msg

    def reset(self) -> None:
        self.call("reset", timeout_s=30.0)

    @property
    def has_cross_engine_groups(self) -> bool:
        return spans_engines(self.config.parallel)

    def _group_address(self, epoch: int) -> tuple[str, int]:
        """Where the workers meet at ``epoch``: derived from config when the group spans
        engines (they cannot ask each other), else a free local port."""
        par = self.config.parallel
        if self.has_cross_engine_groups:
            return par.data_parallel_address, worker_group_port(par, epoch)
        return "127.0.0.1", pick_free_port()

    def reinit_distributed(self, epoch: int, host: str | None = None,
                           port: int | None = None) -> None:
        """Every worker destroys its groups and builds them again at ``epoch`` (weights stay).
        With cross-engine groups every engine must call this for the same epoch."""
        if host is None or port is None:
            host, port = self._group_address(epoch)
        # NOTE: longer than the workers' own bound (store, arrival and group creation each wait
        # up to the recovery rendezvous time), so a failed rendezvous is reported by the worker.
        wait_s = recovery_rendezvous_timeout_s(self.config.parallel)
        self.call("reinit_distributed", host, port, epoch, timeout_s=3 * wait_s + 10.0)
        self.epoch = epoch

    def destroy_distributed(self) -> None:
        """Drop the workers' groups (e.g. while a peer engine restarts)."""
        self.call("destroy_distributed", timeout_s=30.0)

    def execute_dummy(self, num_rows: int = 1, all_decode: bool = False) -> None:
        """A step with no requests, ``num_rows`` rows of padding, so the expert-parallel
        collectives of idle ranks match the others' (``all_decode``: as a graph replay)."""
        self.execute_model_async(SchedulerOutput(step_id=-1, is_dummy=True,
                                                 num_padded_tokens=num_rows,
                                                 dp_all_decode=all_decode)).output()

    def inject_fault(self, kind: str, rank: int = 0) -> None:
        frames = encode(WorkerCall(next(self._call_ids), "inject_fault", [kind]))
        self.inboxes[rank].send_multipart(frames)

    def shutdown(self) -> None:
        workers = self.workers if hasattr(self, "workers") else []
        # Rank 0 last: it hosts the store of the workers' groups, which the other ranks' NCCL
        # monitors poll every second; closed first, each of them logged a failed poll a second
        # until it exited.
        for rank in [*range(1, len(self.inboxes)), 0]:
            try:
                self.inboxes[rank].send_multipart(shutdown_frames(), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if rank < len(workers):
                try:
                    workers[rank].proc.wait(3.0)
                except subprocess.TimeoutExpired:
                    workers[rank].kill()
        for worker in workers:
            worker.close_exit_fd()
        for sock in self.inboxes:
            sock.close(linger=0)
        self.outbox.close(linger=0)


class _PendingStep:
    """A step sent to the workers; ``output()`` waits for rank 0's tokens (once)."""

    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self.executor = executor
        self.step_id = step_id
        self._output: ModelRunnerOutput | None = None

    def output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self.executor._wait_output(self.step_id)
        return self._output
