"""What a caller of the offline API (and the HTTP layer) gets back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    decoded: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error | timeout
    stop_reason: int | str | None = None
    # Per generated token: {token id: TokenLogprob} with the sampled token and the top-N.
    logprobs: list[dict[int, TokenLogprob]] | None = None
    error: str | None = None
    # With prompt_logprobs: per prompt token, {token id: TokenLogprob} with that token and the
    # top-k; None for the first token (nothing precedes it).
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def prompt_logprobs(self) -> list[dict[int, TokenLogprob] | None] | None:
        """vLLM's ``RequestOutput.prompt_logprobs`` (every choice scores the same prompt)."""
        return self.outputs[0].prompt_logprobs if self.outputs else None
