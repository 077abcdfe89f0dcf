"""Engine-side state of one request."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from bastion.ipc.messages import (
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    LoRARequest,
    PromptLogprobs,
    SamplingParams,
)

if TYPE_CHECKING:
    from bastion.core.structured_output.manager import CompiledGrammar, RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    """One sequence the scheduler owns: its tokens, progress and KV blocks.

    NOTE: ``num_computed_tokens`` counts tokens whose KV is in the cache *or scheduled to be
    written this step*; the scheduler advances it when it schedules, not when the step returns.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_id: int | None = None, arrival_time: float = 0.0,
                 deadline: float | None = None, priority: int = 0,
                 lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.deadline = deadline
        self.priority = priority
        self.lora_request = lora_request
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled by steps still in flight (async scheduling): the
        # scheduler already feeds them as the next step's input before their values are known.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first schedule
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.block_hashes: list[int] = []  # chain hashes of this request's full blocks
        self.num_preemptions = 0
        self.pending_logprobs: list[Logprobs] = []
        self.queued_time = time.monotonic()  # when the engine got it (metrics)
        self.scheduled_time: float | None = None  # when it was first scheduled
        # Speculative decoding: drafts the proposer offered for the next step, and blocks of
        # rejected drafts freed since the workers last heard about this request.
        self.spec_token_ids: list[int] = []
        self.num_freed_blocks = 0
        # prompt_logprobs: position -> (ids, logprobs, rank) of the prompt token after it, until
        # sent with the first token (None afterwards, or when not asked). By position, so a
        # chunk computed again after a preemption, with other boundaries, overwrites its rows.
        self.prompt_logprobs_rows: dict[int, tuple[list[int], list[float], int]] | None = (
            {} if params.prompt_logprobs is not None else None)
        # Structured outputs: the grammar's compilation while the request waits for it, then
        # its matcher, advanced by every output token, and the compiled grammar the workers
        # get (``StructuredOutputManager.ship``).
        self.grammar_future: Future | None = None
        self.grammar: RequestGrammar | None = None
        self.compiled_grammar: CompiledGrammar | None = None
        # Prompt plus max_tokens; the scheduler lowers it to its max_model_len on admission.
        max_tokens = params.max_tokens
        self.max_num_tokens = (len(self.prompt_token_ids) + max_tokens if max_tokens is not None
                               else 1 << 62)

    @classmethod
    def from_engine_request(cls, req: EngineCoreRequest) -> Request:
        request = cls(req.request_id, req.prompt_token_ids, req.sampling_params,
                      req.eos_token_id, req.arrival_time, req.deadline, req.priority,
                      req.lora_request)
        for token_id in req.resumed_output_token_ids:
            request.append_output_token(token_id)
        return request

    @property
    def lora_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def add_prompt_logprobs(self, part: PromptLogprobs) -> None:
        rows = self.prompt_logprobs_rows
        if rows is None:
            return  # already sent (a recompute after preemption), or never asked
        lp = part.logprobs
        for j, row in enumerate(zip(lp.token_ids, lp.logprobs, lp.ranks)):
            rows[part.start + j] = row

    def take_prompt_logprobs(self) -> Logprobs | None:
        """The whole prompt's logprobs once every row has arrived (then never again)."""
        rows = self.prompt_logprobs_rows
        if rows is None or len(rows) < self.num_prompt_tokens - 1:
            return None
        self.prompt_logprobs_rows = None
        ordered = [rows[i] for i in range(self.num_prompt_tokens - 1)]
        return Logprobs([r[0] for r in ordered], [r[1] for r in ordered], [r[2] for r in ordered])

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)
