"""Request parsing and validation for ``/v1/completions`` and ``/v1/chat/completions``.

Everything a client can get wrong is caught here, with a 400 that names the field, so bad input
never reaches the engine. Field names and defaults follow OpenAI's API plus vLLM's extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ...).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from bastion.api.config import CONFIG_KEY, ApiConfig
from bastion.api.connections import with_idle_timeout
from bastion.api.errors import ApiError, bad_request
from bastion.api.structured_outputs import parse_structured_outputs
from bastion.core.stop_matcher import stop_automaton
from bastion.ipc.messages import InvalidParam, SamplingParams

_MAX_INT = 2**63  # NOTE: ints cross to the engine as msgpack int64; larger ones cannot travel
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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
    """The top-level field a msgspec error names (``... - at `$.params.x` ``, ``unknown field
    `x` ``), if any."""
    message = str(exc)
    _, sep, path = message.rpartition("at `$.")
    for marker in ("unknown field `", "missing required field `"):
        if not sep:
            _, sep, path = message.rpartition(marker)
    if not sep:
        return None
    return path.rstrip("`").split(".")[0].split("[")[0] or None


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (see ``read_body`` and ``decode_json`` for the errors)."""
    body = decode_json(await read_body(request))
    if not isinstance(body, dict):
        raise bad_request(f"Request body must be a JSON object, got {type(body).__name__}")
    return body


# ------------------------------------------------------------------------------ typed getters


def get_int(body: dict, name: str, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    if not -_MAX_INT <= value < _MAX_INT:
        raise bad_request(f"{name} must fit in 64 bits, got {value}", name)
    return value


def get_float(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


def get_str(body: dict, name: str, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {value!r}", name)
    return value


def _stop_strings(body: dict, config: ApiConfig) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or a list of strings", "stop")
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
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(v) and 0 <= v < _MAX_INT for v in value):
        raise bad_request(f"{name} must be a list of non-negative integers", name)
    if len(value) > max_len:
        raise bad_request(f"{name} may hold at most {max_len} ids, got {len(value)}", name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------- common parameters

# Fields whose non-default values would change the output in ways bastion does not implement;
# silently ignoring them would return something the client did not ask for.
_UNSUPPORTED = {
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "tools": (None, []),
    "functions": (None, []),
}


def check_model(body: dict, served_model_names: tuple[str, ...]) -> str:
    """The request's ``model`` must be one of the served names; answers carry the first."""
    model = get_str(body, "model", served_model_names[0])
    if model not in served_model_names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{served_model_names[0]}`", "model", "model_not_found")
    return served_model_names[0]


def check_unsupported(body: dict) -> None:
    for name, accepted in _UNSUPPORTED.items():
        if name in body and body[name] not in accepted:
            raise bad_request(f"{name} is not supported by this server", name)


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
    elif body.get("timeout") is not None:
        timeout = get_float(body, "timeout", 0.0)
    if timeout is None:
        return None
    if not math.isfinite(timeout) or timeout <= 0:
        raise bad_request(f"timeout must be a positive number of seconds, got {timeout}",
                          "timeout")
    return time.time() + timeout


def parse_stream_options(body: dict, stream: bool) -> bool:
    """Whether to send the final usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return get_bool(options, "include_usage", False)


def base_sampling_params(body: dict, config: ApiConfig, logprobs: int | None,
                         max_tokens: int | None) -> SamplingParams:
    """Everything but the per-prompt ``max_tokens`` (checked later against the context)."""
    n = get_int(body, "n", 1)
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
            temperature=get_float(body, "temperature", 1.0),
            top_p=get_float(body, "top_p", 1.0),
            top_k=get_int(body, "top_k", 0),
            min_p=get_float(body, "min_p", 0.0),
            seed=get_int(body, "seed"),
            presence_penalty=get_float(body, "presence_penalty", 0.0),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0),
            repetition_penalty=get_float(body, "repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=get_int(body, "min_tokens", 0),
            stop=_stop_strings(body, config),
            stop_token_ids=_int_list(body, "stop_token_ids", config.max_stop_token_ids),
            ignore_eos=get_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
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
