"""The coordinator's state machine without sockets or processes: event sequences -> orders.

Each table row is (time, event, the orders expected back); orders are written as short
strings (``pause@2/reinit->0,1``: a PauseOrder at epoch 2 to ranks 0 and 1), status and fatal
broadcasts as ``status`` and ``fatal``.
"""

from __future__ import annotations

import pytest

from bastion.core.config import ConfigError, FaultToleranceConfig
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
from bastion.ipc.messages import EngineState, FailureKind
from bastion.sentinel.coordinator import RESEND_S, Coordinator, Phase, Tick

FT = FaultToleranceConfig(ft_max_attempts=2, ft_backoff_s=1.0, ft_recovery_timeout_s=10.0)


def summarize(orders) -> list[str]:
    """Group sends of one message to several ranks into one string per message."""
    out: list[str] = []
    by_msg: dict[int, list[int]] = {}
    msgs = []
    for rank, msg in orders:
        if id(msg) not in by_msg:
            by_msg[id(msg)] = []
            msgs.append(msg)
        by_msg[id(msg)].append(rank)
    for msg in msgs:
        ranks = ",".join(map(str, by_msg[id(msg)]))
        if isinstance(msg, GroupStatus):
            out.append("status")
        elif isinstance(msg, GroupFatal):
            out.append("fatal")
        elif isinstance(msg, PauseOrder):
            out.append(f"pause@{msg.epoch}/{msg.instruction.name.lower()}->{ranks}")
        elif isinstance(msg, RecoverOrder):
            out.append(f"recover@{msg.epoch}->{ranks}")
    return out


class Driver:
    """Feeds events; answers the last orders by rank (``done(rank)``)."""

    def __init__(self, ft: FaultToleranceConfig = FT, ranks: tuple[int, ...] = (0, 1)) -> None:
        self.c = Coordinator(ft, list(ranks))
        self.last: dict[int, PauseOrder | RecoverOrder] = {}

    def feed(self, now: float, event) -> list[str]:
        orders = self.c.on_event(event, now)
        for rank, msg in orders:
            if isinstance(msg, (PauseOrder, RecoverOrder)):
                self.last[rank] = msg
        return summarize(orders)

    def done(
        self,
        rank: int,
        ok: bool = True,
        kind: FailureKind = FailureKind.NONE,
        info: str | None = None,
        phases: dict | None = None,
    ) -> OrderDone:
        return OrderDone(rank, self.last[rank].order_id, ok, kind, info, phases or {})

    def states(self) -> list[str]:
        return [s.state.name.lower() for s in self.c.statuses]


def fault(rank: int, epoch: int = 0, kind: FailureKind = FailureKind.INJECTED) -> FaultReport:
    return FaultReport(rank, epoch, kind, f"engine {rank} broke")


def apply(instruction: Instruction, request_id: str = "ft-1") -> ApplyRequest:
    return ApplyRequest(1, request_id, instruction)


def started(ft: FaultToleranceConfig = FT) -> Driver:
    d = Driver(ft)
    assert d.feed(0.0, Tick()) == []
    assert d.feed(0.0, PeerHello(1)) == ["status"]
    assert d.c.phase == Phase.IDLE and d.states() == ["healthy", "healthy"]
    return d


def run_table(d: Driver, table) -> None:
    for i, (now, event, expected) in enumerate(table):
        if callable(event):
            event = event(d)
        got = d.feed(now, event)
        assert got == expected, f"row {i}: {event!r} -> {got}, expected {expected}"


def test_fault_pause_recover_healthy_at_the_next_epoch():
    d = started()
    run_table(
        d,
        [
            (1.0, fault(1), ["status", "status", "pause@1/reinit->0,1"]),
            (1.1, lambda d: d.done(0), []),
            (
                1.2,
                lambda d: d.done(
                    1, info="restarted", phases={"spawn_or_promote": 0.5, "load": 0.2}
                ),
                ["recover@1->0,1"],
            ),
            (1.3, lambda d: d.done(1, phases={"rejoin": 0.1}), []),
            (1.4, lambda d: d.done(0), ["status"]),
        ],
    )
    assert d.c.phase == Phase.IDLE and d.states() == ["healthy", "healthy"]
    assert d.c.epoch == 1 and d.c.statuses[1].last_action == "auto-reinit"
    assert d.c.last_recovery_s == pytest.approx(0.4)
    assert d.c.statuses[1].last_recovery_phases == {
        "spawn_or_promote": 0.5,
        "load": 0.2,
        "rejoin": 0.1,
        "total": pytest.approx(0.4),
    }


