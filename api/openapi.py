"""``GET /openapi.json``: an OpenAPI 3 outline of every route, request and response."""

from __future__ import annotations

from typing import Any

from bastion import __version__
from bastion.api.config import ApiConfig

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": "string", "nullable": True}



def _range(kind: str, low: float | None = None, high: float | None = None,
           exclusive_low: bool = False) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": kind}
    if low is not None:
        schema["minimum"] = low
        if exclusive_low:
            schema["exclusiveMinimum"] = True
    if high is not None:
        schema["maximum"] = high
    return schema


_INT64 = _range("integer", -2**63, 2**63 - 1)
# The ranges SamplingParams.verify accepts (ipc/messages.py).
_SAMPLING = {
    "model": _STR, "n": _INT, "temperature": _range("number", 0),
    "top_p": _range("number", 0, 1, exclusive_low=True), "top_k": _range("integer", -1),
    "min_p": _range("number", 0, 1), "seed": _INT64,
    "presence_penalty": _range("number", -2, 2), "frequency_penalty": _range("number", -2, 2),
    "repetition_penalty": _range("number", 0, 2, exclusive_low=True),
    "max_tokens": _range("integer", 1), "min_tokens": _range("integer", 0),
    # "stop", "stop_token_ids", "n" and "model" get their bounds from the server (_bounded).
    "stop": {"oneOf": [_STR, {"type": "array", "items": _STR}]},
    "stop_token_ids": {"type": "array", "items": _INT}, "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL, "include_stop_str_in_output": _BOOL, "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "timeout": {**_range("number", 0, exclusive_low=True),
                "description": "seconds until the request's deadline"},
}

_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": _STR}}}

_USAGE = {"type": "object", "properties": {
    "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}}}}

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": _STR, "type": _STR, "param": _NULLABLE_STR, "code": _NULLABLE_STR}}}},
    "Usage": _USAGE,
    "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
        **_SAMPLING,
        "prompt": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": _range("integer", 0)},
            {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                        "items": _range("integer", 0)}}]},
        "logprobs": _range("integer", 0, 20), "echo": _BOOL}},
    "Completion": {"type": "object", "properties": {
        "id": _STR, "object": {"type": "string", "enum": ["text_completion"]}, "created": _INT,
        "model": _STR, "usage": {"$ref": "#/components/schemas/Usage"},
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "text": _STR, "logprobs": {"type": "object", "nullable": True},
            "finish_reason": _NULLABLE_STR}}}}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
        **_SAMPLING, "max_completion_tokens": _range("integer", 1), "logprobs": _BOOL,
        "top_logprobs": _range("integer", 0, 20),
        "add_generation_prompt": _BOOL, "messages": _MESSAGES}},
    "ChatCompletion": {"type": "object", "properties": {
        "id": _STR, "object": {"type": "string", "enum": ["chat.completion"]}, "created": _INT,
        "model": _STR, "usage": {"$ref": "#/components/schemas/Usage"},
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "message": {"type": "object", "properties": {"role": _STR,
                                                                        "content": _STR}},
            "logprobs": {"type": "object", "nullable": True},
            "finish_reason": _NULLABLE_STR}}}}},
    # vLLM's shapes: a prompt as /v1/completions encodes it, or messages as the chat route does.
    "TokenizeRequest": {"oneOf": [
        {"type": "object", "required": ["prompt"], "properties": {
            "model": _STR, "prompt": _STR, "add_special_tokens": _BOOL,
            "return_token_strs": _BOOL}},
        {"type": "object", "required": ["messages"], "properties": {
            "model": _STR, "messages": _MESSAGES, "add_generation_prompt": _BOOL,
            "add_special_tokens": _BOOL, "return_token_strs": _BOOL}}]},
    "TokenizeResponse": {"type": "object", "properties": {
        "count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
        "token_strs": {"type": "array", "items": _STR, "nullable": True}}},
    "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
        "model": _STR, "tokens": {"type": "array", "items": _range("integer", 0)}}},
    "DetokenizeResponse": {"type": "object", "properties": {"prompt": _STR}},
    "ModelList": {"type": "object", "properties": {"object": _STR, "data": {
        "type": "array", "items": {"type": "object", "properties": {
            "id": _STR, "object": _STR, "created": _INT, "owned_by": _STR,
            "max_model_len": _INT}}}}},
    # NOTE: strict, as the server decodes them (api/fault_tolerance.py): no other fields, and
    # params only as each instruction defines them (none so far).
    "FaultToleranceApply": {"type": "object", "required": ["instruction"],
                            "additionalProperties": False, "properties": {
        "instruction": {"type": "string", "enum": ["retry", "reinit"]},
        "params": {"type": "object", "additionalProperties": False, "properties": {}}}},
    "FaultInjection": {"type": "object", "required": ["kind"], "additionalProperties": False,
                       "properties": {
        "kind": {"type": "string", "enum": ["raise", "worker_exit", "hang"]},
        "engine": {"type": "integer", "minimum": 0}}},
    "EngineStatusList": {"type": "object", "properties": {"engines": {
        "type": "array", "items": {"type": "object", "properties": {
            "engine_id": _INT, "state": _STR, "epoch": _INT, "fault_info": _NULLABLE_STR,
            "last_action": _NULLABLE_STR, "last_action_error": _NULLABLE_STR}}}}},
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(summary: str, response: dict[str, Any] | None = None, request: str | None = None,
        content_type: str = "application/json", status: str = "200") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {
        status: {"description": "OK", "content": {content_type: {"schema": response or {}}}},
        "default": {"description": "Error", "content": {"application/json": {
            "schema": _ref("Error")}}}}}
    if request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": _ref(request)}}}
    return op


