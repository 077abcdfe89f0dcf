"""``POST /v1/chat/completions``: messages through the model's chat template, OpenAI's
``chat.completion`` / ``chat.completion.chunk`` objects."""

from __future__ import annotations

import inspect
import uuid
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from bastion.api.chat_output import ChoiceOutput, OutputSpec, constrain_after_reasoning
from bastion.api.config import CLIENT_KEY, CONFIG_KEY, METRICS_KEY, MODEL_NAMES_KEY
from bastion.api.engine_protocol import EngineClient
from bastion.api.errors import bad_request
from bastion.api.fields import check_unsupported
from bastion.api.lora import LORA_KEY
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
from bastion.api.schemas import ChatCompletionRequest
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
    vllm_prompt_logprobs,
    with_usage_field,
)
from bastion.api.tools import ToolRequest, parse_tools, tool_message_fields, with_tool_constraint
from bastion.core.output_processor import SeqDelta
from bastion.core.outputs import TokenLogprob


def parse_messages(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: role and plain-text content (roles and
    content types were checked when decoding), and the fields of tool calls and their results
    (api/tools.py)."""
    messages = []
    for i, message in enumerate(value):
        role = message["role"]
        content = message.get("content")
        if content is None and role != "assistant":
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts "
                              '({"type": "text", "text": ...}); only an assistant turn may omit '
                              "it", f"messages[{i}].content")
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        # "developer" is OpenAI's newer name for "system"; templates know only the latter.
        messages.append({"role": "system" if role == "developer" else role,
                         "content": content or "", **tool_message_fields(message, i, role)})
    return messages


# What a request's chat_template_kwargs may not set: apply_chat_template's own parameters.
_TEMPLATE_CALL_ARGS = frozenset(inspect.signature(
    PreTrainedTokenizerBase.apply_chat_template).parameters) | {"messages"}


def parse_chat_template_kwargs(body: dict) -> dict[str, Any]:
    """Extra variables for the chat template (``{"enable_thinking": false}``), as vLLM's."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    reserved = sorted(_TEMPLATE_CALL_ARGS & set(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}; send them "
                          "as the request's own fields", "chat_template_kwargs")
    return kwargs