def test_unanswered_orders_are_resent_until_done_and_repeats_are_ignored():
    d = started()
    d.feed(1.0, fault(0))
    first = d.last[1]
    run_table(
        d,
        [
            (1.0 + RESEND_S / 2, Tick(), []),
            (1.0 + RESEND_S, Tick(), ["pause@1/reinit->0,1"]),
            (1.0 + RESEND_S, lambda d: d.done(0), []),
            (1.0 + 2 * RESEND_S, Tick(), ["pause@1/reinit->1"]),  # rank 0 answered: not re-sent
        ],
    )
    assert d.last[1].order_id == first.order_id  # the same order, not a new one
    run_table(
        d,
        [
            (2.5, lambda d: d.done(1), ["recover@1->0,1"]),
            (
                2.6,
                OrderDone(1, first.order_id),
                [],
            ),  # a repeat of an earlier answer changes nothing
        ],
    )
    assert d.c.phase == Phase.RECOVERING and set(d.c.outstanding) == {0, 1}


def test_a_peer_that_never_answers_fails_the_attempt_then_backoff_then_dead():
    d = started()
    d.feed(0.0, fault(1))
    d.feed(0.1, d.done(0))
    run_table(
        d,
        [
            (9.9, Tick(), ["pause@1/reinit->1"]),
            (10.0, Tick(), ["status"]),  # the phase's deadline: attempt 1 failed
        ],
    )
    assert d.c.phase == Phase.BACKOFF
    assert "no paused reply from sentinel(s) [1] at epoch 1" in d.c.statuses[0].last_action_error
    assert d.c.statuses[1].fault_kind == FailureKind.UNREACHABLE
    run_table(
        d,
        [
            (10.5, Tick(), []),  # backoff: 1 s after the first failed attempt
            (11.0, Tick(), ["status", "pause@2/reinit->0,1"]),
            (11.1, lambda d: d.done(0), []),
            (21.0, Tick(), ["status", "fatal"]),  # the attempt limit (2): dead
        ],
    )
    assert d.c.phase == Phase.DEAD and d.states() == ["dead", "dead"]
    assert d.feed(22.0, fault(0, epoch=2)) == [] and d.feed(23.0, Tick()) == []
    assert d.feed(24.0, apply(Instruction.REINIT)) == []
    assert d.feed(25.0, PeerHello(1)) == ["fatal"]  # a sentinel that came back learns it


def test_backoff_doubles_between_attempts():
    d = started(
        FaultToleranceConfig(ft_max_attempts=3, ft_backoff_s=1.0, ft_recovery_timeout_s=10.0)
    )
    d.feed(0.0, fault(1))
    d.feed(0.1, d.done(0))
    d.feed(0.2, d.done(1, ok=False, info="EADDRINUSE"))
    assert d.c.phase == Phase.BACKOFF and d.c.backoff_until == pytest.approx(1.2)
    assert d.feed(1.2, Tick()) == ["status", "pause@2/reinit->0,1"]
    d.feed(1.3, d.done(0))
    d.feed(1.4, d.done(1))
    d.feed(1.5, d.done(0, ok=False, info="rendezvous timed out"))
    d.feed(1.6, d.done(1))
    assert d.c.phase == Phase.BACKOFF and d.c.backoff_until == pytest.approx(3.6)
    assert d.feed(3.6, Tick()) == ["status", "pause@3/reinit->0,1"]


def test_a_fault_during_recovery_fails_that_attempt_and_an_older_one_does_not():
    d = started()
    d.feed(0.0, fault(1, epoch=0))
    run_table(
        d,
        [
            # Seen before the attempt: the attempt handles it; its kind is recorded all the same.
            (0.1, fault(0, epoch=0, kind=FailureKind.PROCESS_EXIT), ["status"]),
            (0.2, lambda d: d.done(0), []),
            (0.3, lambda d: d.done(1), ["recover@1->0,1"]),
            (0.4, fault(1, epoch=1, kind=FailureKind.PROCESS_EXIT), []),  # at the attempt's epoch
            (0.5, lambda d: d.done(0), []),
            (0.6, lambda d: d.done(1), ["status"]),  # every answer is in: the attempt failed
        ],
    )
    assert d.c.phase == Phase.BACKOFF and "engine 1: engine 1 broke" in d.c.attempt.error
    assert "engine 0" not in d.c.attempt.error
    assert [s.fault_kind for s in d.c.statuses] == [FailureKind.PROCESS_EXIT] * 2
    assert d.feed(1.6, Tick()) == ["status", "pause@2/reinit->0,1"]