def _bounded(schemas: dict[str, Any], config: ApiConfig, model_name: str | None
             ) -> dict[str, Any]:
    """The schemas with the request limits of ``config`` and the one model name served."""
    stop_list = {"type": "array", "maxItems": config.max_stop_strings,
                 "items": {"type": "string", "minLength": 1, "maxLength": config.max_stop_len}}
    limits = {"stop": {"oneOf": [stop_list["items"], stop_list]},
              "stop_token_ids": {"type": "array", "maxItems": config.max_stop_token_ids,
                                 "items": {"type": "integer", "minimum": 0}},
              "n": {"type": "integer", "minimum": 1, "maximum": config.max_n}}
    if model_name is not None:
        limits["model"] = {"type": "string", "enum": [model_name]}
    bounded = dict(schemas)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        bounded[name] = {**schemas[name],
                         "properties": {**schemas[name]["properties"], **limits}}
    return bounded


def openapi_document(config: ApiConfig | None = None, model_name: str | None = None
                     ) -> dict[str, Any]:
    stream_note = " (text/event-stream when stream is true)"
    paths = {
        "/v1/models": {"get": _op("List the served model", _ref("ModelList"))},
        "/v1/completions": {"post": _op("Create a completion" + stream_note,
                                        _ref("Completion"), "CompletionRequest")},
        "/v1/chat/completions": {"post": _op("Create a chat completion" + stream_note,
                                             _ref("ChatCompletion"), "ChatCompletionRequest")},
        "/tokenize": {"post": _op("Token ids of a prompt or of chat messages",
                                  _ref("TokenizeResponse"), "TokenizeRequest")},
        "/detokenize": {"post": _op("Text of token ids", _ref("DetokenizeResponse"),
                                    "DetokenizeRequest")},
        "/health": {"get": _op("200 when every engine is healthy, else 503",
                               {"type": "object"})},
        "/version": {"get": _op("Server version", {"type": "object",
                                                   "properties": {"version": _STR}})},
        "/metrics": {"get": _op("Prometheus metrics", _STR, content_type="text/plain")},
        "/openapi.json": {"get": _op("This document", {"type": "object"})},
        "/fault_tolerance/apply": {"post": _op("Start recovery of the data-parallel group",
                                               {"type": "object",
                                                "properties": {"request_id": _STR}},
                                               "FaultToleranceApply", status="202")},
        "/fault_tolerance/status": {"get": _op("Per-engine health",
                                               _ref("EngineStatusList"))},
        "/fault_tolerance/inject": {"post": _op("Inject a fault (--enable-fault-injection)",
                                                {"type": "object"}, "FaultInjection")},
    }
    return {"openapi": "3.0.3",
            "info": {"title": "bastion", "version": __version__,
                     "description": "OpenAI-compatible LLM inference server"},
            "paths": paths,
            "components": {"schemas": _bounded(_SCHEMAS, config or ApiConfig(), model_name),
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
