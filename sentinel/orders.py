"""Carries out the coordinator's orders on this sentinel's own engine, a step per loop turn.

An order is answered once with an ``OrderDone``; a re-sent order already answered gets the same
answer again, one still running gets nothing (its answer follows), and a newer order replaces
an older one still running (the coordinator gave up on it).

    pause    send PauseEngine; under reinit, a dead, stuck or failing engine is killed and
             started again, paused, on a thread (spawn, load, KV cache, graphs)
    recover  send RecoverEngine (the engine re-creates its DP groups at the epoch: rejoin)
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from bastion.core.config import FaultToleranceConfig
from bastion.ipc.control import (
    Instruction,
    OrderDone,
    PauseEngine,
    PauseOrder,
    RecoverEngine,
    RecoverOrder,
)
from bastion.ipc.messages import FailureKind
from bastion.sentinel.engine_handle import EngineHandle

logger = logging.getLogger(__name__)

STUCK_S = 2.0
_NUM_ANSWERS_KEPT = 16


@dataclass
class _Job:
    order: PauseOrder | RecoverOrder
    stage: str = "new"  # new | command | starting
    seq: int = 0
    deadline: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    phases: dict[str, float] = field(default_factory=dict)


class OrderRunner:
    def __init__(self, rank: int, engine: EngineHandle, ft: FaultToleranceConfig) -> None:
        self.rank = rank
        self.engine = engine
        self.ft = ft
        self.job: _Job | None = None
        self.answers: collections.OrderedDict[int, OrderDone] = collections.OrderedDict()

    def on_order(self, order: PauseOrder | RecoverOrder, now: float) -> list[OrderDone]:
        answer = self.answers.get(order.order_id)
        if answer is not None:
            return [answer]
        if self.job is not None and self.job.order.order_id >= order.order_id:
            return []  # running (its answer follows), or an order older than it
        if self.job is not None:
            logger.warning(
                "sentinel %d: order %d replaces order %d",
                self.rank,
                order.order_id,
                self.job.order.order_id,
            )
        self.job = _Job(order)
        return self.tick(now)

    def tick(self, now: float) -> list[OrderDone]:
        """Advance the running order; its answer once it is done."""
        job = self.job
        if job is None:
            return []
        done = self._advance(job, now)
        if done is None:
            return []
        self.job = None
        self.answers[done.order_id] = done
        while len(self.answers) > _NUM_ANSWERS_KEPT:
            self.answers.popitem(last=False)
        return [done]

    def _done(
        self, job: _Job, ok: bool, kind: FailureKind = FailureKind.NONE, info: str | None = None
    ) -> OrderDone:
        return OrderDone(self.rank, job.order.order_id, ok, kind, info, job.phases)

    def _advance(self, job: _Job, now: float) -> OrderDone | None:
        engine = self.engine
        if job.stage == "starting":
            try:
                if not engine.start_finished():
                    return None
            except Exception as exc:  # noqa: BLE001 - the attempt fails with its message
                return self._done(job, False, FailureKind.EXCEPTION, f"{type(exc).__name__}: {exc}")
            job.phases.update(engine.start_phases)
            return self._done(job, True, info="promoted a warm spare" if engine.promoted
                              else "restarted")
        order = job.order
        reinit = isinstance(order, PauseOrder) and order.instruction == Instruction.REINIT
        if job.stage == "new":
            if engine.is_starting:
                job.stage = "starting"  # a replaced order's restart: this order shares it
                return self._advance(job, now)
            if not engine.is_alive():
                if reinit:
                    return self._restart(job, now)
                return self._done(
                    job,
                    False,
                    FailureKind.PROCESS_EXIT,
                    f"engine {self.rank} process is dead (exit code "
                    f"{engine.exit_code()}); reinit is needed",
                )
            if isinstance(order, PauseOrder):
                # NOTE: an engine already stuck in one step for seconds (a hang, or a
                # collective waiting on a dead peer) cannot obey a pause; reinit restarts it.
                if reinit and engine.busy_for() >= STUCK_S:
                    return self._restart(job, now)
                job.seq = engine.send(PauseEngine(0, order.epoch))
                job.deadline = now + min(10.0, self.ft.ft_hang_timeout_s)
            else:
                job.seq = engine.send(RecoverEngine(0, order.epoch))
                job.deadline = now + self.ft.ft_recovery_timeout_s
            job.stage = "command"
            job.started_at = now
        reply = engine.result(job.seq)
        name = "pause" if isinstance(order, PauseOrder) else "recover"
        if reply is not None and reply.ok:
            if isinstance(order, RecoverOrder):
                job.phases["rejoin"] = now - job.started_at
            return self._done(job, True)
        if reply is not None:
            kind, info = reply.kind, reply.error or "failed"
        elif not engine.is_alive():
            kind = FailureKind.PROCESS_EXIT
            info = f"engine {self.rank} exited with code {engine.exit_code()} during {name}"
        elif now > job.deadline:
            kind = FailureKind.HANG
            info = (
                f"engine {self.rank} did not answer {name} within "
                f"{job.deadline - job.started_at:.0f} s"
            )
        else:
            return None
        if reinit:
            logger.warning("sentinel %d: pause failed (%s); restarting", self.rank, info)
            return self._restart(job, now)
        return self._done(job, False, kind, f"engine {self.rank}: {name}: {info}")

    def _restart(self, job: _Job, now: float) -> OrderDone | None:
        t0 = time.perf_counter()
        self.engine.kill()
        self.engine.begin_start(
            job.order.epoch, start_paused=True, timeout_s=self.ft.ft_recovery_timeout_s
        )
        job.phases["kill"] = time.perf_counter() - t0
        job.stage = "starting"
        return None
