"""The worker's model runner: keeps per-request state, builds the flat batch, runs the model
and samples. It applies each step's ``SchedulerOutput`` delta to its own copy of the state."""

from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from bastion.core.config import EngineConfig
from bastion.core.cuda_graphs import CUDAGraphRunner, DecodeInputs, default_capture_sizes
from bastion.core.forward_context import AttentionMetadata, set_forward_context
from bastion.core.loader import get_max_model_len, load_model, resolve_model
from bastion.core.lora.manager import LoRAManager
from bastion.core.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_logprobs,
    greedy_tokens,
)
from bastion.core.spec_decode.draft_model import DraftModelProposer
from bastion.core.spec_decode.ngram_proposer import NgramProposer
from bastion.core.spec_decode.rejection_sampler import VerifyRequest, verify
from bastion.core.staging import StagingRing
from bastion.core.structured_output.manager import RequestGrammar
from bastion.core.structured_output.bitmask import DeviceMask
from bastion.core.structured_output.worker import WorkerGrammars
from bastion.ipc.messages import (
    Logprobs,
    LoRARequest,
    ModelRunnerOutput,
    PromptLogprobs,
    SamplingParams,
    SchedulerOutput,
)
from bastion.ops.communicator import get_tp_group
from bastion.ops.cpu import describe_cpu_path

logger = logging.getLogger(__name__)

