"""Engine-side state of one request."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from bastion.ipc.messages import EngineCoreRequest, FinishReason, Logprobs, SamplingParams

if TYPE_CHECKING:
    from bastion.core.structured_output.manager import RequestGrammar


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
                 deadline: float | None = None, priority: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.deadline = deadline
        self.priority = priority
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
        # Structured outputs: the grammar's compilation while the request waits for it, then
        # its matcher, advanced by every output token.
        self.grammar_future: Future | None = None
        self.grammar: RequestGrammar | None = None
        # Prompt plus max_tokens; the scheduler lowers it to its max_model_len on admission.
        max_tokens = params.max_tokens
        self.max_num_tokens = (len(self.prompt_token_ids) + max_tokens if max_tokens is not None
                               else 1 << 62)

    @classmethod
    def from_engine_request(cls, req: EngineCoreRequest) -> Request:
        request = cls(req.request_id, req.prompt_token_ids, req.sampling_params,
                      req.eos_token_id, req.arrival_time, req.deadline, req.priority)
        for token_id in req.resumed_output_token_ids:
            request.append_output_token(token_id)
        return request

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

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)