def test_manual_mode_pauses_then_one_apply_recovers():
    d = started(FaultToleranceConfig(ft_auto_recovery=False))
    run_table(
        d,
        [
            (0.0, fault(1), ["status", "status", "pause@0/pause->0,1"]),  # pause only: same epoch
            (0.1, lambda d: d.done(0), []),
            (0.2, lambda d: d.done(1), ["status"]),
        ],
    )
    assert d.c.phase == Phase.IDLE and d.states() == ["unhealthy", "unhealthy"]
    assert d.c.statuses[1].fault_info == "engine 1 broke"
    run_table(
        d,
        [
            (1.0, apply(Instruction.RETRY, "ft-9"), ["status", "pause@1/retry->0,1"]),
            (1.1, lambda d: d.done(0), []),
            (1.2, lambda d: d.done(1), ["recover@1->0,1"]),
            (1.3, lambda d: d.done(0), []),
            (1.4, lambda d: d.done(1), ["status"]),
        ],
    )
    assert d.states() == ["healthy", "healthy"]
    assert d.c.statuses[0].last_action == "manual-retry"
    assert d.c.statuses[0].last_action_id == "ft-9"


def test_manual_retry_of_a_dead_engine_fails_once_and_reinit_recovers():
    d = started(FaultToleranceConfig(ft_auto_recovery=False))
    d.feed(0.0, fault(1, kind=FailureKind.PROCESS_EXIT))
    d.feed(0.1, d.done(0))
    d.feed(0.2, d.done(1, ok=False, kind=FailureKind.PROCESS_EXIT, info="process is dead"))
    assert d.states() == ["unhealthy", "dead"]
    run_table(
        d,
        [
            (1.0, apply(Instruction.RETRY), ["status", "pause@1/retry->0,1"]),
            (1.1, lambda d: d.done(0), []),
            (
                1.2,
                lambda d: d.done(
                    1, ok=False, kind=FailureKind.PROCESS_EXIT, info="process is dead"
                ),
                ["status"],
            ),
        ],
    )
    # One operator attempt, no backoff: its error is in the status, the group waits.
    assert d.c.phase == Phase.IDLE and d.states() == ["unhealthy", "dead"]
    assert "process is dead" in d.c.statuses[0].last_action_error
    run_table(
        d,
        [
            (2.0, apply(Instruction.REINIT, "ft-2"), ["status", "pause@2/reinit->0,1"]),
            (2.1, lambda d: d.done(0), []),
            (2.2, lambda d: d.done(1, info="restarted"), ["recover@2->0,1"]),
            (2.3, lambda d: d.done(0), []),
            (2.4, lambda d: d.done(1), ["status"]),
        ],
    )
    assert d.states() == ["healthy", "healthy"] and d.c.epoch == 2
    assert d.c.statuses[1].last_action_error is None


@pytest.mark.parametrize("phase", ["starting", "idle", "pausing", "recovering", "backoff"])
def test_operator_apply_in_each_state(phase):
    d = Driver()
    if phase == "starting":
        assert d.feed(0.0, apply(Instruction.RETRY)) == []  # kept until the group is up
        assert d.feed(0.1, PeerHello(1)) == ["status", "status", "pause@1/retry->0,1"]
        return
    d.feed(0.0, PeerHello(1))
    if phase == "idle":  # a healthy group: the operator's retry still runs
        assert d.feed(1.0, apply(Instruction.RETRY)) == ["status", "pause@1/retry->0,1"]
        return
    d.feed(0.0, fault(1))
    if phase == "recovering":
        d.feed(0.1, d.done(0))
        d.feed(0.2, d.done(1))
    if phase == "backoff":
        d.feed(0.1, d.done(0))
        d.feed(0.2, d.done(1, ok=False, info="boom"))
        assert d.c.phase == Phase.BACKOFF
        # The operator takes over from the automatic attempts at once.
        assert d.feed(0.3, apply(Instruction.REINIT, "ft-3")) == ["status", "pause@2/reinit->0,1"]
        assert d.c.attempt.source == "manual"
        return
    # Pausing or recovering: the instruction waits for the attempt in progress.
    assert d.feed(0.3, apply(Instruction.RETRY, "ft-4")) == []
    if phase == "pausing":
        d.feed(0.4, d.done(0))
        d.feed(0.5, d.done(1))
    d.feed(0.6, d.done(0))
    assert d.feed(0.7, d.done(1)) == ["status", "status", "pause@2/retry->0,1"]
    assert d.c.statuses[0].last_action_id == "ft-4"


def test_a_sentinel_that_comes_back_gets_the_status_and_its_missing_order():
    d = started()
    d.feed(0.0, fault(0))
    assert d.feed(0.1, PeerHello(1)) == ["status", "pause@1/reinit->1"]


def test_status_messages_are_copies():
    d = started()
    orders = d.c.on_event(fault(1), 1.0)
    sent = next(msg for _, msg in orders if isinstance(msg, GroupStatus))
    assert sent.statuses[1].state == EngineState.UNHEALTHY
    assert d.c.statuses[1].state == EngineState.RECOVERING


