"""Engine-core process (``bastion::engine-N``): the busy loop, plus its control thread.

Work arrives on the input channel and is drained by a daemon thread into a queue; outputs go
out through another. The loop reads as one sentence:

    while running:
        drain_inputs()      # block only when there is no work
        step()              # schedule, execute, update (or a dummy step in a coupled group)

Control (the sentinel's heartbeat, pause, recover, fault injection) has its own channel and
thread (``procs/engine_control.py``), so it is answered even while a step is stuck.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import traceback

import torch
import zmq

from bastion.core.config import ConfigError, EngineConfig
from bastion.core.engine_core import EngineCore
from bastion.core.loader import get_max_model_len, resolve_model
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.control import (
    EngineLaunch,
    FaultInjection,
    HandshakeInfo,
    InjectFault,
    PauseEngine,
    RecoverEngine,
    ShutdownEngine,
)
from bastion.ipc.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    Failure,
    FailureKind,
    LoRARequest,
    Ready,
    UtilityCall,
    UtilityResult,
)
from bastion.procs.engine_control import ControlThread, EngineHealth
from bastion.procs.executor import MultiprocExecutor
from bastion.procs.faults import InjectedFault, failure_kind
from bastion.procs.lifecycle import Spares

logger = logging.getLogger(__name__)


class EngineProc:
    """An ``EngineCore`` with its I/O threads, control thread and busy loop."""

    def __init__(self, core: EngineCore, executor: MultiprocExecutor, config: EngineConfig,
                 ctx: zmq.Context, launch: EngineLaunch) -> None:
        self.core = core
        self.executor = executor
        self.config = config
        self.engine_id = core.engine_id
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.running = True
        self.health = EngineHealth(launch.epoch)
        self.dp_group = None  # the engines' CPU group, when the DP group is coupled (MoE + EP)
        self.injected: FaultInjection | None = None
        self._last_control: tuple[int, bool, str | None, FailureKind] | None = None
        self.is_coupled = core.is_coupled  # MoE + EP over DP: the engines step together
        if self.is_coupled:
            # The group is re-created at each epoch; the core asks whichever is current.
            core.dp_sync = lambda num_tokens, is_decode: self.dp_group.agree(num_tokens,
                                                                             is_decode)
        threading.Thread(target=self._input_thread, args=(ctx, launch.input),
                         daemon=True, name="engine-input").start()
        threading.Thread(target=self._output_thread, args=(ctx, launch.output),
                         daemon=True, name="engine-output").start()
        self.control = ControlThread(ctx, launch.control, self.health, self.inputs,
                                     launch.incarnation, executor.dead_worker)
        self.control.start()

    # ------------------------------------------------------------------------- I/O threads

    def _input_thread(self, ctx: zmq.Context, address: str) -> None:
        sock = ctx.socket(zmq.PULL)
        sock.connect(address)
        while True:
            frames = sock.recv_multipart()
            try:
                self.inputs.put(decode(frames))
            except Exception:  # a malformed frame must not kill the engine
                logger.exception("engine %d: dropped an undecodable message", self.engine_id)

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

    def _emit(self, outs: EngineCoreOutputs) -> None:
        outs.epoch = self.health.epoch
        self.outputs.put(outs)

    # ------------------------------------------------------------------------- busy loop

    def run_busy_loop(self) -> None:
        while self.running:
            self._drain_inputs()
            if not self.running or not self.health.is_running:
                continue
            try:
                self._step()
            except Exception as exc:
                self._on_fault(exc)

    @property
    def _has_work(self) -> bool:
        return self.core.has_unfinished_requests or bool(self.core.scheduler.rejected)

    def _drain_inputs(self) -> None:
        """Handle every queued message. Block for the first only when there is nothing to do;
        an idle engine of a coupled group waits briefly, since the group steps in rounds."""
        if not self.health.is_running or not (self._has_work or self.is_coupled):
            wait: float | None = None
        else:
            wait = 0.0 if self._has_work else 0.002
        while self.running:
            try:
                if wait is None:
                    kind, msg = self.inputs.get()
                elif wait > 0:
                    kind, msg = self.inputs.get(timeout=wait)
                else:
                    kind, msg = self.inputs.get_nowait()
            except queue.Empty:
                return
            self._handle(kind, msg)
            wait = 0.0

    def _step(self) -> None:
        if self.injected is not None:
            self._run_injected_fault()
        if self.is_coupled and not self._has_work:
            with self.health.busy():
                ran = self.core.idle_round()
            if ran:
                self.health.num_steps += 1
            return
        if not self._has_work:
            return
        with self.health.busy():
            out = self.core.step()
        self.health.num_steps += 1
        if out.outputs or self.health.num_steps % 16 == 0:
            self._emit(out)

    def _run_injected_fault(self) -> None:
        kind, self.injected = self.injected, None
        logger.warning("engine %d: injecting fault %s", self.engine_id, kind.name.lower())
        if kind == FaultInjection.HANG:
            with self.health.busy():
                while True:  # a stuck step: only the sentinel can end it
                    time.sleep(3600)
        raise InjectedFault(f"injected fault in the busy loop of engine {self.engine_id}")

    def _on_fault(self, exc: Exception) -> None:
        info = f"{type(exc).__name__}: {exc}"
        logger.error("engine %d: fault: %s\n%s", self.engine_id, info, traceback.format_exc())
        self.health.set_faulted(info)
        self.control.report_fault(failure_kind(exc), info)

    # --------------------------------------------------------------------------- messages

    def _handle(self, kind: MsgKind, msg: object) -> None:
        if kind == MsgKind.ADD:
            assert isinstance(msg, EngineCoreRequest)
            if self.health.is_running:  # while paused, the front end keeps and resubmits it
                self.core.add_request(msg)
        elif kind == MsgKind.ABORT:
            assert isinstance(msg, AbortRequests)
            aborted = self.core.abort_requests(msg.request_ids)
            if aborted:
                self._emit(EngineCoreOutputs(self.engine_id, aborted,
                                             self.core.scheduler.make_stats(), time.time()))
        elif kind == MsgKind.UTILITY:
            assert isinstance(msg, UtilityCall)
            self._emit(EngineCoreOutputs(self.engine_id, utility_result=self._utility(msg)))
        elif kind == MsgKind.CONTROL:
            self._control(msg)
        elif kind == MsgKind.SHUTDOWN:
            self.running = False

    def _utility(self, call: UtilityCall) -> UtilityResult:
        kv = self.core.scheduler.kv
        methods = {"reset_prefix_cache": kv.pool.reset_prefix_cache,
                   "num_free_blocks": lambda: kv.num_free_blocks,
                   "num_blocks": lambda: self.core.num_blocks,
                   "ping": lambda: "pong",
                   "add_lora": lambda name, lora_id, path: self.core.add_lora(
                       LoRARequest(name, lora_id, path)),
                   "remove_lora": self.core.remove_lora,
                   "list_loras": self.core.list_loras}
        if call.method not in methods:
            return UtilityResult(call.call_id, failure=f"unknown utility {call.method!r}")
        try:
            return UtilityResult(call.call_id, methods[call.method](*call.args))
        except Exception as exc:
            return UtilityResult(call.call_id, failure=f"{type(exc).__name__}: {exc}")

    # ----------------------------------------------------------------- control (from sentinel)

    def _control(self, req: PauseEngine | RecoverEngine | InjectFault | ShutdownEngine) -> None:
        """Commands the control thread queued for the loop; the reply goes back through it.

        NOTE: the sentinel re-sends a command it has no answer to under the same ``seq``; a
        repeat (queued behind the original) gets the original's answer and changes nothing."""
        last = self._last_control
        if last is not None and last[0] == req.seq:
            self.control.reply(*last)
            return
        ok, error, kind = True, None, FailureKind.NONE
        try:
            if isinstance(req, PauseEngine):
                self._pause()
            elif isinstance(req, RecoverEngine):
                self._recover(req.epoch)
            elif isinstance(req, InjectFault):
                self._inject(req.kind)
            elif isinstance(req, ShutdownEngine):
                self.running = False
        except Exception as exc:
            logger.exception("engine %d: %s failed", self.engine_id, type(req).__name__)
            ok, error, kind = False, f"{type(exc).__name__}: {exc}", failure_kind(exc)
        self._last_control = (req.seq, ok, error, kind)
        self.control.reply(*self._last_control)

    def _pause(self) -> None:
        """Drop every request and all KV state; the front end holds the requests and resubmits
        them after recovery. Tear down the DP groups."""
        self.health.set_paused()
        self.core.drop_all_requests()
        if self.dp_group is not None:
            self.dp_group.destroy()
            self.dp_group = None
        self.executor.check_workers()
        self.executor.reset()

    def _recover(self, epoch: int) -> None:
        self.core.drop_all_requests()
        self.executor.check_workers()
        if self.executor.has_cross_engine_groups or self.config.parallel.tensor_parallel_size > 1:
            self.executor.reinit_distributed(epoch)
        self.executor.reset()
        if self.is_coupled:
            self.dp_group = make_dp_group(self.config, self.engine_id, epoch, recovering=True)
        self.core.scheduler.step_id = 0
        self.health.set_running(epoch)
        logger.info("engine %d: running at epoch %d", self.engine_id, epoch)

    def _inject(self, kind: FaultInjection) -> None:
        if kind == FaultInjection.WORKER_EXIT:
            self.executor.inject_fault("worker_exit")
        else:
            self.injected = kind

    def close(self) -> None:
        self.outputs.put(None)


