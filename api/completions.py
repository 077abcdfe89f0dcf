"""``POST /v1/completions``: OpenAI's legacy ``text_completion`` API (vLLM's extensions too)."""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from bastion.api.config import CLIENT_KEY, CONFIG_KEY, METRICS_KEY, MODEL_NAMES_KEY
from bastion.api.engine_protocol import EngineClient
from bastion.api.errors import bad_request
from bastion.api.lora import LORA_KEY
from bastion.api.fields import check_unsupported
from bastion.api.protocol import (
    GenerateRequest,
    Prompt,
    base_sampling_params,
    check_model,
    fit_to_context,
    get,
    parse_deadline,
    parse_prompt_logprobs,
    parse_stream_options,
    read_body,
    read_request,
)
from bastion.api.schemas import CompletionRequest
from bastion.api.serving import (
    Choice,
    Run,
    apply_generation_defaults,
    chunk_header,
    collect,
    off_loop,
    reject_if_draining,
    respond,
    stream_sse,
    submit,
    token_text,
    top_entries,
    vllm_prompt_logprobs,
    with_usage_field,
)
from bastion.core.output_processor import SeqDelta
from bastion.core.outputs import TokenLogprob

DEFAULT_COMPLETION_MAX_TOKENS = 16
_PROMPT_FORMS = ("prompt must be a non-empty string, a list of strings, a list of token ids or "
                 "a list of lists of token ids")


def parse_prompts(value: str | list, client: EngineClient, max_num_prompts: int,
                  add_special_tokens: bool = True) -> list[Prompt]:
    """The request's prompts (their types and non-emptiness checked when decoding); one
    request holds one form only, and token ids must be in the vocabulary."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif all(isinstance(v, int) for v in value):
        items = [value]
    elif all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        items = value
    else:
        raise bad_request(_PROMPT_FORMS, "prompt")
    if len(items) > max_num_prompts:
        raise bad_request(f"at most {max_num_prompts} prompts per request, got {len(items)}",
                          "prompt")
    vocab_size = len(client.tokenizer)
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(client.tokenizer.encode(
                item, add_special_tokens=add_special_tokens), item))
            continue
        if not item or not all(t < vocab_size for t in item):
            raise bad_request(f"a token-id prompt must be a non-empty list of integers in "
                              f"[0, {vocab_size})", "prompt")
        prompts.append(Prompt(list(item), None))
    return prompts


def parse_completion_request(request: web.Request, raw: bytes) -> GenerateRequest:
    config, client = request.app[CONFIG_KEY], request.app[CLIENT_KEY]
    body = read_request(raw, CompletionRequest)
    model = check_model(body, request.app[MODEL_NAMES_KEY], request.app[LORA_KEY].adapters)
    body = apply_generation_defaults(body, config.generation_defaults)
    check_unsupported(body, chat=False)
    prompts = parse_prompts(body["prompt"], client, config.max_num_prompts,
                            get(body, "add_special_tokens", True))
    echo = get(body, "echo", False)
    logprobs = get(body, "logprobs")
    max_tokens = get(body, "max_tokens")
    # OpenAI's legacy API (and vLLM) stop at 16 tokens when max_tokens is absent; an explicit
    # null fills the context, as chat does by default.
    default = None if "max_tokens" in body else DEFAULT_COMPLETION_MAX_TOKENS
    stream = get(body, "stream", False)
    include_usage = parse_stream_options(body, stream)
    deadline = parse_deadline(request, body)
    prompt_logprobs = parse_prompt_logprobs(body, config, stream)
    # OpenAI's echo with logprobs scores the echoed prompt too: the engine computes the larger
    # top-k of the two asks, each part of the answer keeps its own.
    engine_k = prompt_logprobs
    if echo and logprobs is not None:
        engine_k = max(logprobs, prompt_logprobs or 0)
    base = base_sampling_params(body, config, logprobs, max_tokens, len(client.tokenizer),
                                engine_k)
    params = [fit_to_context(base, len(p.token_ids), client.max_model_len, max_tokens, "prompt",
                             default) for p in prompts]
    return GenerateRequest(model, prompts, params, stream, include_usage, deadline, echo,
                           prompt_logprobs=prompt_logprobs,
                           lora_request=request.app[LORA_KEY].get(model))


def completion_logprobs(entries: list[dict[int, TokenLogprob] | None], text_offset: int,
                        k: int, first_text: str = "") -> tuple[dict[str, Any], int]:
    """OpenAI's legacy shape; ``top_logprobs`` holds the top-``k`` plus the sampled token.
    A ``None`` entry is the first prompt token of an echo (text ``first_text``, scored null)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        if entry is None:
            text, logprob, top = first_text, None, None
        else:
            ranked = top_entries(entry, k)
            text, logprob = token_text(ranked[0]), ranked[0].logprob
            top = {token_text(e): e.logprob for e in sorted(ranked, key=lambda e: e.rank)}
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, text_offset


