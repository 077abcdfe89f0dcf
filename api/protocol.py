"""Request parsing and validation for ``/v1/completions`` and ``/v1/chat/completions``.

Everything a client can get wrong is caught here or by the request types (api/schemas.py), with
a 400 that names the field, so bad input never reaches the engine. Field names and defaults
follow OpenAI's API plus vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ...).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from bastion.api.config import CONFIG_KEY, ApiConfig
from bastion.api.connections import with_idle_timeout
from bastion.api.errors import ApiError, bad_request
from bastion.api.schemas import fields_set
from bastion.api.structured_outputs import parse_structured_outputs
from bastion.core.stop_matcher import stop_automaton
from bastion.ipc.messages import InvalidParam, LoRARequest, SamplingParams


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # None when the client sent token ids


@dataclass
class GenerateRequest:
    """A validated request: one ``SamplingParams`` per prompt (their ``max_tokens`` differ)."""

    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    deadline: float | None
    echo: bool = False
    top_logprobs: int | None = None  # chat only: OpenAI's top-N, separate from the sampled one
    chat_output: Any = None  # chat only: an api.chat_output.OutputSpec (tools, reasoning)
    lora_request: LoRARequest | None = None  # ``model`` named a LoRA adapter
    prompt_logprobs: int | None = None  # vLLM's field, for the response's prompt_logprobs

    @property
    def n(self) -> int:
        return self.params[0].n


def require_json_content_type(request: web.Request) -> None:
    """415 unless the body is declared ``application/json``.

    NOTE: this is what closes the cross-site path: a web page can POST ``text/plain`` (or a
    form) to any origin without a CORS preflight, but never ``application/json``.
    """
    if request.content_type != "application/json":
        declared = request.headers.get("Content-Type", "none")
        raise ApiError(415, f"Content-Type must be application/json, got {declared}",
                       code="unsupported_media_type")


async def read_body(request: web.Request) -> bytes:
    """The raw JSON body of a POST: 415 for another media type, 400 when empty; aiohttp
    raises 413 past ``client_max_size``."""
    require_json_content_type(request)
    try:
        raw = await with_idle_timeout(request.read(), request.app[CONFIG_KEY], "sending its body")
    except TimeoutError as exc:
        raise ApiError(408, f"Request body not received: {exc}", code="request_timeout",
                       headers={"Connection": "close"}) from None
    if not raw:
        raise bad_request("Request body is empty; send a JSON object")
    return raw


def decode_json(raw: bytes, into: Any = Any) -> Any:
    """``raw`` decoded (and validated as the type ``into``); every way that fails is a 400."""
    try:
        return msgspec.json.decode(raw, type=into)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid request body: {exc}", _error_param(exc)) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("Request body is nested too deeply to decode") from None


def _error_param(exc: msgspec.ValidationError) -> str | None:
    """The path of the field a msgspec error names, as ``messages[0].role`` (``... - at
    `$.messages[0]` `` plus ``missing required field `role` ``), if any."""
    message, sep, at = str(exc).rpartition(" - at `$")
    # msgspec writes a dict value's place as "[...]": the field is the dict.
    path = at.rstrip("`").lstrip(".").replace("[...]", "") if sep else ""
    if not sep:
        message = str(exc)
    for marker in ("unknown field `", "missing required field `"):
        if marker in message:
            name = message.split(marker, 1)[1].split("`", 1)[0]
            return f"{path}.{name}" if path else name
    return path or None


def read_request(raw: bytes, into: type[msgspec.Struct]) -> dict[str, Any]:
    """A request body decoded and validated as the Struct ``into`` (api/schemas.py), as a
    dict of the fields the client sent; every way that fails is a 400 naming the field."""
    body = fields_set(decode_json(raw, into))
    for name, value in body.items():
        # NOTE: JSON has no infinity, but 1e999 decodes to one.
        if isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", name)
    return body


def get(body: dict, name: str, default: Any = None) -> Any:
    """``body[name]``, or ``default`` when it is absent or null (types were checked when the
    body was decoded)."""
    value = body.get(name)
    return default if value is None else value


def _stop_strings(body: dict, config: ApiConfig) -> list[str]:
    stop = get(body, "stop", [])
    if isinstance(stop, str):
        stop = [stop]
    # The front end matches every stop string of every sequence on each token; the bounds keep
    # one request's share of that work (and of the automaton's memory) small.
    if len(stop) > config.max_stop_strings:
        raise bad_request(f"stop may hold at most {config.max_stop_strings} strings, got "
                          f"{len(stop)}", "stop")
    too_long = next((s for s in stop if len(s) > config.max_stop_len), None)
    if too_long is not None:
        raise bad_request(f"each stop string may be at most {config.max_stop_len} characters, "
                          f"got one of {len(too_long)}", "stop")
    if all(stop):  # "" is refused by SamplingParams, with its own message
        # Built here, where parsing runs off the event loop (tens of ms at the bounds); the
        # cache hands it to every sequence of the request.
        stop_automaton(tuple(stop))
    return stop


def _int_list(body: dict, name: str, max_len: int) -> list[int]:
    value = get(body, name, [])
    if len(value) > max_len:
        raise bad_request(f"{name} may hold at most {max_len} ids, got {len(value)}", name)
    return value


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's map of token ids (decimal strings) to a bias in [-100, 100]."""
    value = get(body, "logit_bias", {})
    bias: dict[int, float] = {}
    for key, number in value.items():  # the values' range was checked when decoding
        # Only canonical decimals: "7" and "07" would otherwise be two entries for one id.
        if not (key.isdecimal() and str(int(key)) == key and int(key) < vocab_size):
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}) written "
                              f"as decimal strings, got {key!r}", "logit_bias")
        bias[int(key)] = number
    return bias or None


