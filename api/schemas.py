"""Request and response bodies of the OpenAI-compatible routes, as msgspec Structs.

One source: requests are decoded and validated by these types (``protocol.read_request``), and
``/openapi.json`` is generated from them (api/openapi.py). Every request field defaults to
``UNSET``, so the handlers see exactly the fields a client sent (``null`` included) and the
model's generation defaults fill only the others. Unknown fields are ignored, as OpenAI's and
vLLM's servers do. What depends on the server (``n`` and stop-list limits, the vocabulary, the
served names, the context length) is checked by the handlers, which name the field as well.

Fields that are typed here but refused when set (api/fields.py) keep OpenAI's or vLLM's types so
the document is complete; issue #21's group among them is marked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

# NOTE: ints cross to the engine as msgpack int64; larger ones cannot travel.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Logprobs20 = Annotated[int, Meta(ge=0, le=20)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Positive = Annotated[int, Meta(ge=1, le=2**63 - 1)]
NonNegative = Annotated[int, Meta(ge=0, le=2**63 - 1)]

_REQUEST = {"kw_only": True, "omit_defaults": True}


class StreamOptions(msgspec.Struct, **_REQUEST):
    include_usage: bool | None | UnsetType = UNSET


class _Sampling(msgspec.Struct, **_REQUEST):
    """Fields both generation routes share (OpenAI's, then vLLM's extensions)."""

    model: str | None | UnsetType = UNSET
    n: Positive | None | UnsetType = UNSET
    temperature: Annotated[float, Meta(ge=0.0)] | None | UnsetType = UNSET
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None | UnsetType = UNSET
    seed: Int64 | None | UnsetType = UNSET
    presence_penalty: Penalty | None | UnsetType = UNSET
    frequency_penalty: Penalty | None | UnsetType = UNSET
    max_tokens: Positive | None | UnsetType = UNSET
    stop: str | list[str] | None | UnsetType = UNSET
    stream: bool | None | UnsetType = UNSET
    stream_options: StreamOptions | None | UnsetType = UNSET
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None | UnsetType = UNSET
    user: str | None | UnsetType = UNSET
    # vLLM's sampling extensions
    top_k: Annotated[int, Meta(ge=-1, le=2**63 - 1)] | None | UnsetType = UNSET
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None | UnsetType = UNSET
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None | UnsetType = UNSET
    min_tokens: NonNegative | None | UnsetType = UNSET
    stop_token_ids: list[TokenId] | None | UnsetType = UNSET
    ignore_eos: bool | None | UnsetType = UNSET
    include_stop_str_in_output: bool | None | UnsetType = UNSET
    skip_special_tokens: bool | None | UnsetType = UNSET
    add_special_tokens: bool | None | UnsetType = UNSET
    prompt_logprobs: Logprobs20 | None | UnsetType = UNSET
    # bastion's: seconds until the deadline (also the X-Request-Timeout header)
    timeout: Annotated[float, Meta(gt=0.0)] | None | UnsetType = UNSET
    # Typed, refused when set (api/fields.py)
    best_of: Positive | None | UnsetType = UNSET
    use_beam_search: bool | None | UnsetType = UNSET
    length_penalty: float | None | UnsetType = UNSET
    truncate_prompt_tokens: Int64 | None | UnsetType = UNSET
    allowed_token_ids: list[TokenId] | None | UnsetType = UNSET
    bad_words: list[str] | None | UnsetType = UNSET
    spaces_between_special_tokens: bool | None | UnsetType = UNSET
    logits_processors: list[Any] | None | UnsetType = UNSET
    return_tokens_as_token_ids: bool | None | UnsetType = UNSET
    return_token_ids: bool | None | UnsetType = UNSET
    cache_salt: str | None | UnsetType = UNSET
    kv_transfer_params: dict[str, Any] | None | UnsetType = UNSET
    vllm_xargs: dict[str, Any] | None | UnsetType = UNSET
    priority: Int64 | None | UnsetType = UNSET
    request_id: str | None | UnsetType = UNSET
    # ---- issue #21 (structured outputs, tools, reasoning): refused until it merges ----
    response_format: dict[str, Any] | None | UnsetType = UNSET
    structured_outputs: dict[str, Any] | None | UnsetType = UNSET
    guided_json: str | dict[str, Any] | None | UnsetType = UNSET
    guided_regex: str | None | UnsetType = UNSET
    guided_choice: list[str] | None | UnsetType = UNSET
    guided_grammar: str | None | UnsetType = UNSET
    guided_decoding_backend: str | None | UnsetType = UNSET
    guided_whitespace_pattern: str | None | UnsetType = UNSET
    # ---- end of issue #21's group ----


class CompletionRequest(_Sampling, **_REQUEST):
    """``POST /v1/completions``: one prompt or a batch (texts, token ids, lists of either)."""

    prompt: (Annotated[str, Meta(min_length=1)]
             | Annotated[list[Annotated[str, Meta(min_length=1)] | TokenId | list[TokenId]],
                         Meta(min_length=1)])
    echo: bool | None | UnsetType = UNSET
    logprobs: Logprobs20 | None | UnsetType = UNSET
    suffix: str | None | UnsetType = UNSET
    prompt_embeds: str | list[str] | None | UnsetType = UNSET


class TextPart(msgspec.Struct, **_REQUEST):
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct, **_REQUEST):
    """A message as the chat template gets it: text content only (a string or text parts;
    ``null`` for an assistant turn)."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None | UnsetType = UNSET
    # An assistant turn's calls and a tool result's id (checked in api/tools.py).
    tool_calls: list[dict[str, Any]] | None | UnsetType = UNSET
    tool_call_id: str | None | UnsetType = UNSET