def _echo_entries(run: Run, choice: Choice) -> tuple[list[dict[int, TokenLogprob] | None], str]:
    """The prompt's logprob entries for an echo with logprobs, and its first token's text."""
    if not (run.req.echo and run.req.params[0].logprobs is not None):
        return [], ""
    first_id = run.req.prompts[choice.prompt_index].token_ids[0]
    return choice.prompt_logprobs or [], run.tokenizer.decode([first_id])


class CompletionStreamFormatter:
    chunk_object = "text_completion"

    def __init__(self) -> None:
        self._text_offsets: dict[int, int] = {}
        self._echoed: set[int] = set()

    def start_chunks(self, run: Run) -> list[dict[str, Any]]:
        # With logprobs the echo waits for the first delta, which brings the prompt's.
        if not run.req.echo or run.req.params[0].logprobs is not None:
            return []
        return [self._chunk(run, c.index, _prompt_text(run, c), None, None, None)
                for c in run.choices]

    def chunk(self, run: Run, choice: Choice, delta: SeqDelta) -> dict[str, Any] | None:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        text, logprobs, k = delta.text, None, run.req.params[0].logprobs
        entries: list[dict[int, TokenLogprob] | None] = list(delta.logprobs or [])
        first_text = ""
        if run.req.echo and k is not None and choice.index not in self._echoed:
            self._echoed.add(choice.index)
            prompt_entries, first_text = _echo_entries(run, choice)
            text = _prompt_text(run, choice) + text
            entries = [*prompt_entries, *entries]
        if k is not None:
            offset = self._text_offsets.get(choice.index, 0)
            logprobs, self._text_offsets[choice.index] = completion_logprobs(
                entries, offset, k, first_text)
        return self._chunk(run, choice.index, text, logprobs, delta.finish_reason,
                           delta.stop_reason)

    def _chunk(self, run: Run, index: int, text: str, logprobs: dict | None,
               finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
        chunk = chunk_header(run, self.chunk_object)
        chunk["choices"] = [{"index": index, "text": text, "logprobs": logprobs,
                             "finish_reason": finish_reason, "stop_reason": stop_reason}]
        return with_usage_field(run, chunk)


def _prompt_text(run: Run, choice: Choice) -> str:
    prompt = run.req.prompts[choice.prompt_index]
    if prompt.text is not None:
        return prompt.text
    return run.tokenizer.decode(prompt.token_ids)


def completion_response(run: Run, choices: list[Choice]) -> dict[str, Any]:
    body_choices = []
    k = run.req.params[0].logprobs
    for choice in choices:
        text = (_prompt_text(run, choice) if run.req.echo else "") + choice.text
        logprobs = None
        if k is not None:
            prompt_entries, first_text = _echo_entries(run, choice)
            logprobs, _ = completion_logprobs([*prompt_entries, *choice.logprobs], 0, k,
                                              first_text)
        body_choice = {"index": choice.index, "text": text, "logprobs": logprobs,
                       "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        if run.req.prompt_logprobs is not None:
            body_choice["prompt_logprobs"] = vllm_prompt_logprobs(choice.prompt_logprobs,
                                                                  run.req.prompt_logprobs)
        body_choices.append(body_choice)
    return {"id": run.request_id, "object": "text_completion", "created": run.created,
            "model": run.model, "choices": body_choices, "usage": run.usage()}


async def create_completion(request: web.Request) -> web.StreamResponse:
    reject_if_draining(request.app)
    raw = await read_body(request)
    req = await off_loop(parse_completion_request, request, raw)
    client = request.app[CLIENT_KEY]
    run = await submit(client, request.app[METRICS_KEY], f"cmpl-{uuid.uuid4().hex}", req.model,
                       req)
    if req.stream:
        return await stream_sse(request, client, run, CompletionStreamFormatter())
    choices = await collect(client, run)
    return await respond(run, completion_response, choices)