# ------------------------------------------------------------------------- common parameters

def check_model(body: dict, served_model_names: tuple[str, ...],
                adapters: Collection[str] = ()) -> str:
    """The request's ``model`` must be one of the served names (answers carry the first) or a
    loaded LoRA adapter's name (answers carry it)."""
    model = get(body, "model", served_model_names[0])
    if model in adapters:
        return model
    if model not in served_model_names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{served_model_names[0]}`", "model", "model_not_found")
    return served_model_names[0]


def parse_deadline(request: web.Request, body: dict) -> float | None:
    """``X-Request-Timeout`` header or body ``timeout``, in seconds from now."""
    header = request.headers.get("X-Request-Timeout")
    timeout: float | None = None
    if header is not None:
        try:
            timeout = float(header)
        except ValueError:
            raise bad_request(f"X-Request-Timeout must be a number of seconds, got {header!r}",
                              "timeout") from None
    else:
        timeout = get(body, "timeout")
    if timeout is None:
        return None
    if not math.isfinite(timeout) or timeout <= 0:
        raise bad_request(f"timeout must be a positive number of seconds, got {timeout}",
                          "timeout")
    return time.time() + timeout


def parse_prompt_logprobs(body: dict, config: ApiConfig, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: top-k per prompt token, for non-streamed answers."""
    k = get(body, "prompt_logprobs")
    if k is None:
        return None
    if k > config.max_logprobs:
        raise bad_request(f"prompt_logprobs must be in [0, {config.max_logprobs}], got {k}",
                          "prompt_logprobs")
    if stream:
        raise bad_request("prompt_logprobs is not available when stream is true",
                          "prompt_logprobs")
    return k


def parse_stream_options(body: dict, stream: bool) -> bool:
    """Whether to send the final usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    return get(options, "include_usage", False)


def base_sampling_params(body: dict, config: ApiConfig, logprobs: int | None,
                         max_tokens: int | None, vocab_size: int,
                         prompt_logprobs: int | None = None) -> SamplingParams:
    """Everything but the per-prompt ``max_tokens`` (checked later against the context);
    ``vocab_size`` bounds the token ids of ``logit_bias``."""
    n = get(body, "n", 1)
    if n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}, got {n}", "n")
    if logprobs is not None and logprobs > config.max_logprobs:
        raise bad_request(f"logprobs must be at most {config.max_logprobs}, got {logprobs}",
                          "logprobs")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    try:
        return SamplingParams(
            n=n,
            temperature=get(body, "temperature", 1.0),
            top_p=get(body, "top_p", 1.0),
            top_k=get(body, "top_k", 0),
            min_p=get(body, "min_p", 0.0),
            seed=get(body, "seed"),
            presence_penalty=get(body, "presence_penalty", 0.0),
            frequency_penalty=get(body, "frequency_penalty", 0.0),
            repetition_penalty=get(body, "repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=get(body, "min_tokens", 0),
            stop=_stop_strings(body, config),
            stop_token_ids=_int_list(body, "stop_token_ids", config.max_stop_token_ids),
            ignore_eos=get(body, "ignore_eos", False),
            logprobs=logprobs,
            include_stop_str_in_output=get(body, "include_stop_str_in_output", False),
            skip_special_tokens=get(body, "skip_special_tokens", True),
            logit_bias=_logit_bias(body, vocab_size),
            prompt_logprobs=prompt_logprobs,
            structured_outputs=parse_structured_outputs(body),
        )
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None


def fit_to_context(params: SamplingParams, num_prompt_tokens: int, max_model_len: int,
                   requested: int | None, where: str, default: int | None = None
                   ) -> SamplingParams:
    """Resolve ``max_tokens`` for one prompt: the request's, else ``default`` (at most what is
    left of the context), else what is left of the context."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens} tokens in the {where}, which leaves no room for the "
            f"completion. Please reduce the length of the {where}.",
            "messages" if where == "messages" else "prompt", "context_length_exceeded")
    if requested is not None and num_prompt_tokens + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"{where}, {requested} in the completion). Please reduce the length of the {where} "
            "or completion.", "max_tokens", "context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    if requested is not None:
        max_tokens = requested
    else:
        max_tokens = room if default is None else min(default, room)
    try:
        return msgspec.structs.replace(params, max_tokens=max_tokens)  # re-verifies
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None