# Prompt logprobs go through the LM head this many positions at a time, so a long prefill chunk
# never holds its whole [tokens, vocab] logits at once (2048 x 152k float32 would be 1.2 GiB).
_PROMPT_LOGPROBS_ROWS = 256


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
    # The block ids again as a growing int32 array (first ``num_blocks`` valid), so a decode
    # step builds its block table with one numpy copy per row instead of a list conversion.
    block_table: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.int32))
    num_blocks: int = 0
    # Greedy with nothing that changes the logits (no penalties, min_tokens or logprobs): the
    # token is the plain argmax, so an all-such batch skips building sampling metadata.
    is_plain_greedy: bool = False
    # The temperature the fused kernel draws this row's token at as it is (0.0: plain
    # greedy), so a captured sampling graph can; None: the sampler changes its logits first,
    # or it has a generator of its own (a seed).
    plain_temperature: float | None = None
    # Its sampling reads the tokens generated so far (penalties, min_tokens), so a step cannot
    # be prepared while its previous token is still on the device.
    needs_output_ids: bool = False
    # Tokens sampled by the latest step that is still in flight (0 or 1); its value is row
    # ``pending_row`` of that step's sampled-token tensor on the device.
    num_pending: int = 0
    pending_row: int = 0
    # Draft model: the distribution each of its current drafts was drawn from (None: greedy).
    draft_probs: torch.Tensor | None = None
    lora_request: LoRARequest | None = None
    # Speculative decoding: the proposer's drafts after the latest sampled token (async
    # scheduling runs them in the slots the scheduler reserved), and the length limit
    # (prompt + max_tokens, at most max_model_len) no draft may pass.
    draft_token_ids: list[int] = field(default_factory=list)
    max_num_tokens: int = 1 << 62
    # Structured outputs (TP rank 0): the request's matcher, one output token behind while a
    # token is in flight; None without a grammar, or once its grammar refused a token.
    grammar: RequestGrammar | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, counting the token still in flight."""
        return len(self.token_ids) + self.num_pending

    def drop_blocks(self, num_blocks: int) -> None:
        """Forget the last ``num_blocks`` blocks (the scheduler gave them back)."""
        self.num_blocks -= num_blocks
        del self.block_ids[self.num_blocks:]

    def append_blocks(self, new_block_ids: list[int]) -> None:
        self.block_ids.extend(new_block_ids)
        end = self.num_blocks + len(new_block_ids)
        if end > len(self.block_table):
            grown = np.zeros(max(end, 2 * len(self.block_table)), dtype=np.int32)
            grown[:self.num_blocks] = self.block_table[:self.num_blocks]
            self.block_table = grown
        self.block_table[self.num_blocks:end] = new_block_ids
        self.num_blocks = end


def _context_length(state: CachedRequestState) -> int:
    return state.num_computed_tokens


def _needs_output_ids(params: SamplingParams) -> bool:
    return (params.min_tokens > 0 or params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0)


def _is_plain_greedy(params: SamplingParams) -> bool:
    return (params.is_greedy and params.logprobs is None and not _needs_output_ids(params)
            and not params.logit_bias)


def _plain_temperature(params: SamplingParams) -> float | None:
    """``CachedRequestState.plain_temperature`` of a request sampled with ``params``."""
    if _is_plain_greedy(params):
        return 0.0
    if (params.is_greedy or params.logprobs is not None or _needs_output_ids(params)
            or params.logit_bias or params.seed is not None or params.top_k > 0
            or params.top_p < 1.0 or params.min_p > 0.0):
        return None
    return float(params.temperature)


class StepHandle:
    """One launched step's sampled tokens, on their way to the host.

    The tokens (and logprobs) are copied into pinned host memory without blocking and an event
    is recorded after the copies; ``output()`` waits on that event only. So the caller can
    prepare and launch the next step before this one's tokens exist (async scheduling).
    ``output()`` may be called from another thread (a worker's sender); it touches no runner
    state.
    """

    def __init__(self, step_id: int, states: list[CachedRequestState] | None = None,
                 out: SamplerOutput | None = None,
                 prompt_logprobs: list[PromptLogprobs] | None = None) -> None:
        self.step_id = step_id
        self.prompt_logprobs = prompt_logprobs or []
        self._event = None
        self._output: ModelRunnerOutput | None = None
        self._host = None
        self._lock = threading.Lock()
        if out is None:  # nothing sampled (yet: ``attach``)
            self.states, self.sampled = states or [], None
            self._output = ModelRunnerOutput(step_id=step_id, prompt_logprobs=self.prompt_logprobs)
            return
        self.attach(states, out)

    def attach(self, states: list[CachedRequestState], out: SamplerOutput) -> None:
        self.states = states
        self.sampled = out.sampled_token_ids  # stays on the device
        self._output = None
        tensors = [out.sampled_token_ids]
        if out.logprobs is not None:
            tensors.extend(out.logprobs)
        if out.sampled_token_ids.is_cuda:
            self._host = [t.to("cpu", non_blocking=True) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> StepHandle:
        """A step whose output is already on the host (speculative steps)."""
        handle = cls(output.step_id)
        handle._output = output
        return handle

    def set_output(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def token_ids(self) -> list[int]:
        return self.output().sampled_token_ids

    def output(self) -> ModelRunnerOutput:
        with self._lock:
            if self._output is None:
                if self._event is not None:
                    self._event.synchronize()
                self._output = self._build_output()
                self._host = None
            return self._output

    def _build_output(self) -> ModelRunnerOutput:
        token_ids = self._host[0].tolist()
        logprobs: list[Logprobs | None] = [None] * len(self.states)
        if len(self._host) > 1:
            ids, lps, ranks = (t.tolist() for t in self._host[1:])
            for i, state in enumerate(self.states):
                k = state.params.logprobs
                if k is not None:
                    logprobs[i] = Logprobs([ids[i][:k + 1]], [lps[i][:k + 1]], [ranks[i]])
        return ModelRunnerOutput([s.request_id for s in self.states], token_ids, logprobs,
                                 self.step_id, prompt_logprobs=self.prompt_logprobs)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or torch.device(config.model.device)
        self.dtype = config.model.torch_dtype
        self.block_size = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        # Built (and captured) with the KV cache on a GPU unless the model config asks for
        # eager mode; decode-only batches that fit a bucket replay a graph.
        self.graph_runner: CUDAGraphRunner | None = None
        # Speculative decoding's verify steps (k + 1 tokens per sequence) have graphs of their own.
        self.verify_graph_runner: CUDAGraphRunner | None = None
        # With --enable-lora, the decode buckets once more without the adapter kernels (same
        # pool), replayed for steps where no row has an adapter: base traffic pays nothing.
        self.base_graph_runner: CUDAGraphRunner | None = None
        self.graph_capture_s = 0.0  # the last capture's duration (a recovery's phase timings)
        self.use_cuda_graphs = self.device.type == "cuda" and not config.model.enforce_eager
        # Steps whose tokens this runner has not folded into its request state yet, oldest
        # first; all but the newest are folded in at the start of each step.
        self.inflight: deque[StepHandle] = deque()
        # The newest sampled tokens, on the device: the decode graphs read a row's input token
        # from here while it is still in flight (built with the first graph runner).
        self._prev_tokens: torch.Tensor | None = None
        # Pinned buffers the eager (prefill and mixed) steps are staged in; built on first use.
        self._staging: StagingRing[_StepStaging] | None = None
        self._staging_capacity = (0, 0, 0)
        spec = config.speculative
        # NOTE: a speculative step runs to its verified tokens and next drafts before it
        # returns (verification reads the logits on the host). Under async scheduling
        # (``is_async_spec``) the engine schedules the next step before it has seen them: this
        # runner tracks each request's progress itself and fills the draft slots the scheduler
        # reserved with its own drafts.
        self.is_async_spec = config.is_async_spec
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max)
                         if spec is not None and spec.method == "ngram" else None)
        self.drafter: DraftModelProposer | None = None  # built in load_model
        self.lora_manager: LoRAManager | None = None  # built in load_model with --enable-lora
        self.grammars = WorkerGrammars()  # on TP rank 0 only (``load_model``)

    # ------------------------------------------------------------------------- set-up

    def load_model(self) -> None:
        start = time.perf_counter()
        self.resolved = resolve_model(self.config.model)
        self.model = load_model(self.config.model, self.resolved,
                                self.config.parallel.tensor_parallel_size)
        self.vocab_size = self.resolved.hf_config.vocab_size
        self.max_model_len = get_max_model_len(self.resolved.hf_config,
                                               self.config.model.max_model_len)
        self.grammars.enabled = get_tp_group().rank == 0  # the others take rank 0's tokens
        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModelProposer(self.config, self.vocab_size)
        if self.config.lora.enable_lora:
            sched = self.config.scheduler
            self.lora_manager = LoRAManager(
                self.model, self.resolved.hf_config, self.config.lora,
                sched.max_num_batched_tokens + sched.max_num_seqs, self.dtype, self.device)
        logger.info("model loaded in %.2f s", time.perf_counter() - start)
        if self.device.type == "cpu":
            # Which attention / rotary / argmax path runs, and the kernels built before a
            # request arrives (a first build takes about a second).
            logger.info("CPU kernels: %s", describe_cpu_path(self.dtype))

    def add_lora(self, request: LoRARequest) -> bool:
        """Read and check an adapter into the host cache (ValueError naming what is wrong)."""
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled; start with --enable-lora")
        return self.lora_manager.add(request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove(lora_id)

    def _set_lora_rows(self, states: list[CachedRequestState], counts: list[int],
                       num_rows: int) -> None:
        """Each token row's adapter slot for this step (rows past the requests' are padding)."""
        if self.lora_manager is None:
            return
        slots = self.lora_manager.activate([s.lora_request for s in states])
        rows = np.full(num_rows, -1, dtype=np.int32)
        per_token = np.repeat(np.asarray(slots, dtype=np.int32), counts)
        rows[:len(per_token)] = per_token
        self.lora_manager.set_token_slots(rows)

    def kv_cache_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        elem = torch.empty((), dtype=self.dtype).element_size()
        draft = self.drafter.kv_cache_bytes_per_block() if self.drafter is not None else 0
        return draft + sum(2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem
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
        # The whole token budget as one decode token and one prefill (a mixed step, so the
        # attention kernels of mixed steps are built before the first request) into a scratch
        # cache just big enough for it.
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_blocks = -(-num_tokens // self.block_size) + 1
        self._allocate_kv_cache(num_blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        meta, positions = _dummy_mixed_step(num_tokens, num_blocks, self.block_size,
                                            self.device)
        # NOTE: positions index the rotary table, which ends at max_model_len; a token budget
        # above it must wrap, or the rotary kernel reads past the table.
        positions %= self.max_model_len
        with set_forward_context(meta):
            hidden = self.model(ids, positions)
        num_seqs = min(self.config.scheduler.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:num_seqs])
        # The sampler's own peak: float32 logits, penalties, top-k/top-p sort and logprobs.
        worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=20,
                               repetition_penalty=1.1, frequency_penalty=0.1)
        self.sampler(logits, SamplingMetadata.build(
            [worst] * num_seqs, [[0]] * num_seqs, [[0]] * num_seqs, [None] * num_seqs,
            [None] * num_seqs, self.device, logits.shape[-1]))
        greedy_tokens(logits)  # builds the fused sampling kernel before the first request
        # ... and its variant that reads grammar bitmasks (every row allowed everything).
        words = -(-logits.shape[-1] // 32)
        greedy_tokens(logits, DeviceMask(
            torch.full((1, words), -1, dtype=torch.int32, device=self.device),
            torch.zeros(num_seqs, dtype=torch.int32, device=self.device)))
        torch.cuda.synchronize(self.device)
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then (on a GPU) capture the decode CUDA graphs over it."""
        self._allocate_kv_cache(num_blocks)
        if self.use_cuda_graphs:
            start = time.perf_counter()
            runner = self.build_graph_runner()
            try:
                runner.capture()
            except Exception as exc:  # noqa: BLE001 - any capture failure: run eager instead
                # NOTE: a model whose forward cannot be captured (a host sync somewhere) must
                # still serve; every rank of a group fails alike, so they stay in step.
                torch.cuda.synchronize(self.device)
                logger.warning("CUDA graph capture failed (%s: %s); decode runs eager",
                               type(exc).__name__, exc)
                return
            finally:
                self.graph_capture_s = time.perf_counter() - start
            self.graph_runner = runner
            self._capture_sampling(runner)
            if self.lora_manager is not None:
                base = self.build_graph_runner(with_lora=False)
                try:
                    base.capture(pool=runner.pool)
                    self.base_graph_runner = base
                    self._capture_sampling(base)
                except Exception as exc:  # noqa: BLE001 - base-only steps replay the LoRA graphs
                    torch.cuda.synchronize(self.device)
                    logger.warning("CUDA graph capture without LoRA failed (%s: %s); base-only "
                                   "steps replay the LoRA graphs", type(exc).__name__, exc)
            spec = self.config.speculative
            if spec is not None:
                verify = self.build_graph_runner(spec.num_speculative_tokens + 1)
                try:
                    verify.capture(pool=runner.pool)
                except Exception as exc:  # noqa: BLE001 - as above: verify steps run eager
                    torch.cuda.synchronize(self.device)
                    logger.warning("CUDA graph capture of verify steps failed (%s: %s); they "
                                   "run eager", type(exc).__name__, exc)
                    return
                self.verify_graph_runner = verify

    def _capture_sampling(self, runner: CUDAGraphRunner) -> None:
        """Plain sampling graphs behind ``runner``'s (under a grammar bitmask too, on the
        rank that keeps the grammars); without them steps sample eagerly, as before."""
        try:
            runner.capture_sampling(with_mask=self.grammars.enabled)
        except Exception as exc:  # noqa: BLE001 - eager sampling stays correct
            torch.cuda.synchronize(self.device)
            logger.warning("CUDA graph capture of plain sampling failed (%s: %s); steps "
                           "sample eagerly", type(exc).__name__, exc)

    def build_graph_runner(self, query_len: int = 1, with_lora: bool = True) -> CUDAGraphRunner:
        """Graphs for decode steps of ``query_len`` tokens per sequence (> 1: verify steps,
        captured up to ``_MAX_VERIFY_GRAPH_TOKENS`` tokens, as vLLM bounds its capture sizes).
        A verify step's padding tokens sit past its real ones, up to ``query_len - 1``
        positions past max_model_len: the block table has room for them. With LoRA enabled,
        ``with_lora`` says whether the graphs are captured with the adapter kernels in (a
        replay serves any mix of slots) or without (only steps with no adapter row); capture
        right after building, since the flag set here decides it."""
        if self.lora_manager is not None:
            self.lora_manager.state.is_active = with_lora
        sizes = default_capture_sizes(self.config.scheduler.max_num_seqs)
        if query_len > 1:
            sizes = [s for s in sizes if s * query_len <= _MAX_VERIFY_GRAPH_TOKENS] or [1]
        max_blocks_per_seq = -(-(self.max_model_len + query_len - 1) // self.block_size)
        if self._prev_tokens is None:
            self._prev_tokens = torch.zeros(self.config.scheduler.max_num_seqs,
                                            dtype=torch.int64, device=self.device)
        # A plain decode graph ends with the LM head (one launch fewer a step); a verify
        # step's logits rows are gathered from its hidden states first.
        return CUDAGraphRunner(self.model, sizes, max_blocks_per_seq, self.block_size,
                               self.device, query_len,
                               head=self.model.compute_logits if query_len == 1 else None,
                               prev_tokens=self._prev_tokens)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        # NOTE: captured graphs hold these addresses; reallocating means capturing again.
        for layer in self.model.attention_layers():
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = _zeroed(shape, self.dtype, self.device)
            layer.v_cache = _zeroed(shape, self.dtype, self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks, self.device)
        self.num_blocks = num_blocks

    def reset(self) -> None:
        """Forget all per-request state (fault recovery)."""
        self.requests.clear()
        self.inflight.clear()

    def _fold_tokens(self, keep: int) -> None:
        """Append the sampled tokens of all in-flight steps but the newest ``keep`` to their
        requests' host state (waiting for them if needed)."""
        while len(self.inflight) > keep:
            handle = self.inflight.popleft()
            for state, token_id in zip(handle.states, handle.token_ids()):
                state.output_token_ids.append(token_id)
                state.token_ids.append(token_id)
                state.num_pending -= 1

    # ------------------------------------------------------------------------- one step

    def _apply_delta(self, sched: SchedulerOutput) -> None:
        if sched.grammars or sched.grammar_vocabulary is not None or sched.dropped_grammar_ids:
            self.grammars.learn(sched)
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
        for lora_id in sched.removed_lora_ids:
            self.remove_lora(lora_id)
        for new in sched.new_requests:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(new.sampling_params.seed)
            state = CachedRequestState(
                new.request_id, new.prompt_token_ids, new.sampling_params, [],
                new.num_computed_tokens, list(new.output_token_ids),
                new.prompt_token_ids + new.output_token_ids, generator, new.eos_token_id,
                is_plain_greedy=_is_plain_greedy(new.sampling_params),
                plain_temperature=_plain_temperature(new.sampling_params),
                needs_output_ids=_needs_output_ids(new.sampling_params),
                lora_request=new.lora_request, grammar=self.grammars.matcher_for(new))
            max_tokens = new.sampling_params.max_tokens
            if max_tokens is not None:
                state.max_num_tokens = len(new.prompt_token_ids) + max_tokens
            state.max_num_tokens = min(state.max_num_tokens, self.max_model_len)
            state.append_blocks(new.block_ids)
            self.requests[new.request_id] = state
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            if cached.num_freed_blocks:
                state.drop_blocks(cached.num_freed_blocks)
            if cached.new_block_ids:
                state.append_blocks(cached.new_block_ids)
            # NOTE: under async speculation the scheduler's count assumes every draft of the
            # step before was accepted; this runner's own count (``_execute_spec``) is exact.
            if not self.is_async_spec:
                state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        """Launch one step; its tokens stay on the device until the handle is asked.

        A request whose previous token is still in flight (the step before this one) reads it
        from that step's sampled tensor on the device, so this step queues behind it on the
        stream without the host ever waiting for it. A step with grammar rows waits for those
        tokens (they are on the host by the time its forward is launched) to fill the bitmask
        it samples under, while the device runs the forward.
        """
        if self.proposer is not None or self.drafter is not None:
            return self._execute_spec(sched)
        self._fold_tokens(keep=1)
        self._apply_delta(sched)
        num_rows = self._padded_rows(sched)
        handle = StepHandle(sched.step_id)
        if not sched.num_scheduled_tokens:
            if sched.is_dummy:
                self._dummy_run(num_rows, self._can_replay(sched, num_rows))
            return handle
        grammar_ids = sched.structured_output_request_ids if self.grammars.enabled else []
        decode = self._prepare_decode(sched) if self._can_replay(sched, num_rows) else None
        graphs = None  # the decode graphs this step replayed, whose sampling it may replay too
        if decode is not None:
            states, inputs = decode
            self._set_lora_rows(states, [1] * len(states),
                                self.graph_runner.bucket(max(len(states), num_rows)))
            graphs = self._decode_graph_runner()
            logits = graphs.run(inputs, num_rows, logits=True)
        else:
            prev = self.inflight[-1].sampled if self.inflight else None
            batch = self._prepare_inputs(sched, prev, num_rows)
            self._set_lora_rows([self.requests[rid] for rid in sched.num_scheduled_tokens],
                                list(sched.num_scheduled_tokens.values()),
                                batch.input_ids.shape[0])
            with set_forward_context(batch.meta):
                hidden = self.model(batch.input_ids, batch.positions)
            handle.prompt_logprobs = self._prompt_logprobs(sched, hidden, batch.meta)
            if not batch.sample_ids:
                handle.set_output(ModelRunnerOutput(step_id=sched.step_id,
                                                    prompt_logprobs=handle.prompt_logprobs))
                return handle
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            states = [self.requests[rid] for rid in batch.sample_ids]
        mask = None
        if grammar_ids:
            self._fold_tokens(keep=0)  # the grammar rows' matchers need the tokens in flight
            if graphs is not None and (graphs.mask_target is None
                                       or graphs.mask_words != self.grammars.num_words):
                graphs = None  # no masked sampling graph reads bitmask rows of this width
            mask = self._mask_grammar_rows(logits, states, grammar_ids, {}, staged=True,
                                           graphs=graphs)
        # The rows' next tokens are this step's from now on: the next step, prepared before
        # they reach the host, reads them on the device.
        for row, state in enumerate(states):
            state.num_pending += 1
            state.pending_row = row
        self.inflight.append(handle)
        return self._sample_step(handle, logits, states, mask, graphs)

    def _mask_grammar_rows(self, logits: torch.Tensor, states: list[CachedRequestState],
                           grammar_ids: list[str], spec: dict[str, list[int]],
                           staged: bool = False, graphs: CUDAGraphRunner | None = None
                           ) -> DeviceMask | None:
        """Advance each grammar row's matcher by the tokens its request has had since, and
        mask its logits row with what may come next (a row with ``d`` drafts has ``d + 1``
        logits rows; grammar rows have none). ``staged`` (a plain step on a GPU): leave the
        masking to the sampling kernel and return the bitmask, on its way to the device
        (into the ``mask_target`` of ``graphs``, the decode graphs it replayed, when given)."""
        wanted, rows, row = set(grammar_ids), [], 0
        one_behind: list[tuple[int, CachedRequestState]] = []  # caught up in one call
        for state in states:
            grammar = state.grammar
            if state.request_id in wanted and grammar is not None:
                if len(state.output_token_ids) == grammar.num_accepted + 1:
                    one_behind.append((row, state))
                elif grammar.catch_up(state.output_token_ids):
                    rows.append((row, grammar))
                else:  # the engine ends the request; its rows sample unmasked meanwhile
                    state.grammar = None
            row += len(spec.get(state.request_id, ())) + 1
        taken = RequestGrammar.accept_each([s.grammar for _, s in one_behind],
                                           [s.output_token_ids[-1] for _, s in one_behind])
        for (row, state), ok in zip(one_behind, taken):
            if ok:
                rows.append((row, state.grammar))
            else:
                state.grammar = None
        rows.sort(key=lambda r: r[0])
        if staged and logits.is_cuda:
            if graphs is None:
                return self.grammars.stage(rows, logits.shape[0], logits.device)
            # The target's row map has an entry for each of the graphs' rows.
            mask = self.grammars.stage(rows, graphs.max_num_seqs, logits.device,
                                       graphs.mask_target)
            return None if mask is None else DeviceMask(mask.bitmask,
                                                        mask.mask_rows[:logits.shape[0]])
        self.grammars.mask(logits, rows)
        return None

    def _sample_step(self, handle: StepHandle, logits: torch.Tensor,
                     states: list[CachedRequestState], mask: DeviceMask | None = None,
                     graphs: CUDAGraphRunner | None = None) -> StepHandle:
        """Sample a launched step (the newest in flight; its rows count its token pending)
        under its grammar rows' bitmask, if any: by ``graphs``' captured sampling (which
        writes ``_prev_tokens`` itself) when it replayed this step, every row is plain (greedy
        or drawn at its temperature alone) and any bitmask is staged in its ``mask_target``."""
        if any(s.needs_output_ids and s.num_pending > 1 for s in states):
            self._fold_tokens(keep=1)  # penalties and min_tokens read every token so far
        tokens = None
        if graphs is not None:
            temperatures = [s.plain_temperature for s in states]
            if None not in temperatures:
                tokens = graphs.sample_plain(len(states), mask is not None,
                                             temperatures if any(temperatures) else None)
        if tokens is not None:
            out = _sync_sampled_tokens(SamplerOutput(tokens, None))
            if get_tp_group().world_size > 1:  # rank 0's tokens replaced this rank's
                self._prev_tokens[:len(states)].copy_(tokens)
        else:
            out = _sync_sampled_tokens(self._sample(logits, states, mask))
            if self._prev_tokens is not None:  # where the next decode graph reads them
                self._prev_tokens[:len(states)].copy_(out.sampled_token_ids)
        handle.attach(states, out)
        return handle

    def _execute_spec(self, sched: SchedulerOutput) -> StepHandle:
        """A speculative step: one forward over each request's last token and its drafts,
        verification, then the next drafts from the proposer. Returns with the output built.

        A step without drafts that fits a graph bucket still replays the decode graph; steps
        with drafts run eager.
        """
        self._apply_delta(sched)
        if not sched.num_scheduled_tokens:
            return StepHandle(sched.step_id)
        if self.is_async_spec:
            sched = self._fill_draft_slots(sched)
        spec = sched.scheduled_spec_decode_tokens
        # The draft model shadows every target forward over the flat batch, which a plain
        # decode graph does not expose; a verify graph's padded batch it shadows eagerly.
        decode = (self._prepare_decode(sched) if not spec and self.drafter is None
                  and self._can_replay(sched, 0) else None)
        verify_batch = (self._prepare_verify(sched, spec) if decode is None
                        and self.verify_graph_runner is not None else None)
        prompt_logprobs: list[PromptLogprobs] = []
        if decode is not None:
            states, inputs = decode
            logits = self.graph_runner.run(inputs, logits=True)
        elif verify_batch is not None:
            states, inputs, rows = verify_batch
            runner = self.verify_graph_runner
            hidden = runner.run(inputs)
            if self.drafter is not None:
                size = runner.bucket(len(states))
                self.drafter.shadow(*runner.staged_inputs(size),
                                    runner.eager_metadata(inputs, size))
            logits = self.model.compute_logits(
                hidden[torch.from_numpy(rows).to(self.device, non_blocking=True)])
        else:
            batch = self._prepare_inputs(sched, None, 0, spec)
            with set_forward_context(batch.meta):
                hidden = self.model(batch.input_ids, batch.positions)
            if self.drafter is not None:
                self.drafter.shadow(batch.input_ids, batch.positions, batch.meta)
            prompt_logprobs = self._prompt_logprobs(sched, hidden, batch.meta)
            if not batch.sample_ids:
                self._advance(sched)
                return StepHandle(sched.step_id, prompt_logprobs=prompt_logprobs)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            states = [self.requests[rid] for rid in batch.sample_ids]
        self._advance(sched)
        if sched.structured_output_request_ids and self.grammars.enabled:
            self._mask_grammar_rows(logits, states, sched.structured_output_request_ids, spec)
        return StepHandle.ready(self._verify_step(sched.step_id, logits, states, spec,
                                                  prompt_logprobs))

    def _verify_step(self, step_id: int, logits: torch.Tensor, states: list[CachedRequestState],
                     spec: dict[str, list[int]],
                     prompt_logprobs: list[PromptLogprobs]) -> ModelRunnerOutput:
        requests = []
        for s in states:
            drafts = spec.get(s.request_id, [])
            q = s.draft_probs[:len(drafts)] if drafts and s.draft_probs is not None else None
            requests.append(VerifyRequest(s.params, s.prompt_token_ids, s.output_token_ids,
                                          s.generator, s.eos_token_id, drafts, q))
        result = verify(logits, requests)
        for state, token_ids in zip(states, result.token_ids):
            state.output_token_ids.extend(token_ids)
            state.token_ids.extend(token_ids)
            # The fed last token and the accepted drafts have KV; the rejected ones' does not.
            state.num_computed_tokens = len(state.token_ids) - 1
        if self.drafter is not None:
            proposed = self.drafter.propose(states, self.max_model_len)
            drafts = proposed.token_ids
            for state, q in zip(states, proposed.probs):
                state.draft_probs = q
        else:
            drafts = [self.proposer.propose(s.token_ids) for s in states]
        for state, draft_ids in zip(states, drafts):
            state.draft_token_ids = draft_ids
        output = ModelRunnerOutput([s.request_id for s in states], [], result.logprobs, step_id,
                                   result.token_ids, drafts, prompt_logprobs)
        if self.is_async_spec:  # the drafts stay here; the scheduler needs only their number
            output.draft_token_ids = []
            output.num_draft_tokens = [len(spec.get(s.request_id, ())) for s in states]
        return output

    def _fill_draft_slots(self, sched: SchedulerOutput) -> SchedulerOutput:
        """Async speculation: the step with each row's draft slots (placeholders) filled with
        as many of this runner's drafts as they hold and the request's length limit allows;
        a row with fewer drafts than slots feeds fewer tokens (its spare slots stay unwritten).

        NOTE: a copy: in-process, the scheduler folds the step in by the slots it reserved.
        """
        slots = sched.scheduled_spec_decode_tokens
        if not slots:
            return sched
        counts = dict(sched.num_scheduled_tokens)
        drafts: dict[str, list[int]] = {}
        for request_id, placeholders in slots.items():
            state = self.requests[request_id]
            if state.num_computed_tokens != len(state.token_ids) - 1:
                raise RuntimeError(f"request {request_id} got draft slots in step "
                                   f"{sched.step_id} but is not a decode row here "
                                   f"({state.num_computed_tokens} of {len(state.token_ids)} "
                                   "tokens computed)")
            room = state.max_num_tokens - len(state.token_ids) - 1
            mine = state.draft_token_ids[:max(min(len(placeholders), room), 0)]
            counts[request_id] -= len(placeholders) - len(mine)
            if mine:
                drafts[request_id] = mine
        return msgspec.structs.replace(sched, num_scheduled_tokens=counts,
                                       total_num_scheduled_tokens=sum(counts.values()),
                                       scheduled_spec_decode_tokens=drafts)

    def _advance(self, sched: SchedulerOutput) -> None:
        """Every row's progress past the tokens it fed this step (verification takes the
        rejected drafts back off)."""
        for request_id, num_tokens in sched.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens

    def _prepare_verify(self, sched: SchedulerOutput, spec: dict[str, list[int]]
                        ) -> tuple[list[CachedRequestState], DecodeInputs, np.ndarray] | None:
        """A speculative step where every sequence feeds its last token and its drafts, as the
        verify graphs take it: ``q = k + 1`` tokens per sequence, a sequence with ``d < k``
        drafts padded with ``k - d`` tokens that are stored nowhere (slot -1) and sit at its
        last real position. Returns the states, the inputs and the flat row of each logits row
        verification reads (a sequence's first ``d + 1``); None for any other batch (prefill
        chunks, more sequences or blocks than the graphs hold)."""
        runner = self.verify_graph_runner
        q = runner.query_len
        states = [self.requests[rid] for rid in sched.num_scheduled_tokens]
        b = len(states)
        if not b or runner.bucket(b) is None:
            return None
        num_drafts = np.fromiter((len(spec.get(s.request_id, ())) for s in states), np.int64, b)
        counts = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, b)
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, b)
        lengths = np.fromiter((s.num_tokens for s in states), np.int64, b)
        if (not np.array_equal(counts, num_drafts + 1) or not np.array_equal(starts + 1, lengths)
                or num_drafts.max() >= q):
            return None
        bs = self.block_size
        num_blocks = (starts + num_drafts) // bs + 1
        if int(num_blocks.max()) > runner.max_blocks_per_seq:
            return None
        offsets = np.arange(q, dtype=np.int64)
        is_real = offsets[None, :] <= num_drafts[:, None]  # [b, q]
        positions = starts[:, None] + np.minimum(offsets[None, :], num_drafts[:, None])
        ids = np.zeros((b, q), dtype=np.int64)
        for i, state in enumerate(states):
            ids[i, 0] = state.token_ids[-1]
            drafts = spec.get(state.request_id)
            if drafts:
                ids[i, 1:1 + len(drafts)] = drafts
        table = _block_table(states, num_blocks)
        seq_rows = np.repeat(np.arange(b), q)
        flat_positions = positions.reshape(-1)
        slots = np.where(is_real.reshape(-1),
                         _slot_mapping(table, seq_rows, flat_positions, bs), -1)
        # The attention kernel places a sequence's q tokens at its last q positions: the
        # context length counts the padding (whose keys causality hides from the real rows).
        inputs = DecodeInputs(ids.reshape(-1), flat_positions, slots, table,
                              seq_lens=starts + q)
        rows = np.flatnonzero(is_real.reshape(-1))
        return states, inputs, rows

    def _padded_rows(self, sched: SchedulerOutput) -> int:
        """Rows this step must run so that every engine of a coupled DP group runs the same
        number (0: no padding). A group that is decode-only everywhere pads to the graph
        bucket of the largest batch, which every engine computes alike."""
        rows = sched.num_padded_tokens
        if rows and sched.dp_all_decode and self.graph_runner is not None:
            return self.graph_runner.bucket(rows) or rows
        return rows

    def _can_replay(self, sched: SchedulerOutput, num_rows: int) -> bool:
        if self.graph_runner is None:
            return False
        if not sched.num_padded_tokens:
            return True
        return sched.dp_all_decode and self.graph_runner.bucket(num_rows) == num_rows

    def _decode_graph_runner(self) -> CUDAGraphRunner:
        """The decode graphs for this step, its adapter slots already set: the ones without
        the LoRA kernels when no row has an adapter (the host knows every row's slot)."""
        if self.base_graph_runner is not None and not self.lora_manager.state.is_active:
            return self.base_graph_runner
        return self.graph_runner

    def _dummy_run(self, num_rows: int = 1, replay: bool = False) -> None:
        """Padding rows through the model, stored nowhere (slot -1): an idle DP rank's share of
        the MoE layers' expert-parallel collectives while other ranks have work. One row is a
        1-token sequence, the rest belong to none."""
        num_rows = max(num_rows, 1)
        if self.lora_manager is not None:
            self.lora_manager.set_token_slots(np.full(
                self.graph_runner.bucket(num_rows) if replay else num_rows, -1, dtype=np.int32))
        if replay:
            empty = np.zeros(0, dtype=np.int64)
            self._decode_graph_runner().run(DecodeInputs(empty, empty, empty,
                                               np.zeros((0, 1), dtype=np.int32)),
                                  min_size=num_rows)
            return
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_rows,), -1, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            seq_lens=torch.ones(1, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=dev),
            max_query_len=1, max_seq_len=1, query_start_loc_cpu=[0, 1], seq_lens_cpu=[1])
        with set_forward_context(meta):
            self.model(torch.zeros(num_rows, dtype=torch.long, device=dev),
                       torch.zeros(num_rows, dtype=torch.long, device=dev))

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor,
                         meta: AttentionMetadata) -> list[PromptLogprobs]:
        """For each request that asked, the logprobs of the prompt tokens its chunk predicts:
        the logits at position p (up to the prompt's second-to-last) score prompt token p + 1.

        NOTE: synchronous (the rows go to the host here); only such requests pay for it.
        """
        parts = []
        qsl = meta.query_start_loc_cpu
        for i, request_id in enumerate(sched.num_scheduled_tokens):
            state = self.requests[request_id]
            k = state.params.prompt_logprobs
            start = state.num_computed_tokens
            stop = min(start + qsl[i + 1] - qsl[i], len(state.prompt_token_ids) - 1)
            if k is None or stop <= start:
                continue
            targets = torch.tensor(state.prompt_token_ids[start + 1:stop + 1],
                                   dtype=torch.int64, device=hidden.device)
            rows = hidden[qsl[i]:qsl[i] + stop - start]
            ids: list[list[int]] = []
            values: list[list[float]] = []
            ranks: list[int] = []
            for j in range(0, len(rows), _PROMPT_LOGPROBS_ROWS):
                logits = self.model.compute_logits(rows[j:j + _PROMPT_LOGPROBS_ROWS])
                lp = compute_logprobs(logits.float().log_softmax(dim=-1),
                                      targets[j:j + _PROMPT_LOGPROBS_ROWS], k)
                ids += lp.token_ids.tolist()
                values += lp.logprobs.tolist()
                ranks += lp.ranks.tolist()
            parts.append(PromptLogprobs(request_id, start, Logprobs(ids, values, ranks)))
        return parts

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState],
                mask: DeviceMask | None = None) -> SamplerOutput:
        if all(s.is_plain_greedy for s in states):
            # The sampler would apply no processor to these rows and take the argmax.
            return SamplerOutput(greedy_tokens(logits, mask), None)
        meta = SamplingMetadata.build(
            [s.params for s in states], [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states], [s.generator for s in states],
            [s.eos_token_id for s in states], self.device, logits.shape[-1])
        return self.sampler(logits, meta, mask)

    def _prepare_decode(self, sched: SchedulerOutput
                        ) -> tuple[list[CachedRequestState], DecodeInputs] | None:
        """Host arrays for a batch where every sequence feeds its last token and samples the
        next; None for anything else (prefill chunks, or a batch no graph bucket holds)."""
        num_seqs = len(sched.num_scheduled_tokens)
        if sched.total_num_scheduled_tokens != num_seqs:
            return None
        states = [self.requests[rid] for rid in sched.num_scheduled_tokens]
        # Attention starts its programs roughly in row order: the longest contexts first leave
        # short ones for the last wave. Rows map back to requests only through ``states``; the
        # sort is stable, so every TP rank orders the same batch the same way.
        states.sort(key=_context_length, reverse=True)
        positions = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_seqs)
        lengths = np.fromiter((s.num_tokens for s in states), np.int64, num_seqs)
        if not np.array_equal(positions + 1, lengths):  # a 1-token chunk of a longer prompt
            return None
        # A token still in flight is read on the device from the previous step (row >= 0).
        input_ids = np.fromiter((0 if s.num_pending else s.token_ids[-1] for s in states),
                                np.int64, num_seqs)
        pending_rows = np.fromiter((s.pending_row if s.num_pending else -1 for s in states),
                                   np.int64, num_seqs)
        bs = self.block_size
        num_blocks = positions // bs + 1
        if not self.graph_runner.can_run(num_seqs, int(num_blocks.max())):
            return None
        tables = _block_table(states, num_blocks)
        slots = _slot_mapping(tables, np.arange(num_seqs), positions, bs)
        return states, DecodeInputs(input_ids, positions, slots, tables, pending_rows)

    def _prepare_inputs(self, sched: SchedulerOutput, prev: torch.Tensor | None,
                        num_rows: int = 0, spec: dict[str, list[int]] | None = None) -> _Batch:
        """The flat batch of any step (prefill chunks and decodes mixed), built with numpy:
        only the token ids are gathered per request; positions, slots and the block table
        come from array operations, and everything goes over in two copies. Tokens past the
        last sequence's (up to ``num_rows``) are padding: id 0, position 0, slot -1.

        ``spec``: per request, draft tokens fed after its last token; every one of its fed
        positions then gets a logits row (in order), for verification."""
        request_ids = list(sched.num_scheduled_tokens)
        states = [self.requests[rid] for rid in request_ids]
        b = len(states)
        counts = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, b)
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, b)
        ends = starts + counts
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        input_ids: list[int] = []
        pending_at: list[int] = []  # flat positions whose token is still in flight
        pending_rows: list[int] = []  # ... and its row in the previous step's tokens
        for state, start, end in zip(states, starts.tolist(), ends.tolist()):
            if spec and state.request_id in spec:
                input_ids.extend((state.token_ids + spec[state.request_id])[start:end])
                continue
            input_ids.extend(state.token_ids[start:end])
            if end > len(state.token_ids):  # the last token is still in flight
                pending_at.append(len(input_ids))
                pending_rows.append(state.pending_row)
                input_ids.append(0)
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - qsl[:-1], counts)
        bs = self.block_size
        table = _block_table(states, (ends + bs - 1) // bs)
        width = table.shape[1]
        slots = _slot_mapping(table, np.repeat(np.arange(b), counts), positions, bs)
        # Prefill done (or a decode): this step yields the request's next token.
        done = ends == np.fromiter((s.num_tokens for s in states), np.int64, b)
        logits_indices = qsl[1:][done] - 1
        if spec:
            num_drafts = np.fromiter((len(spec.get(rid, ())) for rid in request_ids), np.int64, b)
            done = ends == np.fromiter((s.num_tokens for s in states), np.int64, b) + num_drafts
            logits_indices = np.concatenate([np.arange(end - n - 1, end) for end, n in zip(
                qsl[1:][done].tolist(), num_drafts[done].tolist())] or [logits_indices])
        sample_ids = [rid for rid, d in zip(request_ids, done.tolist()) if d]

        num_pad = max(num_rows - total, 0)
        if num_pad:
            input_ids.extend([0] * num_pad)
            positions = np.concatenate([positions, np.zeros(num_pad, dtype=np.int64)])
            slots = np.concatenate([slots, np.full(num_pad, -1, dtype=np.int64)])
        host = self._staging_for(total + num_pad, max(b, len(logits_indices)), width)
        ids, pos, slot, logit_rows, at, rows = _pack(host.i64.numpy(), (
            np.fromiter(input_ids, np.int64, total + num_pad), positions, slots,
            logits_indices, pending_at, pending_rows), align=2)
        qsl_span, lens_span, table_span = _pack(host.i32.numpy(), (qsl, ends, table.reshape(-1)),
                                                align=4)
        dev64 = self._copy_staged(host.i64[:rows.stop])
        dev32 = self._copy_staged(host.i32[:table_span.stop])
        self._staging.copied()
        meta = AttentionMetadata(
            slot_mapping=dev64[slot],
            query_start_loc=dev32[qsl_span],
            seq_lens=dev32[lens_span],
            block_tables=dev32[table_span].view(b, width),
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=ends.tolist(),
        )
        input_ids_dev = dev64[ids]
        if pending_at:
            input_ids_dev[dev64[at]] = prev[dev64[rows]]
        return _Batch(input_ids_dev, dev64[pos], meta, dev64[logit_rows],
                      sample_ids)

    def _staging_for(self, num_tokens: int, num_seqs: int, width: int) -> _StepStaging:
        """Pinned buffers for a step of this size (sized for the scheduler's limits once;
        grown if a step ever exceeds them)."""
        sched = self.config.scheduler
        need = (num_tokens, num_seqs, width)
        if self._staging is None or any(n > c for n, c in zip(need, self._staging_capacity)):
            cap = tuple(max(n, c) for n, c in zip(need, (
                sched.max_num_batched_tokens, sched.max_num_seqs,
                -(-self.max_model_len // self.block_size))))
            pin = self.device.type == "cuda"

            def make() -> _StepStaging:
                return _StepStaging(*cap, pin=pin)

            if self._staging is None:
                self._staging = StagingRing(make, self.device)
            else:
                self._staging.rebuild(make)
            self._staging_capacity = cap
        return self._staging.acquire()

    def _copy_staged(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return host.clone()  # the buffer is reused two steps later
        return host.to(self.device, non_blocking=True)


# Verify steps are captured for batches of at most this many tokens (vLLM's default bound on
# its capture sizes); larger ones run eager.
_MAX_VERIFY_GRAPH_TOKENS = 512


def _block_table(states: list[CachedRequestState], num_blocks: np.ndarray) -> np.ndarray:
    """[len(states), max(num_blocks)] int32: each request's first ``num_blocks`` block ids (the
    blocks its context occupies; the scheduler may have allocated more), zero-padded. One
    concatenate and one masked scatter instead of a row copy per request.

    Every context must lie in blocks the scheduler gave it: a spare entry is a zero, and
    reading one would write this request's keys into block 0.
    """
    allocated = np.fromiter((s.num_blocks for s in states), np.int64, len(states))
    short = np.flatnonzero(num_blocks > allocated)
    if short.size:
        i = int(short[0])
        raise RuntimeError(f"request {states[i].request_id} needs {int(num_blocks[i])} KV blocks "
                           f"for this step but holds {int(allocated[i])}")
    width = int(num_blocks.max())
    flat = np.concatenate([s.block_table[:n] for s, n in zip(states, num_blocks.tolist())])
    table = np.zeros((len(states), width), dtype=np.int32)
    table[np.arange(width) < num_blocks[:, None]] = flat
    return table


def _slot_mapping(table: np.ndarray, rows: np.ndarray, positions: np.ndarray,
                  block_size: int) -> np.ndarray:
    """int64 cache slot of each token at ``positions`` of the request in ``table`` row ``rows``."""
    return (table[rows, positions // block_size].astype(np.int64) * block_size
            + positions % block_size)


def _pack(buffer: np.ndarray, parts: tuple, align: int) -> list[slice]:
    """Write ``parts`` one after another into ``buffer``, each starting at a multiple of
    ``align`` elements (16 bytes: Triton compiles a kernel variant per pointer alignment, and
    a compile costs a step about a second); return the slice each part occupies."""
    spans, at = [], 0
    for part in parts:
        end = at + len(part)
        buffer[at:end] = part
        spans.append(slice(at, end))
        at = -(-end // align) * align
    return spans


class _StepStaging:
    """Host buffers for one step: int64 token rows (ids, positions, slots) then the rows to
    sample and the in-flight tokens to patch; int32 query starts, lengths and block table."""

    def __init__(self, num_tokens: int, num_seqs: int, max_blocks_per_seq: int,
                 pin: bool) -> None:
        # Room for each part's padding to a 16-byte start (see ``_pack``).
        self.i64 = torch.zeros(3 * num_tokens + 3 * num_seqs + 12, dtype=torch.int64,
                               pin_memory=pin)
        self.i32 = torch.zeros(num_seqs * (2 + max_blocks_per_seq) + 1 + 12, dtype=torch.int32,
                               pin_memory=pin)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On the CPU an anonymous mapping, which the kernel hands out
    zeroed, page by page as the cache is first written: ``torch.zeros`` writes every page at
    once (a 1 GiB cache took 0.4-0.9 s of each restart of the embedded model's engine)."""
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    # NOTE: the tensor holds the mapping (the buffer's owner) for as long as it lives.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


def _sync_sampled_tokens(out: SamplerOutput) -> SamplerOutput:
    """Every TP rank takes TP rank 0's tokens: unseeded random draws differ per process, and
    the next step's inputs must be the same on all ranks."""
    tp = get_tp_group()
    if tp.world_size > 1:
        tp.broadcast(out.sampled_token_ids, src=0)
    return out


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_ids: list[str]


def _dummy_mixed_step(num_tokens: int, num_blocks: int, block_size: int,
                      device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions of ``num_tokens`` as a decode token at position 0 in block 0,
    then (if any are left) one prompt of the rest from block 1 on."""
    prompt = num_tokens - 1
    positions = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(prompt)])
    slots = torch.cat([torch.zeros(1, dtype=torch.long), block_size + positions[1:]])
    tables = torch.zeros(2, num_blocks - 1, dtype=torch.int32)
    tables[1] = torch.arange(1, num_blocks, dtype=torch.int32)
    qsl, lens = ([0, 1, num_tokens], [1, prompt]) if prompt else ([0, 1], [1])
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables[:len(lens)].to(device), max_query_len=max(prompt, 1),
        max_seq_len=max(prompt, 1), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    return meta, positions.to(device)
