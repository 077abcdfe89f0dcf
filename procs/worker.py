"""Worker process (``bastion::worker-E-R``): one per device; runs the model runner.

It receives every EXECUTE and WORKER_CALL on its own PULL socket; TP rank 0 answers EXECUTE
with the sampled tokens (every rank runs the same step), every rank answers WORKER_CALLs. A
failure is reported, not fatal: the worker waits to be reset (fault recovery) or shut down.

Before loading its shard the worker joins its process groups (``procs.distributed``): the TP
group of its engine and, with expert parallelism, the EP group over every engine's workers.
``reinit_distributed`` re-creates them at a new epoch while the weights stay loaded.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import statistics
import queue
import threading
import time
import traceback

import torch
import zmq
from bastion.core.config import EngineConfig, cpu_threads_per_worker
from bastion.core.model_runner import ModelRunner, StepHandle
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.control import HandshakeInfo, WorkerLaunch
from bastion.ipc.messages import Failure, Ready, WorkerCall, WorkerReply
from bastion.ops.communicator import (
    GroupCoordinator,
    detach_model_parallel,
    get_ep_group,
    get_tp_group,
    init_model_parallel,
)
from bastion.procs.distributed import (
    RENDEZVOUS_TIMEOUT_S,
    WorkerGroups,
    build_worker_groups,
    recovery_rendezvous_timeout_s,
    spans_engines,
)
from bastion.procs.faults import InjectedFault, failure_kind

logger = logging.getLogger(__name__)

_CALLS = ("kv_info", "init_kv", "reset", "inject_fault", "reinit_distributed",
          "destroy_distributed", "distributed_info", "start_profile", "stop_profile",
          "start_timing", "stop_timing")


class Worker:
    """One TP rank of one engine (DP rank ``dp_rank``)."""

    def __init__(self, config: EngineConfig, rank: int, dp_rank: int = 0) -> None:
        self.config = config
        self.rank = rank  # TP rank inside the engine
        self.dp_rank = dp_rank
        parallel = config.parallel
        self.is_distributed = parallel.tensor_parallel_size > 1 or (
            parallel.enable_expert_parallel and parallel.data_parallel_size > 1)
        self.backend = "nccl" if config.model.device == "cuda" else "gloo"
        self.device = self._select_device()
        self.groups: WorkerGroups | None = None
        self.epoch = 0
        self.runner = ModelRunner(config, self.device)
        self._profile: cProfile.Profile | None = None
        self.timer: StepTimer | None = None

    def _select_device(self) -> torch.device:
        if self.config.model.device != "cuda":
            # Workers of one host share its cores; oversubscribed threads slow every rank.
            torch.set_num_threads(cpu_threads_per_worker(self.config.parallel))
            return torch.device("cpu")
        # NOTE: NCCL's own hang monitor polls the group's TCPStore; the sentinel watches hangs
        # here, and the monitor only outlives a store that its owner rank already closed.
        os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
        tp_size = self.config.parallel.tensor_parallel_size
        index = (self.dp_rank * tp_size + self.rank) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    # ------------------------------------------------------------------ process groups

    def init_distributed(self, host: str, port: int, epoch: int,
                         rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
        """Join this epoch's groups and hand them to the model's layers."""
        if not self.is_distributed:
            return
        self.groups = build_worker_groups(self.config.parallel, self.backend, host, port,
                                          self.dp_rank, self.rank,
                                          rendezvous_timeout_s=rendezvous_timeout_s)
        self.epoch = epoch
        ep = self.groups.ep
        init_model_parallel(GroupCoordinator.from_process_group(self.groups.tp.pg),
                            None if ep is None else GroupCoordinator.from_process_group(ep.pg))

    def reserve_ranks(self) -> None:
        """Set this worker's TP/EP ranks and sizes without joining any group, so the model
        loads its shards now and the groups are joined later (``reinit_distributed``)."""
        par = self.config.parallel
        tp_size = par.tensor_parallel_size
        tp = get_tp_group()
        tp.rank, tp.world_size, tp.group = self.rank, tp_size, None
        if par.enable_expert_parallel:
            ep = get_ep_group()
            ep_size = tp_size * (par.data_parallel_size if spans_engines(par) else 1)
            ep.rank = (self.dp_rank * tp_size + self.rank) if spans_engines(par) else self.rank
            ep.world_size, ep.group = ep_size, None

    def destroy_distributed(self) -> None:
        """Drop the groups (safe when a peer died); the model waits for ``reinit``."""
        detach_model_parallel()
        groups, self.groups = self.groups, None
        if groups is not None:
            groups.destroy()

    def reinit_distributed(self, host: str, port: int, epoch: int) -> int:
        """Destroy the old groups and join new ones at ``host:port`` for ``epoch``; the weights
        stay loaded (ranks do not change). Every worker of the group must call it; the peers are
        all running, so it waits for them only ``recovery_rendezvous_timeout_s``."""
        start = time.perf_counter()
        self.destroy_distributed()
        self.init_distributed(host, int(port), int(epoch),
                              recovery_rendezvous_timeout_s(self.config.parallel))
        logger.info("worker %d-%d: groups re-created at epoch %d in %.2f s", self.dp_rank,
                    self.rank, epoch, time.perf_counter() - start)
        return self.epoch

    def distributed_info(self) -> dict[str, object]:
        groups = self.groups
        return {"epoch": self.epoch, "dp_rank": self.dp_rank, "tp_rank": self.rank,
                "tp_size": groups.tp.world_size if groups else 1,
                "ep_size": groups.ep.world_size if groups and groups.ep else 1,
                "port": groups.root.port if groups else 0}

    # ------------------------------------------------------------------ worker calls

    def kv_info(self) -> dict[str, int]:
        # NOTE: with a fixed pool size there is nothing to profile, and a restarted worker
        # could not: its profiling forward would need the groups it rejoins only at recover.
        fixed = self.config.cache.num_gpu_blocks_override is not None
        return {"bytes_per_block": self.runner.kv_cache_bytes_per_block(),
                "available_bytes": 0 if fixed else self.runner.available_kv_cache_bytes()}

    def init_kv(self, num_blocks: int) -> dict[str, int]:
        """Allocate the KV cache (and capture graphs); milliseconds of each, for the logs."""
        start = time.perf_counter()
        self.runner.initialize_kv_cache(num_blocks)
        total_ms = int((time.perf_counter() - start) * 1000)
        graphs_ms = int(self.runner.graph_capture_s * 1000)
        return {"kv_cache_ms": total_ms - graphs_ms, "graphs_ms": graphs_ms}

    def reset(self) -> None:
        self.runner.reset()

    def inject_fault(self, kind: str) -> None:
        """Fault drills only (the engine gates this behind --enable-fault-injection)."""
        if kind == "worker_exit":
            os._exit(17)
        if kind == "hang":
            while True:
                time.sleep(3600)
        raise InjectedFault(f"injected fault in worker {self.rank}")

    def start_profile(self) -> None:
        """Profile this worker's loop (its thread: every step's host work) with cProfile until
        ``stop_profile`` (benchmarks: where a worker process's step time goes)."""
        self._profile = cProfile.Profile()
        self._profile.enable()

    def stop_profile(self, num_rows: int = 30) -> str:
        """End ``start_profile``'s profile; its top ``num_rows`` calls by own time, as text."""
        profile, self._profile = self._profile, None
        if profile is None:
            raise RuntimeError("no profile was started")
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(num_rows)
        return text.getvalue()

    def start_timing(self, names: list[str]) -> None:
        """Time this worker's steps until ``stop_timing`` (benchmarks): each step's period
        (launch to launch), its launch, when its predecessor's tokens were sent, and each
        method in ``names`` (dotted from the runner, e.g. ``grammars._filler.fill``)."""
        self.timer = StepTimer(self.runner, names)

    def stop_timing(self) -> dict[str, float]:
        """The median ms per step of each part ``start_timing`` timed."""
        timer, self.timer = self.timer, None
        if timer is None:
            raise RuntimeError("no timing was started")
        return timer.stop()

    def handle_call(self, call: WorkerCall) -> WorkerReply:
        if call.method not in _CALLS:
            return WorkerReply(call.call_id, self.rank, failure=f"unknown method {call.method}")
        try:
            result = getattr(self, call.method)(*call.args)
            return WorkerReply(call.call_id, self.rank, result)
        except Exception as exc:  # reported to the engine, which decides
            logger.exception("worker %d: %s failed", self.rank, call.method)
            return WorkerReply(call.call_id, self.rank, failure=f"{type(exc).__name__}: {exc}")


def run_worker(config: EngineConfig, info: HandshakeInfo, handshake: zmq.Socket,
               ctx: zmq.Context) -> None:
    launch = info.launch
    assert isinstance(launch, WorkerLaunch)
    worker = Worker(config, info.rank, launch.dp_rank)
    if worker.is_distributed and launch.defer_groups:
        worker.reserve_ranks()
    elif worker.is_distributed:
        worker.init_distributed(launch.dist_host, launch.dist_port, launch.epoch)
    start = time.perf_counter()
    worker.runner.load_model()
    load_ms = int((time.perf_counter() - start) * 1000)
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(launch.execute)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.connect(launch.worker_out)
    handshake.send_multipart(encode(Ready("worker", info.rank, os.getpid(),
                                          {"load_ms": load_ms})))
    try:
        _serve(worker, inbox, outbox)
    finally:
        worker.destroy_distributed()


def _serve(worker: Worker, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
    """The worker's loop: launch each step as it arrives and hand its tokens to the sender
    thread, which waits for them while this loop already prepares the next step."""
    sender = _Sender(outbox, worker.rank, worker.device, worker)
    sender.start()
    try:
        while True:
            kind, msg = decode(inbox.recv_multipart())
            if kind == MsgKind.SHUTDOWN:
                return
            if kind == MsgKind.WORKER_CALL:
                sender.put(encode(worker.handle_call(msg)))
                continue
            try:
                handle = worker.runner.execute_model_async(msg)
            except Exception as exc:
                logger.exception("worker %d: step failed", worker.rank)
                sender.put(encode(Failure("worker", worker.rank, traceback.format_exc(),
                                          kind=failure_kind(exc))))
                continue
            if worker.rank == 0:
                sender.put(handle)
    finally:
        sender.close()


class _Sender(threading.Thread):
    """Owns the worker's outgoing socket; sends replies in the order they were queued, and
    for a step first waits for its sampled tokens (a failure then is reported like any)."""

    def __init__(self, outbox: zmq.Socket, rank: int, device: torch.device,
                 worker: Worker) -> None:
        super().__init__(daemon=True, name="worker-sender")
        self.outbox = outbox
        self.worker = worker  # its step timer, when a benchmark set one
        self.rank = rank
        self.device = device
        self.items: queue.SimpleQueue[list[bytes] | StepHandle | None] = queue.SimpleQueue()

    def put(self, item: list[bytes] | StepHandle) -> None:
        self.items.put(item)

    def close(self) -> None:
        self.items.put(None)
        self.join(timeout=5.0)

    def run(self) -> None:
        if self.device.type == "cuda":
            # NOTE: a new thread starts on GPU 0; waiting on an event there would give this
            # worker a second CUDA context on another engine's GPU.
            torch.cuda.set_device(self.device)
        while (item := self.items.get()) is not None:
            step = isinstance(item, StepHandle)
            if step:
                try:
                    output = item.output()
                    if (timer := self.worker.timer) is not None:
                        timer.mark("tokens at")
                    item = encode(output)
                except Exception as exc:
                    logger.exception("worker %d: step failed", self.rank)
                    item = encode(Failure("worker", self.rank, traceback.format_exc(),
                                          kind=failure_kind(exc)))
            self.outbox.send_multipart(item)
            if step and (timer := self.worker.timer) is not None:
                timer.mark("sent at")


class StepTimer:
    """Wall time of a worker's steps by part (``Worker.start_timing``): wrappers around the
    runner's methods, summed per step; a step starts with ``execute_model_async``."""

    def __init__(self, runner: ModelRunner, names: list[str]) -> None:
        self._undo: list[tuple[object, str]] = []
        self.steps: list[dict[str, float]] = []
        self.step: dict[str, float] = {}
        self._start: float | None = None
        launch = runner.execute_model_async

        def timed_launch(sched):
            now = time.perf_counter()
            if self._start is not None:
                self.step["period"] = now - self._start
                self.steps.append(self.step)
            self.step, self._start = {}, now
            try:
                return launch(sched)
            finally:
                self.step["launch"] = time.perf_counter() - now

        self._install(runner, "execute_model_async", timed_launch)
        for name in names:
            *path, attr = name.split(".")
            owner = runner
            for part in path:
                owner = getattr(owner, part)
            if owner is not None:  # e.g. no graph runner on the CPU: that part reads 0
                self._install(owner, attr, self._wrap(getattr(owner, attr), name))

    def _wrap(self, method, name: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.step[name] = self.step.get(name, 0.0) + time.perf_counter() - start
        return timed

    def _install(self, owner: object, attr: str, fn) -> None:
        setattr(owner, attr, fn)
        self._undo.append((owner, attr))

    def mark(self, name: str) -> None:
        """Something of the step before happened now (from either thread): its tokens reached
        the sender ("tokens at"), or went out ("sent at")."""
        if self._start is not None:
            self.step[name] = time.perf_counter() - self._start

    def stop(self) -> dict[str, float]:
        for owner, attr in self._undo:
            delattr(owner, attr)
        steps = self.steps[2:] or self.steps
        names = sorted({k for s in steps for k in s})
        return {k: 1e3 * statistics.median(s.get(k, 0.0) for s in steps) for k in names}
