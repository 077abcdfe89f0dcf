"""Executors run a step's ``SchedulerOutput`` on the model runner(s).

``UniProcExecutor`` holds the runner in the engine's own process (offline ``LLM`` and tests);
the multi-process executor in ``procs/`` speaks the same interface to worker processes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from bastion.core.config import EngineConfig
from bastion.core.model_runner import ModelRunner
from bastion.ipc.messages import ModelRunnerOutput, SchedulerOutput


class StepResult(Protocol):
    """A launched step; ``output()`` waits for its sampled tokens."""

    def output(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    def kv_cache_bytes_per_block(self) -> int: ...

    def available_kv_cache_bytes(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model_async(self, sched: SchedulerOutput) -> StepResult: ...

    def reset(self) -> None: ...

    def shutdown(self) -> None: ...


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        # Offline, the caller's process owns its thread pool (torch's default follows
        # OMP_NUM_THREADS and the affinity); only an explicit cpu_threads changes it.
        if config.model.device == "cpu" and config.parallel.cpu_threads is not None:
            torch.set_num_threads(config.parallel.cpu_threads)
        self.runner = ModelRunner(config)
        self.runner.load_model()

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def available_kv_cache_bytes(self) -> int:
        return self.runner.available_kv_cache_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model_async(self, sched: SchedulerOutput) -> StepResult:
        return self.runner.execute_model_async(sched)

    def reset(self) -> None:
        self.runner.reset()

    def shutdown(self) -> None:
        pass
