"""What the HTTP layer needs from the engines; ``procs/engine_client.py`` implements it over
ZeroMQ. The API layer never touches sockets or processes itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from bastion.core.output_processor import SeqDelta
from bastion.ipc.messages import EngineStatus, LoRARequest, SamplingParams, SchedulerStats


class RequestStream(Protocol):
    """Deltas of one client request; all ``n`` choices interleaved, each ends with a delta whose
    ``finish_reason`` is set. Iteration ends after every choice finished."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int

    def __aiter__(self) -> AsyncIterator[SeqDelta]: ...

    async def abort(self) -> None:
        """Stop generating (client went away); the engine frees the request's KV blocks."""


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: object  # a transformers tokenizer (encode, decode, apply_chat_template)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 deadline: float | None = None,
                 lora_request: LoRARequest | None = None) -> RequestStream: ...

    async def call_utility(self, method: str, *args: object) -> list[object]:
        """Run an engine utility (``add_lora``, ``remove_lora``) on every engine; their
        results in engine order. A failure raises ``ValueError`` with the engine's message."""

    def is_ready(self) -> bool:
        """True when every engine needed to serve is healthy."""

    def engine_statuses(self) -> list[EngineStatus]: ...

    def scheduler_stats(self) -> list[SchedulerStats]:
        """The latest stats each engine reported."""