class EngineGroup:
    """The engines' CPU (gloo) group of one epoch: the MoE lockstep agreement runs on it."""

    def __init__(self, config: EngineConfig, engine_id: int, epoch: int,
                 recovering: bool = False) -> None:
        from bastion.procs.distributed import (
            RENDEZVOUS_TIMEOUT_S,
            StatelessGroup,
            engine_group_port,
            recovery_rendezvous_timeout_s,
        )

        par = config.parallel
        # NOTE: the sentinels' coordinator listens on the base port itself; the port plan is in
        # procs/distributed.py. At a recovery every engine is already up: a short rendezvous.
        self.group = StatelessGroup(
            "gloo", par.data_parallel_address, engine_group_port(par, epoch), engine_id,
            par.data_parallel_size, par.distributed_timeout_s, name=f"engines-e{epoch}",
            rendezvous_timeout_s=(recovery_rendezvous_timeout_s(par) if recovering
                                  else RENDEZVOUS_TIMEOUT_S))

    def agree(self, num_tokens: int, is_decode_only: bool) -> tuple[int, bool]:
        """One round's padded size: the most tokens any engine scheduled, and whether every
        engine's batch is decode-only (one all-reduce of the maxima)."""
        x = torch.tensor([num_tokens, 0 if is_decode_only else 1], dtype=torch.int64)
        most, any_not_decode = self.group.all_reduce(x, op="max").tolist()
        return int(most), not any_not_decode

    def destroy(self) -> None:
        self.group.destroy()


