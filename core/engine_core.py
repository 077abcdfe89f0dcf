"""The engine core: scheduler + KV manager + executor, one ``step()`` at a time.

Process concerns (sockets, the busy loop, control) live in ``procs/engine.py``; this class is
the same in-process (``LLM``) and behind ZeroMQ.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from bastion.core.config import ConfigError, EngineConfig
from bastion.core.executor import Executor, StepResult
from bastion.core.loader import resolve_model
from bastion.core.lora.peft import load_peft_adapter
from bastion.core.request import Request
from bastion.core.scheduler import Scheduler
from bastion.core.spec_decode.metrics import SpecDecodingLogger
from bastion.core.structured_output.manager import StructuredOutputManager
from bastion.ipc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LoRARequest,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


def compute_num_blocks(config: EngineConfig, bytes_per_block: int, available_bytes: int,
                       max_model_len: int) -> int:
    """Size the block pool; fail with needed/available memory when one request cannot fit."""
    block_size = config.cache.block_size
    if config.cache.num_gpu_blocks_override is not None:
        num_blocks = config.cache.num_gpu_blocks_override
    else:
        num_blocks = max(available_bytes // bytes_per_block, 0)
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks < needed_blocks:
        largest = num_blocks * block_size
        raise ConfigError(
            f"max_model_len {max_model_len} needs {needed_blocks * bytes_per_block / 2**20:.1f} "
            f"MiB of KV cache ({needed_blocks} blocks of {block_size} tokens) but only "
            f"{num_blocks * bytes_per_block / 2**20:.1f} MiB ({num_blocks} blocks) is available; "
            f"the largest max_model_len that fits is {largest}. Lower --max-model-len or give "
            "the KV cache more memory (--gpu-memory-utilization / --kv-cache-memory-bytes).")
    return num_blocks


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, max_model_len: int,
                 engine_id: int = 0, tokenizer: object | None = None) -> None:
        """``tokenizer``: the model's, when the caller has it loaded (structured outputs
        load it on their first grammar otherwise)."""
        self.config = config
        self.engine_id = engine_id
        self.executor = executor
        self.max_model_len = max_model_len
        start = time.perf_counter()
        bytes_per_block = executor.kv_cache_bytes_per_block()
        # A fixed pool size skips the profiling pass (a restarted engine reuses the size its
        # first start measured: its workers cannot profile before they rejoin their groups).
        available = (0 if config.cache.num_gpu_blocks_override is not None
                     else executor.available_kv_cache_bytes())
        num_blocks = compute_num_blocks(config, bytes_per_block, available, max_model_len)
        executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) in %.2f s", num_blocks,
                    config.cache.block_size, num_blocks * bytes_per_block / 2**20,
                    time.perf_counter() - start)
        spec = config.speculative
        num_spec = spec.num_speculative_tokens if spec is not None else 0
        self.structured_output = StructuredOutputManager(*_vocabulary(config, tokenizer))
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, max_model_len,
                                   num_spec,
                                   num_spec if spec is not None and spec.method == "draft_model"
                                   else 0,
                                   config.lora.max_loras if config.lora.enable_lora else 0,
                                   self.structured_output, is_async_spec=config.is_async_spec)
        self.loras: dict[int, LoRARequest] = {}  # loaded adapters by id
        par = config.parallel
        self.is_coupled = par.is_dp_coupled
        off_reason = config.async_scheduling_off_reason()
        self.async_scheduling = config.scheduler.async_scheduling and off_reason is None
        if config.scheduler.async_scheduling and off_reason is not None:
            logger.info("async scheduling is off: %s", off_reason)
        self.spec_logger = (SpecDecodingLogger(spec.num_speculative_tokens) if spec is not None
                            else None)
        # A coupled group's agreement for one round: (this engine's tokens, decode-only) ->
        # (the most tokens of any engine, every engine decode-only). Set by the engine process
        # (its DP group's all-reduce); tests may set their own.
        self.dp_sync: Callable[[int, bool], tuple[int, bool]] | None = None
        # Steps launched and not yet folded into the scheduler, oldest first (at most two).
        self.inflight: deque[_InFlight] = deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_request(request))

    def add_lora(self, request: LoRARequest) -> bool:
        """Check an adapter against the model (ValueError naming what is wrong) and register
        it; workers read it with the first request that uses it. False: already loaded."""
        lora = self.config.lora
        if not lora.enable_lora:
            raise ValueError("LoRA is not enabled; start with --enable-lora")
        if request.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive; got {request.lora_int_id}")
        if request.lora_int_id in self.loras:
            return False
        hf_config = resolve_model(self.config.model).hf_config
        # Experts take no adapter; on an MoE model only the attention modules may be adapted.
        mlp_layers = set() if getattr(hf_config, "num_experts", None) else None
        load_peft_adapter(request.lora_path, hf_config, lora.max_lora_rank, mlp_layers)
        self.loras[request.lora_int_id] = request
        self.scheduler.removing_loras.discard(request.lora_int_id)
        logger.info("LoRA adapter %s (id %d) loaded from %s", request.lora_name,
                    request.lora_int_id, request.lora_path)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; requests already accepted with it finish first."""
        request = self.loras.pop(lora_id, None)
        if request is None:
            return False
        self.scheduler.remove_lora(lora_id)
        logger.info("LoRA adapter %s (id %d) unloaded", request.lora_name, lora_id)
        return True

    def list_loras(self) -> list[int]:
        return sorted(self.loras)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self.inflight)

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update: one batch through the model.

        With async scheduling the step launched here is not waited for: the previous step's
        tokens are folded in instead, so scheduling step N+1 (and the caller's handling of
        step N's outputs) overlaps step N on the device.
        """
        if self.async_scheduling:
            outputs = self._step_async()
        elif self.is_coupled:
            outputs = self._step_coupled()
        elif not self.scheduler.has_unfinished_requests:
            outputs = self.scheduler.take_rejected()
        else:
            sched = self.scheduler.schedule()
            result = self.executor.execute_model_async(sched)
            outputs = self.scheduler.update_from_output(sched, result.output())
        stats = self.scheduler.make_stats()
        if self.spec_logger is not None:
            self.spec_logger.observe(stats)
        return EngineCoreOutputs(self.engine_id, outputs, stats, time.time())

    def idle_round(self) -> bool:
        """A coupled engine's round without requests: agree with the others and, if any has
        tokens, run padding rows through the model (their expert collectives need ours).
        Returns whether a forward ran."""
        num_rows, all_decode = self._dp_agree(0, True)
        if num_rows:
            self.executor.execute_dummy(num_rows, all_decode)
        return num_rows > 0

    def _step_coupled(self) -> list[EngineCoreOutput]:
        """One round of a coupled (expert-parallel) DP group.

        NOTE: every engine of the group calls ``_dp_agree`` exactly once per round, work or
        not (``idle_round``), and then all run a forward of the same padded size or none.
        """
        if not self.scheduler.has_unfinished_requests:
            self.idle_round()
            return self.scheduler.take_rejected()
        sched = self.scheduler.schedule()
        num_tokens = sched.total_num_scheduled_tokens
        num_rows, all_decode = self._dp_agree(num_tokens, _is_decode_only(sched))
        sched.num_padded_tokens, sched.dp_all_decode = num_rows, all_decode
        # Scheduled nothing (pool full) while another engine has tokens: padding rows only.
        sched.is_dummy = num_rows > 0 and not num_tokens
        result = self.executor.execute_model_async(sched)
        return self.scheduler.update_from_output(sched, result.output())

    def _dp_agree(self, num_tokens: int, is_decode_only: bool) -> tuple[int, bool]:
        if self.dp_sync is None:
            raise RuntimeError("a coupled DP engine steps only with its group's agreement "
                               "(dp_sync) installed")
        return self.dp_sync(num_tokens, is_decode_only)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Launch the next step, then fold the oldest one in flight."""
        launched = False
        if self.scheduler.has_unfinished_requests and len(self.inflight) < 2:
            sched = self.scheduler.schedule()
            if sched.num_scheduled_tokens or sched.finished_request_ids:
                self.inflight.append(_InFlight(sched, self.executor.execute_model_async(sched)))
                launched = True
        if not self.inflight:  # nothing could run: deadlines still pass
            return self.scheduler.take_rejected() + self.scheduler.expire_deadlines()
        if launched and len(self.inflight) == 1:
            return self.scheduler.take_rejected()  # keep one step queued behind the device
        step = self.inflight.popleft()
        return self.scheduler.update_from_output(step.sched, step.result.output())

    def drop_all_requests(self) -> None:
        """Forget every request and all KV state, with no outputs (fault recovery: the front
        end holds the requests and resubmits them with the tokens already produced)."""
        self.inflight.clear()
        self.scheduler.drop_all()

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()


def _vocabulary(config: EngineConfig, tokenizer: object | None
                ) -> tuple[Callable[[], object], Callable[[], int]]:
    """How the grammar compiler gets the tokenizer and the logits' width, on first use."""

    def load() -> object:
        from bastion.core.loader import load_tokenizer, resolve_model

        return tokenizer or load_tokenizer(config.model, resolve_model(config.model))

    def vocab_size() -> int:
        from bastion.core.loader import resolve_model

        return resolve_model(config.model).hf_config.vocab_size

    return load, vocab_size


@dataclass
class _InFlight:
    """A launched step (async scheduling)."""

    sched: SchedulerOutput
    result: StepResult


def _is_decode_only(sched: SchedulerOutput) -> bool:
    return sched.total_num_scheduled_tokens == len(sched.num_scheduled_tokens)