class ChatCompletionRequest(_Sampling, **_REQUEST):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    logprobs: bool | None | UnsetType = UNSET
    top_logprobs: Logprobs20 | None | UnsetType = UNSET
    max_completion_tokens: Positive | None | UnsetType = UNSET
    add_generation_prompt: bool | None | UnsetType = UNSET
    # OpenAI's, accepted and ignored (api/fields.py's NO_EFFECT)
    metadata: dict[str, str] | None | UnsetType = UNSET
    store: bool | None | UnsetType = UNSET
    service_tier: str | None | UnsetType = UNSET
    safety_identifier: str | None | UnsetType = UNSET
    prompt_cache_key: str | None | UnsetType = UNSET
    prompt_cache_retention: str | None | UnsetType = UNSET
    prompt_cache_options: dict[str, Any] | None | UnsetType = UNSET
    # Typed, refused when set (api/fields.py)
    audio: dict[str, Any] | None | UnsetType = UNSET
    modalities: list[str] | None | UnsetType = UNSET
    prediction: dict[str, Any] | None | UnsetType = UNSET
    web_search_options: dict[str, Any] | None | UnsetType = UNSET
    verbosity: str | None | UnsetType = UNSET
    moderation: Any | UnsetType = UNSET
    echo: bool | None | UnsetType = UNSET
    continue_final_message: bool | None | UnsetType = UNSET
    documents: list[dict[str, str]] | None | UnsetType = UNSET
    chat_template: str | None | UnsetType = UNSET
    mm_processor_kwargs: dict[str, Any] | None | UnsetType = UNSET
    # Tool calling and the template's variables (api/tools.py, api/chat.py)
    # NOTE: loosely typed: api/tools.py checks them (function names, JSON schemas) with
    # messages that name what is wrong.
    tools: list[dict[str, Any]] | None | UnsetType = UNSET
    tool_choice: str | dict[str, Any] | None | UnsetType = UNSET
    parallel_tool_calls: bool | None | UnsetType = UNSET
    chat_template_kwargs: dict[str, Any] | None | UnsetType = UNSET
    # Typed, refused when set (api/fields.py)
    functions: list[dict[str, Any]] | None | UnsetType = UNSET
    function_call: str | dict[str, Any] | None | UnsetType = UNSET
    reasoning_effort: str | None | UnsetType = UNSET
    include_reasoning: bool | None | UnsetType = UNSET


class TokenizeRequest(msgspec.Struct, **_REQUEST):
    """``POST /tokenize`` (vLLM's): exactly one of ``prompt`` or ``messages``."""

    model: str | None | UnsetType = UNSET
    prompt: str | None | UnsetType = UNSET
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None | UnsetType = UNSET
    add_special_tokens: bool | None | UnsetType = UNSET
    add_generation_prompt: bool | None | UnsetType = UNSET
    return_token_strs: bool | None | UnsetType = UNSET
    continue_final_message: bool | None | UnsetType = UNSET
    chat_template: str | None | UnsetType = UNSET
    chat_template_kwargs: dict[str, Any] | None | UnsetType = UNSET
    tools: list[dict[str, Any]] | None | UnsetType = UNSET


class DetokenizeRequest(msgspec.Struct, **_REQUEST):
    """``POST /detokenize`` (vLLM's)."""

    tokens: list[TokenId]
    model: str | None | UnsetType = UNSET


def fields_set(body: msgspec.Struct) -> dict[str, Any]:
    """The fields the client sent (``null`` ones included), nested Structs as dicts."""
    return {name: msgspec.to_builtins(value) for name in body.__struct_fields__
            if (value := getattr(body, name)) is not UNSET}


# ---------------------------------------------------------------------------------- responses
# NOTE: the handlers build these bodies as dicts (cheaper for large logprobs answers); the
# types describe them for /openapi.json, and the schemathesis run (tests/test_fuzz.py) checks
# every response it gets against them.


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy shape; an echoed prompt's first token is scored null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int
    decoded_token: str


VllmPromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = None
    prompt_logprobs: VllmPromptLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobInfo(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprobInfo] | None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # the model's JSON text


class ToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None | UnsetType = UNSET  # --reasoning-parser
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: VllmPromptLogprobs | None = None


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoRAAdapter(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(msgspec.Struct, kw_only=True):
    lora_name: str


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class Health(msgspec.Struct):
    status: Literal["ok"]


class Version(msgspec.Struct):
    version: str


class EngineStatusInfo(msgspec.Struct):
    engine_id: int
    state: str
    epoch: int
    fault_info: str | None = None
    last_action: str | None = None
    last_action_id: str | None = None
    last_action_error: str | None = None
    fault_kind: str | None = None
    # Seconds per phase of the engine's last recovery (spawn_or_promote, spare_wait, load,
    # kv_cache, graphs, rejoin, total).
    last_recovery_phases: dict[str, float] = {}
    num_requests: int | None = None
    # The serving engine and worker processes, and the warm spare: off, none, warming, ready.
    pid: int | None = None
    worker_pids: list[int] = []
    spare: str | None = None


class EngineStatusList(msgspec.Struct):
    engines: list[EngineStatusInfo]


# The fault-tolerance bodies as documented; api/fault_tolerance.py decodes them as strictly
# (no other fields, an instruction's params only as it defines them: none so far).
class NoParams(msgspec.Struct, forbid_unknown_fields=True):
    pass


class FaultToleranceApply(msgspec.Struct, forbid_unknown_fields=True):
    instruction: Literal["retry", "reinit"]
    params: NoParams | None = None


class FaultToleranceAccepted(msgspec.Struct):
    request_id: str


class FaultInjection(msgspec.Struct, forbid_unknown_fields=True):
    kind: Literal["raise", "worker_exit", "hang"]
    engine: Annotated[int, Meta(ge=0)] = 0