def test_a_dense_engine_is_its_own_group():
    """Dense DP: each sentinel coordinates only its engine; another engine's fault is not
    its business, and its own recovery orders only itself."""
    d = Driver(ranks=(1,))
    assert d.feed(0.0, PeerHello(1)) == ["status"]
    assert d.feed(1.0, fault(1)) == ["status", "status", "pause@1/reinit->1"]
    d.feed(1.1, d.done(1, info="restarted"))
    assert d.feed(1.2, d.done(1)) == ["status"]
    assert d.states() == ["healthy"] and d.c.statuses[0].engine_id == 1


def test_a_fault_report_queued_before_a_restart_does_not_fault_the_next_incarnation():
    """The engine may report one fault twice (busy loop and control thread). The second
    report, still queued when the recovery began, belongs to the replaced incarnation (or
    epoch): the engine handle drops it instead of faulting the recovered engine."""
    import time

    from bastion.ipc.control import EngineFault
    from bastion.sentinel.engine_handle import EngineHandle

    handle = EngineHandle.__new__(EngineHandle)
    handle.engine_id, handle.child, handle.is_up, handle.last_reply = 0, None, True, None
    handle.last_reply_time = time.monotonic()
    handle.incarnation, handle.epoch = 2, 5
    dead = "WorkerFailure: bastion::worker-0-0 exited with code -9"
    handle.faults = [EngineFault(1, 4, FailureKind.PROCESS_EXIT, dead),  # the old incarnation
                     EngineFault(2, 4, FailureKind.PROCESS_EXIT, dead)]  # an older epoch
    assert handle.check(10.0) is None and handle.faults == []
    handle.faults = [EngineFault(2, 5, FailureKind.PROCESS_EXIT, dead)]
    assert handle.check(10.0) == (FailureKind.PROCESS_EXIT, dead)


class _FakeSpares:
    """A spare set without processes: warm once ``warm`` is set."""

    started = 0

    def __init__(self, *args) -> None:
        _FakeSpares.started += 1
        self.started_at, self.ready_at = _FakeSpares.started, None
        self.warm, self.alive = False, True
        self.children = []

    def is_alive(self) -> bool:
        return self.alive

    def poll(self) -> bool:
        if self.warm and self.ready_at is None:
            self.ready_at = self.started_at
        return self.ready_at is not None

    def kill(self) -> None:
        self.alive = False


def test_two_warm_spares_start_one_after_the_other_and_the_warm_one_is_promoted(monkeypatch):
    """``--ft-warm-spares 2``: the handle starts a second spare only once the first is warm
    (spares never compete for the host), promotes a warm spare before one still warming (the
    oldest warm one first), drops a dead one, and reports ready while any spare is warm."""
    from types import SimpleNamespace

    from bastion.ipc.control import SpareState
    from bastion.sentinel import engine_handle
    from bastion.sentinel.engine_handle import EngineHandle

    monkeypatch.setattr(engine_handle, "Spares", _FakeSpares)
    monkeypatch.setattr(engine_handle, "encode_config", lambda config: b"{}")
    monkeypatch.setattr(engine_handle, "host_memory_available", lambda: 64 * 2**30)
    handle = EngineHandle.__new__(EngineHandle)
    handle.config = SimpleNamespace(fault_tolerance=FaultToleranceConfig(ft_warm_spares=2),
                                    model=SimpleNamespace(device="cpu"),
                                    parallel=SimpleNamespace(tensor_parallel_size=1))
    handle.engine_id, handle.runtime_dir, handle.ctx = 0, "/tmp", None
    handle.is_up, handle._spare_lost_at = True, -1e9
    handle.spares, handle.num_spares_started = [], 0
    handle._spares_that_fit = engine_handle.MAX_WARM_SPARES

    handle.keep_spare()
    handle.keep_spare()
    assert len(handle.spares) == 1 and handle.spare_state() == SpareState.WARMING
    first = handle.spares[0]
    first.warm = True
    handle.keep_spare()  # the first is warm: the second starts
    assert len(handle.spares) == 2 and handle.spare_state() == SpareState.READY
    second = handle.spares[1]
    handle.keep_spare()
    assert handle.spares == [first, second]  # two kept, no third

    assert handle._take_spare() is first  # the warm one, though the other is as alive
    assert handle.spare_state() == SpareState.WARMING
    second.alive = False
    assert handle._take_spare() is None and handle.spares == []
    with pytest.raises(ConfigError):
        FaultToleranceConfig(ft_warm_spares=engine_handle.MAX_WARM_SPARES + 1)
