"""The group's recovery state machine, run by sentinel 0: ``on_event(event, now) -> orders``.

It never blocks, sleeps or touches a socket: the sentinel's one loop feeds it peer messages
(``PeerHello``, ``FaultReport``, ``OrderDone``, ``ApplyRequest``) and timer ``Tick``s, and
carries out the ``Send`` orders it returns. Every rank, rank 0 included, receives its orders
as messages.

    STARTING ──all hello──► IDLE ──fault (auto) / apply──► PAUSING ──all done──► RECOVERING
       ▲                     ▲  └─fault (manual)─► PAUSING (pause only) ─► IDLE (unhealthy)   │
       │                     └────────────────────── all done ok ─────────────────────────────┘
                   attempt failed, attempts left ─► BACKOFF ─► PAUSING (next epoch)
                   attempt failed, none left ─► DEAD (auto) or IDLE, unhealthy (an operator's)

An attempt is two phases over all sentinels at a new epoch: pause (every engine drops its
batch and KV state; reinit also replaces a dead, hung or failing engine) and recover (every
engine re-creates its DP groups at the epoch). A phase ends when every sentinel has answered
its order or when ``ft_recovery_timeout_s`` passes; an unanswered order is re-sent every
``RESEND_S`` (a receiver answers a re-sent order again without acting twice), so an order sent
before a peer could hear it is not lost. A fault at the attempt's epoch fails the attempt.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import uuid
from typing import NamedTuple

import msgspec

from bastion.core.config import FaultToleranceConfig
from bastion.ipc.control import (
    ApplyRequest,
    FaultReport,
    GroupFatal,
    GroupStatus,
    Instruction,
    OrderDone,
    PauseOrder,
    PeerHello,
    RecoverOrder,
)
from bastion.ipc.messages import EngineState, EngineStatus, FailureKind

logger = logging.getLogger(__name__)

RESEND_S = 0.5


class Phase(enum.IntEnum):
    STARTING = 0  # waiting for every sentinel's hello
    IDLE = 1  # no attempt running (healthy, or faulted and waiting for an operator)
    PAUSING = 2
    RECOVERING = 3
    BACKOFF = 4  # an attempt failed; the next starts at ``backoff_until``
    DEAD = 5  # automatic recovery is exhausted


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed (the sentinel's loop sends one per turn)."""


Event = PeerHello | FaultReport | OrderDone | ApplyRequest | Tick


class Send(NamedTuple):
    """Deliver ``msg`` to sentinel ``rank`` (rank 0 is the coordinator's own sentinel)."""

    rank: int
    msg: PauseOrder | RecoverOrder | GroupStatus | GroupFatal


@dataclasses.dataclass
class _Attempt:
    instruction: Instruction
    source: str  # auto | manual
    request_id: str | None
    max_attempts: int
    number: int = 0
    started_at: float = 0.0
    error: str | None = None

    @property
    def action(self) -> str:
        return f"{self.source}-{self.instruction.name.lower()}"


@dataclasses.dataclass
class _Outstanding:
    msg: PauseOrder | RecoverOrder
    sent_at: float