def render_prompt(client: EngineClient, messages: list[dict[str, Any]],
                  add_generation_prompt: bool, add_special_tokens: bool = False,
                  tools: ToolRequest | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> Prompt:
    """The chat template's text and its ids; the template writes the special tokens itself,
    so by default (vLLM's) the tokenizer adds none."""
    try:
        text = client.tokenizer.apply_chat_template(
            messages, tools=tools.tools if tools is not None else None, tokenize=False,
            add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 (jinja2 errors, the template's raise_exception())
        raise bad_request(f"The chat template could not render these messages: {exc}",
                          "messages") from None
    return Prompt(client.tokenizer.encode(text, add_special_tokens=add_special_tokens), text)


def parse_chat_request(request: web.Request, raw: bytes) -> GenerateRequest:
    config, client = request.app[CONFIG_KEY], request.app[CLIENT_KEY]
    body = read_request(raw, ChatCompletionRequest)
    model = check_model(body, request.app[MODEL_NAMES_KEY], request.app[LORA_KEY].adapters)
    body = apply_generation_defaults(body, config.generation_defaults)
    check_unsupported(body, chat=True)
    messages = parse_messages(body["messages"])
    tools = parse_tools(body, config)
    template_kwargs = parse_chat_template_kwargs(body)
    logprobs = get(body, "logprobs", False)
    top_logprobs = get(body, "top_logprobs")
    if top_logprobs is not None:
        if not logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if top_logprobs > config.max_logprobs:
            raise bad_request(f"top_logprobs must be in [0, {config.max_logprobs}], got "
                              f"{top_logprobs}", "top_logprobs")
    max_tokens = get(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = get(body, "max_tokens")
    stream = get(body, "stream", False)
    include_usage = parse_stream_options(body, stream)
    deadline = parse_deadline(request, body)
    prompt_logprobs = parse_prompt_logprobs(body, config, stream)
    base = base_sampling_params(body, config, (top_logprobs or 0) if logprobs else None,
                                max_tokens, len(client.tokenizer), prompt_logprobs)
    constrained_by = "response_format" if base.structured_outputs is not None else "tool_choice"
    base = with_tool_constraint(base, tools)
    prompt = render_prompt(client, messages, get(body, "add_generation_prompt", True),
                           get(body, "add_special_tokens", False), tools, template_kwargs)
    base = constrain_after_reasoning(base, config, prompt.text, client.tokenizer, constrained_by)
    params = fit_to_context(base, len(prompt.token_ids), client.max_model_len, max_tokens,
                            "messages")
    chat_output = None
    if tools is not None or config.reasoning_parser is not None:
        chat_output = OutputSpec(config, tools, prompt.text)
    return GenerateRequest(model, [prompt], [params], stream, include_usage, deadline,
                           top_logprobs=(top_logprobs or 0) if logprobs else None,
                           prompt_logprobs=prompt_logprobs, chat_output=chat_output,
                           lora_request=request.app[LORA_KEY].get(model))


def _token_info(entry: TokenLogprob) -> dict[str, Any]:
    text = token_text(entry)
    return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict[int, TokenLogprob]], top_n: int) -> dict[str, Any]:
    """OpenAI's chat shape: the sampled token, then exactly the top-N by rank."""
    content = []
    for entry in entries:
        sampled = next(iter(entry.values()))
        top = sorted((e for e in entry.values() if e.rank <= top_n), key=lambda e: e.rank)
        content.append({**_token_info(sampled), "top_logprobs": [_token_info(e) for e in top]})
    return {"content": content}


class ChatStreamFormatter:
    chunk_object = "chat.completion.chunk"

    def __init__(self) -> None:
        self._outputs: dict[int, ChoiceOutput] = {}  # by choice index, with a chat_output

    def start_chunks(self, run: Run) -> list[dict[str, Any]]:
        return [self._chunk(run, c.index, {"role": "assistant", "content": ""}, None, None, None)
                for c in run.choices]

    def chunk(self, run: Run, choice: Choice, delta: SeqDelta) -> dict[str, Any] | None:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        logprobs = None
        if run.req.top_logprobs is not None:
            logprobs = chat_logprobs(delta.logprobs or [], run.req.top_logprobs)
        finish_reason = delta.finish_reason
        if run.req.chat_output is None:
            body = {"content": delta.text} if delta.text else {}
        else:
            output = self._outputs.get(choice.index)
            if output is None:
                output = self._outputs[choice.index] = run.req.chat_output.new_choice()
            body = output.feed(delta.text).to_openai() if delta.text else {}
            if finish_reason is not None:
                body = _merged(body, output.finish().to_openai())
                finish_reason = output.finish_reason(finish_reason)
            if not body and finish_reason is None and not delta.logprobs:
                return None  # held back by a parser (a tag's prefix)
        return self._chunk(run, choice.index, body, logprobs, finish_reason, delta.stop_reason)

    def _chunk(self, run: Run, index: int, delta: dict[str, Any], logprobs: dict | None,
               finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
        chunk = chunk_header(run, self.chunk_object)
        chunk["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason, "stop_reason": stop_reason}]
        return with_usage_field(run, chunk)


def _merged(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two deltas of one choice as one (a parser's last pieces join the final chunk)."""
    merged = dict(first)
    for key, value in second.items():
        merged[key] = merged[key] + value if key in merged else value
    return merged


def chat_response(run: Run, choices: list[Choice]) -> dict[str, Any]:
    body_choices = []
    for choice in choices:
        logprobs = None
        if run.req.top_logprobs is not None:
            logprobs = chat_logprobs(choice.logprobs, run.req.top_logprobs)
        message = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if run.req.chat_output is not None:
            message, finish_reason = run.req.chat_output.new_choice().message(choice.text,
                                                                               finish_reason)
        body_choices.append({"index": choice.index, "message": message,
                             "logprobs": logprobs, "finish_reason": finish_reason,
                             "stop_reason": choice.stop_reason})
    body = {"id": run.request_id, "object": "chat.completion", "created": run.created,
            "model": run.model, "choices": body_choices, "usage": run.usage()}
    if run.req.prompt_logprobs is not None:  # vLLM's: one prompt, so on the response
        body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs,
                                                       run.req.prompt_logprobs)
    return body


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    reject_if_draining(request.app)
    raw = await read_body(request)
    req = await off_loop(parse_chat_request, request, raw)
    client = request.app[CLIENT_KEY]
    run = await submit(client, request.app[METRICS_KEY], f"chatcmpl-{uuid.uuid4().hex}",
                       req.model, req)
    if req.stream:
        return await stream_sse(request, client, run, ChatStreamFormatter())
    choices = await collect(client, run)
    return await respond(run, chat_response, choices)
