"""Front-end side of a request: turns engine outputs into text, applies stop strings.

Shared by the offline ``LLM`` and the API process. A request with ``n > 1`` is fanned out into
``n`` engine requests ``{id}-{i}``; their prompt blocks are shared through the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from bastion.core.detokenizer import IncrementalDetokenizer
from bastion.core.outputs import CompletionOutput, TokenLogprob
from bastion.ipc.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    Logprobs,
    LoRARequest,
    SamplingParams,
)


@dataclass
class SeqState:
    """One engine request (one of the ``n`` choices of a client request)."""

    parent_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    output: CompletionOutput
    num_cached_tokens: int = 0


@dataclass
class SeqDelta:
    """What one engine output changed for one choice: new text/tokens, maybe its end."""

    parent_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, TokenLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None = None
    queue_time_s: float = 0.0  # on the first token's delta only (see EngineCoreOutput)
    prefill_time_s: float = 0.0
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None  # with the first token


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}-{index}"


def fan_out(parent_id: str, prompt_token_ids: list[int], params: SamplingParams,
            eos_token_id: int | None, arrival_time: float, deadline: float | None = None,
            priority: int = 0, lora_request: LoRARequest | None = None
            ) -> list[EngineCoreRequest]:
    """One engine request per choice; seeded requests get ``seed + i`` so choices differ."""
    requests = []
    for i in range(params.n):
        child = params
        if params.n > 1:
            seed = None if params.seed is None else params.seed + i
            child = msgspec.structs.replace(params, n=1, seed=seed)
        requests.append(EngineCoreRequest(child_id(parent_id, i), prompt_token_ids, child,
                                          arrival_time, deadline, priority, eos_token_id,
                                          lora_request=lora_request))
    return requests


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.seqs: dict[str, SeqState] = {}

    def add(self, request: EngineCoreRequest, parent_id: str, index: int) -> CompletionOutput:
        """Track one engine request; the returned output object fills in as results arrive."""
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                           params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
        output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.seqs[request.request_id] = SeqState(parent_id, index, params, detok, output)
        return output

    def output_token_ids(self, request_id: str) -> list[int]:
        """Tokens produced so far for a tracked request (what a resubmission resumes after)."""
        seq = self.seqs.get(request_id)
        return seq.output.token_ids if seq is not None else []

    def remove(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def process(self, out: EngineCoreOutput) -> tuple[SeqDelta | None, bool]:
        """Apply one engine output. Returns the delta and whether the engine must be told to
        abort the request (a stop string matched, which only the front end can see)."""
        seq = self.seqs.get(out.request_id)
        if seq is None:
            return None, False
        seq.num_cached_tokens = out.num_cached_tokens
        output = seq.output
        finish_reason = out.finish_reason.openai_name if out.finish_reason is not None else None
        stop_reason = out.stop_reason
        must_abort = False
        text = ""
        new_token_ids = out.new_token_ids
        if seq.detokenizer is not None:
            if len(new_token_ids) > 1 and seq.params.stop:
                text, stop_string, num_used = self._detokenize_until_stop(seq, new_token_ids)
                if num_used < len(new_token_ids):
                    # A stop string ended inside a speculative step's run of tokens: the
                    # request ends at that token, as it would have decoding one at a time.
                    new_token_ids = new_token_ids[:num_used]
                    finish_reason, stop_reason = None, None
            else:
                delta = seq.detokenizer.update(new_token_ids)
                text, stop_string = delta.text, delta.stop_string
            if stop_string is not None and finish_reason is None:
                finish_reason, stop_reason, must_abort = "stop", stop_string, True
            if finish_reason is not None and stop_string is None:
                text += seq.detokenizer.flush()
            output.text = seq.detokenizer.output_text
        output.token_ids.extend(new_token_ids)
        logprobs = (self._entries(out.logprobs) if seq.params.logprobs is not None else None)
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            prompt_logprobs = [None, *self._entries(out.prompt_logprobs)]
            output.prompt_logprobs = prompt_logprobs
        if logprobs is not None and len(logprobs) > len(new_token_ids):
            logprobs = logprobs[:len(new_token_ids)]
        if logprobs is not None:
            output.logprobs.extend(logprobs)
        if finish_reason is not None:
            output.finish_reason, output.stop_reason, output.error = (finish_reason, stop_reason,
                                                                      out.error)
            self.seqs.pop(out.request_id, None)
        return SeqDelta(seq.parent_id, seq.index, text, list(new_token_ids), logprobs,
                        finish_reason, stop_reason, out.error, out.queue_time_s,
                        out.prefill_time_s, prompt_logprobs), must_abort

    @staticmethod
    def _detokenize_until_stop(seq: SeqState, token_ids: list[int]
                               ) -> tuple[str, str | None, int]:
        """Feed several tokens one at a time; stop at the one that completes a stop string.
        Returns the text, the stop string (or None) and how many tokens were used."""
        parts = []
        for num_used, token_id in enumerate(token_ids, 1):
            delta = seq.detokenizer.update([token_id])
            parts.append(delta.text)
            if delta.stop_string is not None:
                return "".join(parts), delta.stop_string, num_used
        return "".join(parts), None, len(token_ids)

    def _entries(self, lp: Logprobs | None) -> list[dict[int, TokenLogprob]]:
        """Per row: the row's own token first (its rank), then the top-N (rank = position)."""
        if lp is None:
            return []
        result = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            entry: dict[int, TokenLogprob] = {}
            for j, (token_id, value) in enumerate(zip(ids, values)):
                if token_id in entry:
                    continue
                decoded = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                           else None)
                entry[token_id] = TokenLogprob(token_id, value, rank if j == 0 else j, decoded)
            result.append(entry)
        return result
