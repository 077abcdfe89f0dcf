"""The fault-tolerance series of /metrics, fed from status reports."""

from __future__ import annotations

from prometheus_client import generate_latest

from bastion.api.metrics import ApiMetrics, fault_kind
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


def test_the_fault_label_is_the_reported_kind_not_the_text():
    # The text says "hang"; the kind reported with it decides.
    assert fault_kind(statuses(EngineState.UNHEALTHY, 0, "injected hang", FailureKind.HANG)
                      ) == "hang"
    assert fault_kind(statuses(EngineState.UNHEALTHY, 0, "hang?", FailureKind.COLLECTIVE)
                      ) == "collective"
    assert fault_kind(statuses(EngineState.UNHEALTHY, 0, "no kind")) == "exception"
    assert {k.label for k in FailureKind} == {"none", "exception", "injected", "process_exit",
                                              "hang", "collective", "unreachable"}
