"""The fault-tolerance series of /metrics, fed from status reports."""

from __future__ import annotations

from prometheus_client import generate_latest

from bastion.api.metrics import ApiMetrics, fault_kind
from bastion.ipc.messages import EngineState, EngineStatus


class _NoClient:
    max_model_len = 2048

    def scheduler_stats(self) -> list:
        return []


def statuses(state: EngineState, epoch: int, info: str | None = None) -> list[EngineStatus]:
    return [EngineStatus(0, state, epoch, info, "auto-reinit"),
            EngineStatus(1, state, epoch, None, "auto-reinit")]


def test_a_fault_and_its_recovery_are_counted_once_with_the_duration():
    metrics = ApiMetrics(_NoClient(), "m")
    metrics.observe_statuses(statuses(EngineState.HEALTHY, 0))
    metrics.observe_statuses(statuses(EngineState.UNHEALTHY, 0, "engine 0 process exited"))
    metrics.observe_statuses(statuses(EngineState.RECOVERING, 1))
    metrics.observe_statuses(statuses(EngineState.HEALTHY, 1))
    metrics.observe_statuses(statuses(EngineState.HEALTHY, 1))
    text = generate_latest(metrics.registry).decode()
    assert 'bastion:engine_faults_total{kind="process_exit",model_name="m"} 1.0' in text
    assert 'bastion:engine_recoveries_total{action="auto-reinit",model_name="m"} 1.0' in text
    assert 'bastion:engine_recovery_seconds_count{model_name="m"} 1.0' in text
    assert 'bastion:engine_state{engine="1",model_name="m"} 1.0' in text


def test_fault_kinds_are_a_small_fixed_set():
    assert fault_kind("RuntimeError: injected fault in the busy loop") == "injected"
    assert fault_kind("engine 1 made no progress for 10.1 s (hang: ...)") == "hang"
    assert fault_kind("engine 0 process exited with code -9") == "process_exit"
    assert fault_kind("DistributedTimeout: all_reduce on group engines-e1") == "collective"
    assert fault_kind("ValueError: boom") == "exception"