def make_dp_group(config: EngineConfig, engine_id: int, epoch: int,
                  recovering: bool = False) -> EngineGroup:
    return EngineGroup(config, engine_id, epoch, recovering)


def _start_timings(executor: MultiprocExecutor) -> dict[str, int]:
    """Milliseconds of the start's phases, the slowest worker's (a recovery logs them)."""
    load = max(r.info.get("load_ms", 0) for r in executor.ready.values())
    kv = getattr(executor, "kv_timings", None) or [{}]
    return {"load_ms": load, "kv_cache_ms": max(t.get("kv_cache_ms", 0) for t in kv),
            "graphs_ms": max(t.get("graphs_ms", 0) for t in kv)}


def run_engine(config: EngineConfig, info: HandshakeInfo, handshake: zmq.Socket,
               ctx: zmq.Context, worker_spares: Spares | None = None) -> None:
    engine_id = info.rank
    launch = info.launch
    assert isinstance(launch, EngineLaunch)
    epoch, start_paused = launch.epoch, launch.start_paused
    start = time.perf_counter()
    resolved = resolve_model(config.model)
    max_model_len = get_max_model_len(resolved.hf_config, config.model.max_model_len)
    if launch.num_blocks:
        config = config.replace(cache=dataclasses.replace(
            config.cache, num_gpu_blocks_override=launch.num_blocks))
    executor = MultiprocExecutor(config, launch.runtime_dir, engine_id, epoch=epoch,
                                 defer_groups=start_paused, spares=worker_spares)
    try:
        core = EngineCore(config, executor, max_model_len, engine_id)
    except Exception as exc:
        executor.shutdown()
        handshake.send_multipart(encode(Failure("engine", engine_id, str(exc),
                                                is_user_error=isinstance(exc, ConfigError))))
        raise SystemExit(1) from exc
    proc = EngineProc(core, executor, config, ctx, launch)
    if start_paused:
        proc.health.set_paused()
    else:
        if proc.is_coupled:
            proc.dp_group = make_dp_group(config, engine_id, epoch)
        proc.health.set_running(epoch)
    handshake.send_multipart(encode(Ready("engine", engine_id, os.getpid(),
                                          {"num_blocks": core.num_blocks,
                                           "max_model_len": max_model_len,
                                           **_start_timings(executor)},
                                          [w.proc.pid for w in executor.workers])))
    logger.info("engine %d ready in %.1f s", engine_id, time.perf_counter() - start)
    try:
        proc.run_busy_loop()
    finally:
        proc.close()
        executor.shutdown()
