"""The fault-tolerance series of /metrics, fed from status reports."""

from __future__ import annotations

from prometheus_client import generate_latest

from bastion.api.metrics import ApiMetrics
from bastion.ipc.messages import EngineState, EngineStatus, FailureKind


class _NoClient:
    max_model_len = 2048

    def scheduler_stats(self) -> list:
        return []


def statuses(state: EngineState, epoch: int, info: str | None = None,
             kind: FailureKind = FailureKind.NONE) -> list[EngineStatus]:
    return [EngineStatus(0, state, epoch, info, "auto-reinit", fault_kind=kind),
            EngineStatus(1, state, epoch, None, "auto-reinit")]


def test_a_fault_and_its_recovery_are_counted_once_with_the_duration():
    metrics = ApiMetrics(_NoClient(), "m")
    metrics.observe_statuses(statuses(EngineState.HEALTHY, 0))
    metrics.observe_statuses(statuses(EngineState.UNHEALTHY, 0, "engine 0 process exited",
                                        FailureKind.PROCESS_EXIT))
    metrics.observe_statuses(statuses(EngineState.RECOVERING, 1))
    metrics.observe_statuses(statuses(EngineState.HEALTHY, 1))
    metrics.observe_statuses(statuses(EngineState.HEALTHY, 1))
    text = generate_latest(metrics.registry).decode()
    assert 'bastion:engine_faults_total{kind="process_exit",model_name="m"} 1.0' in text
    assert 'bastion:engine_recoveries_total{action="auto-reinit",model_name="m"} 1.0' in text
    assert 'bastion:engine_recovery_seconds_count{model_name="m"} 1.0' in text
    assert 'bastion:engine_state{engine="1",model_name="m"} 1.0' in text


def test_each_engine_counts_its_own_fault_once_by_its_reported_kind():
    # A killed engine 0's peer reports its broken collective first; engine 0's exit arrives
    # later in the same fault. Both are counted, each once, by kind (the text does not decide).
    metrics = ApiMetrics(_NoClient(), "m")
    healthy = [EngineStatus(0, EngineState.HEALTHY, 0), EngineStatus(1, EngineState.HEALTHY, 0)]
    peer_first = [EngineStatus(0, EngineState.RECOVERING, 1, "paused"),
                  EngineStatus(1, EngineState.RECOVERING, 1, "a hang?",
                               fault_kind=FailureKind.COLLECTIVE)]
    cause_later = [EngineStatus(0, EngineState.RECOVERING, 1, "engine 0 process exited",
                                fault_kind=FailureKind.PROCESS_EXIT), peer_first[1]]
    for report in (healthy, peer_first, peer_first, cause_later, cause_later):
        metrics.observe_statuses(report)
    metrics.observe_statuses([EngineStatus(0, EngineState.HEALTHY, 1),
                              EngineStatus(1, EngineState.HEALTHY, 1)])
    # the next fault of engine 1, of the same kind, counts again
    metrics.observe_statuses([EngineStatus(0, EngineState.UNHEALTHY, 1),
                              EngineStatus(1, EngineState.UNHEALTHY, 1, "x",
                                           fault_kind=FailureKind.COLLECTIVE)])
    text = generate_latest(metrics.registry).decode()
    faults = sorted(line for line in text.splitlines()
                    if line.startswith("bastion:engine_faults_total"))
    assert faults == ['bastion:engine_faults_total{kind="collective",model_name="m"} 2.0',
                      'bastion:engine_faults_total{kind="process_exit",model_name="m"} 1.0']
    assert {k.label for k in FailureKind} == {"none", "exception", "injected", "process_exit",
                                              "hang", "collective", "unreachable"}