class Coordinator:
    def __init__(self, ft: FaultToleranceConfig, ranks: list[int]) -> None:
        """``ranks``: the engines that pause and recover together, the coordinator's own
        first (every DP rank of an expert-parallel group; one engine of a dense group)."""
        self.ft = ft
        self.ranks = list(ranks)
        self.phase = Phase.STARTING
        self.epoch = 0
        self._statuses = {r: EngineStatus(r, EngineState.STARTING) for r in self.ranks}
        self.statuses = list(self._statuses.values())
        self.hellos = {self.ranks[0]}
        self.attempt: _Attempt | None = None
        self.queued: collections.deque[ApplyRequest] = collections.deque()
        self.outstanding: dict[int, _Outstanding] = {}  # rank -> order not yet done
        self.done: dict[int, OrderDone] = {}  # rank -> its answer in this phase
        self.phase_deadline = 0.0
        self.backoff_until = 0.0
        self._order_ids = 0
        self.phases: dict[int, dict[str, float]] = {}  # rank -> seconds per phase, this attempt
        self.last_recovery_s: float | None = None

    # ---------------------------------------------------------------------------- events

    def on_event(self, event: Event, now: float) -> list[Send]:
        if isinstance(event, PeerHello):
            return self._on_hello(event.sender, now)
        if self.phase == Phase.STARTING:
            if isinstance(event, ApplyRequest):
                self.queued.append(event)
            return []
        if self.phase == Phase.DEAD:
            return []
        if isinstance(event, FaultReport):
            return self._on_fault(event, now)
        if isinstance(event, OrderDone):
            return self._on_done(event, now)
        if isinstance(event, ApplyRequest):
            return self._on_apply(event, now)
        return self._on_tick(now)

    def _on_hello(self, rank: int, now: float) -> list[Send]:
        self.hellos.add(rank)
        if self.phase == Phase.STARTING:
            if len(self.hellos) < len(self.ranks):
                return []
            self.phase = Phase.IDLE
            for status in self.statuses:
                status.state = EngineState.HEALTHY
            orders = self._broadcast_status()
            if self.queued:
                orders += self._on_apply(self.queued.popleft(), now)
            return orders
        # A sentinel that came back (its API restarted it): tell it where the group stands
        # and give it the order it is missing at once.
        orders = [Send(rank, self._status_msg())]
        if self.phase == Phase.DEAD:
            orders = [Send(rank, GroupFatal(self.epoch, self.attempt.error or "dead"))]
        pending = self.outstanding.get(rank)
        if pending is not None:
            pending.sent_at = now
            orders.append(Send(rank, pending.msg))
        return orders

    def _on_fault(self, fault: FaultReport, now: float) -> list[Send]:
        rank = fault.sender
        if self.phase in (Phase.PAUSING, Phase.RECOVERING):
            if fault.epoch < self.epoch or self.attempt.instruction == Instruction.PAUSE:
                # Seen before this attempt: the attempt is what handles it. Its kind is still
                # recorded: when a peer's error arrives first (a collective broken by a killed
                # engine), this report is the only one that names the cause.
                self._mark(rank, fault)
                return self._broadcast_status()
            logger.error("coordinator: engine %d faulted during the attempt: %s", rank, fault.info)
            self.attempt.error = self.attempt.error or f"engine {rank}: {fault.info}"
            self._mark(rank, fault)
            return []
        if self.phase == Phase.BACKOFF:
            self._mark(rank, fault)  # the next attempt (reinit) covers it
            return []
        if all(s.state != EngineState.HEALTHY for s in self.statuses):
            self._mark(rank, fault)  # already handled; waiting for an operator
            return self._broadcast_status()
        logger.error("coordinator: engine %d faulted: %s", rank, fault.info)
        for status in self.statuses:
            status.state = EngineState.UNHEALTHY
            status.fault_info = f"paused: engine {rank} faulted"
            status.fault_kind = FailureKind.NONE
        self._mark(rank, fault)
        orders = self._broadcast_status()
        if self.ft.ft_auto_recovery:
            attempt = _Attempt(
                Instruction.REINIT, "auto", f"auto-{uuid.uuid4().hex[:12]}", self.ft.ft_max_attempts
            )
        else:
            attempt = _Attempt(Instruction.PAUSE, "auto", None, 1)
        return orders + self._start_attempt(attempt, now)

    def _mark(self, rank: int, fault: FaultReport) -> None:
        status = self._statuses[rank]
        status.fault_info, status.fault_kind = fault.info, fault.kind
        if status.state == EngineState.HEALTHY:
            status.state = EngineState.UNHEALTHY

    def _on_apply(self, request: ApplyRequest, now: float) -> list[Send]:
        attempt = _Attempt(request.instruction, "manual", request.request_id, 1)
        if self.phase in (Phase.PAUSING, Phase.RECOVERING):
            self.queued.append(request)  # after the attempt in progress
            return []
        if self.phase == Phase.BACKOFF:
            logger.warning(
                "coordinator: operator's %s replaces the automatic attempts", attempt.action
            )
        return self._start_attempt(attempt, now)

    def _on_tick(self, now: float) -> list[Send]:
        if self.phase == Phase.BACKOFF and now >= self.backoff_until:
            return self._start_attempt(self.attempt, now)
        if self.phase not in (Phase.PAUSING, Phase.RECOVERING):
            return []
        if now >= self.phase_deadline:
            missing = sorted(self.outstanding)
            kind = "paused" if self.phase == Phase.PAUSING else "recovered"
            self.attempt.error = "; ".join(
                filter(
                    None,
                    [
                        self.attempt.error,
                        f"no {kind} reply from sentinel(s) {missing} at epoch {self.epoch}",
                    ],
                )
            )
            for rank in missing:
                self._statuses[rank].fault_kind = FailureKind.UNREACHABLE
            self.outstanding.clear()
            return self._end_phase(now)
        orders = []
        for rank, pending in self.outstanding.items():
            if now - pending.sent_at >= RESEND_S:
                pending.sent_at = now
                orders.append(Send(rank, pending.msg))
        return orders

    def _on_done(self, done: OrderDone, now: float) -> list[Send]:
        pending = self.outstanding.get(done.sender)
        if pending is None or pending.msg.order_id != done.order_id:
            return []  # an answer to an order of an earlier phase, or a repeat
        del self.outstanding[done.sender]
        self.done[done.sender] = done
        self.phases.setdefault(done.sender, {}).update(done.phases)
        if not done.ok:
            self.attempt.error = "; ".join(
                filter(None, [self.attempt.error, f"engine {done.sender}: {done.info}"])
            )
        return [] if self.outstanding else self._end_phase(now)

    # -------------------------------------------------------------------------- attempts

    def _start_attempt(self, attempt: _Attempt, now: float) -> list[Send]:
        self.attempt = attempt
        attempt.number += 1
        attempt.started_at = now
        attempt.error = None
        self.phases = {}
        if attempt.instruction != Instruction.PAUSE:
            self.epoch += 1  # a pause alone keeps the epoch: nothing rejoins
            self._set_all(EngineState.RECOVERING)
            logger.warning(
                "coordinator: %s attempt %d at epoch %d", attempt.action, attempt.number, self.epoch
            )
        return self._broadcast_status() + self._order_all(
            Phase.PAUSING,
            lambda order_id: PauseOrder(order_id, self.epoch, attempt.instruction),
            now,
        )

    def _order_all(self, phase: Phase, make, now: float) -> list[Send]:
        self.phase = phase
        self.phase_deadline = now + self.ft.ft_recovery_timeout_s
        self.done = {}
        self._order_ids += 1
        msg = make(self._order_ids)
        self.outstanding = {rank: _Outstanding(msg, now) for rank in self.ranks}
        return [Send(rank, msg) for rank in self.ranks]

    def _end_phase(self, now: float) -> list[Send]:
        attempt = self.attempt
        if attempt.error is None and self.phase == Phase.PAUSING:
            if attempt.instruction == Instruction.PAUSE:
                return self._end_attempt(now, EngineState.UNHEALTHY)
            return self._order_all(
                Phase.RECOVERING, lambda order_id: RecoverOrder(order_id, self.epoch), now
            )
        if attempt.error is None:
            self.last_recovery_s = now - attempt.started_at
            self._record_phases(self.last_recovery_s)
            logger.warning(
                "coordinator: group healthy at epoch %d after %.2f s",
                self.epoch,
                self.last_recovery_s,
            )
            for status in self.statuses:
                status.fault_info, status.fault_kind = None, FailureKind.NONE
            return self._end_attempt(now, EngineState.HEALTHY)
        logger.error(
            "coordinator: %s attempt %d failed: %s", attempt.action, attempt.number, attempt.error
        )
        if attempt.instruction == Instruction.PAUSE:
            return self._end_attempt(now, EngineState.UNHEALTHY)
        if attempt.number < attempt.max_attempts:
            self.phase = Phase.BACKOFF
            self.backoff_until = now + self.ft.ft_backoff_s * 2 ** (attempt.number - 1)
            for status in self.statuses:
                status.last_action_error = attempt.error
            return self._broadcast_status()
        if attempt.source == "auto":
            logger.critical(
                "coordinator: recovery exhausted after %d attempts: %s",
                attempt.number,
                attempt.error,
            )
            self.phase = Phase.DEAD
            self._set_all(EngineState.DEAD)
            fatal = GroupFatal(self.epoch, attempt.error)
            return self._broadcast_status() + [Send(rank, fatal) for rank in self.ranks]
        return self._end_attempt(now, EngineState.UNHEALTHY)

    def _end_attempt(self, now: float, state: EngineState) -> list[Send]:
        """Back to IDLE: ``state`` for every engine, DEAD for those whose process is gone."""
        self.phase = Phase.IDLE
        self._set_all(state)
        if state != EngineState.HEALTHY:
            for rank, done in self.done.items():
                if done.kind == FailureKind.PROCESS_EXIT:
                    status = self._statuses[rank]
                    status.state, status.fault_info, status.fault_kind = (
                        EngineState.DEAD,
                        done.info,
                        done.kind,
                    )
        orders = self._broadcast_status()
        if self.queued:
            orders += self._on_apply(self.queued.popleft(), now)
        return orders

    def _record_phases(self, total_s: float) -> None:
        """One log line per phase of each engine's part in the recovery, and the status's copy."""
        for rank, status in self._statuses.items():
            phases = {**self.phases.get(rank, {}), "total": total_s}
            status.last_recovery_phases = phases
            for name, seconds in phases.items():
                logger.info(
                    "coordinator: epoch %d engine %d phase %s: %.3f s",
                    self.epoch,
                    rank,
                    name,
                    seconds,
                )

    # ---------------------------------------------------------------------------- status

    def _set_all(self, state: EngineState) -> None:
        attempt = self.attempt
        for status in self.statuses:
            status.state = state
            status.epoch = self.epoch
            if attempt is not None and attempt.instruction != Instruction.PAUSE:
                status.last_action = attempt.action
                status.last_action_id = attempt.request_id
                if state != EngineState.RECOVERING:
                    status.last_action_error = attempt.error

    def _status_msg(self) -> GroupStatus:
        # Copies: rank 0's own sentinel receives the message in this process.
        return GroupStatus(self.epoch, [msgspec.structs.replace(s) for s in self.statuses])

    def _broadcast_status(self) -> list[Send]:
        msg = self._status_msg()
        return [Send(rank, msg) for rank in self.ranks]
