"""The worker's model runner: keeps per-request state, builds the flat batch, runs the model
and samples. It applies each step's ``SchedulerOutput`` delta to its own copy of the state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from bastion.core.config import EngineConfig
from bastion.core.forward_context import AttentionMetadata, set_forward_context
from bastion.core.loader import load_model, resolve_model
from bastion.core.sampler import Sampler, SamplerOutput, SamplingMetadata
from bastion.ipc.messages import Logprobs, ModelRunnerOutput, SamplingParams, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs
    generator: torch.Generator | None = None
    eos_token_id: int | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or torch.device(config.model.device)
        self.dtype = config.model.torch_dtype
        self.block_size = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None

    # ------------------------------------------------------------------------- set-up

    def load_model(self) -> None:
        start = time.perf_counter()
        self.resolved = resolve_model(self.config.model)
        self.model = load_model(self.config.model, self.resolved)
        self.vocab_size = self.resolved.hf_config.vocab_size
        logger.info("model loaded in %.2f s", time.perf_counter() - start)

    def kv_cache_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem
                   for layer in layers)

    def available_kv_cache_bytes(self) -> int:
        """Bytes the KV cache may take: the configured budget, or on a GPU what is left of
        ``gpu_memory_utilization`` after a profiling forward pass at full batch."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return 1 << 30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * cache.gpu_memory_utilization - peak - max(non_torch, 0))

    @torch.inference_mode()
    def profile_run(self) -> None:
        # One prefill of the whole token budget into a scratch cache just big enough for it.
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_blocks = -(-num_tokens // self.block_size)
        self.initialize_kv_cache(num_blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = _dummy_prefill_metadata(num_tokens, num_blocks, self.block_size, self.device)
        with set_forward_context(meta):
            hidden = self.model(ids, positions)
        num_seqs = min(self.config.scheduler.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:num_seqs])
        torch.cuda.synchronize(self.device)
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for layer in self.model.attention_layers():
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks

    def reset(self) -> None:
        """Forget all per-request state (fault recovery)."""
        self.requests.clear()

    # ------------------------------------------------------------------------- one step

    def _apply_delta(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in sched.new_requests:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(new.sampling_params.seed)
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, new.prompt_token_ids, new.sampling_params, list(new.block_ids),
                new.num_computed_tokens, list(new.output_token_ids),
                new.prompt_token_ids + new.output_token_ids, generator, new.eos_token_id)
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_delta(sched)
        if not sched.num_scheduled_tokens:
            return ModelRunnerOutput(step_id=sched.step_id)
        batch = self._prepare_inputs(sched)
        with set_forward_context(batch.meta):
            hidden = self.model(batch.input_ids, batch.positions)
        if not batch.sample_ids:
            return ModelRunnerOutput(step_id=sched.step_id)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        states = [self.requests[rid] for rid in batch.sample_ids]
        meta = SamplingMetadata.build(
            [s.params for s in states], [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states], [s.generator for s in states],
            [s.eos_token_id for s in states], self.device, logits.shape[-1])
        out = self.sampler(logits, meta)
        return self._finish_step(sched.step_id, states, out)

    def _finish_step(self, step_id: int, states: list[CachedRequestState],
                     out: SamplerOutput) -> ModelRunnerOutput:
        token_ids = out.sampled_token_ids.tolist()
        logprobs: list[Logprobs | None] = [None] * len(states)
        if out.logprobs is not None:
            ids, lps, ranks = (t.tolist() for t in out.logprobs)
            for i, state in enumerate(states):
                k = state.params.logprobs
                if k is not None:
                    logprobs[i] = Logprobs([ids[i][:k + 1]], [lps[i][:k + 1]], [ranks[i]])
        for state, token_id in zip(states, token_ids):
            state.output_token_ids.append(token_id)
            state.token_ids.append(token_id)
        return ModelRunnerOutput([s.request_id for s in states], token_ids, logprobs, step_id)

    def _prepare_inputs(self, sched: SchedulerOutput) -> _Batch:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sample_ids: list[str] = []
        bs = self.block_size
        for request_id, n in sched.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + n
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = state.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if end == len(state.token_ids):  # prefill done: this step yields a token
                logits_indices.append(query_start_loc[-1] - 1)
                sample_ids.append(request_id)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=dev),
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return _Batch(torch.tensor(input_ids, dtype=torch.long, device=dev),
                      torch.tensor(positions, dtype=torch.long, device=dev),
                      meta, torch.tensor(logits_indices, dtype=torch.long, device=dev),
                      sample_ids)


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_ids: list[str]


def _dummy_prefill_metadata(num_tokens: int, num_blocks: int, block_size: int,
                            device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens, max_seq_len=num_tokens,
        query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens])
