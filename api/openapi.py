"""``GET /openapi.json``: an OpenAPI 3.1 document generated from the request and response types
of api/schemas.py (JSON Schema 2020-12, which msgspec writes), with the server's own limits."""

from __future__ import annotations

from typing import Any

import msgspec

from bastion import __version__
from bastion.api import schemas
from bastion.api.config import ApiConfig

_TYPES = (
    schemas.CompletionRequest, schemas.Completion, schemas.ChatCompletionRequest,
    schemas.ChatCompletion, schemas.TokenizeRequest, schemas.TokenizeResponse,
    schemas.DetokenizeRequest, schemas.DetokenizeResponse, schemas.ModelList,
    schemas.ErrorResponse, schemas.Health, schemas.Version, schemas.FaultToleranceApply,
    schemas.FaultToleranceAccepted, schemas.FaultInjection, schemas.EngineStatusList,
    schemas.LoadLoRAAdapter, schemas.UnloadLoRAAdapter,
)
_BEARER = [{"bearer": []}]
_TIMEOUT_HEADER = {"name": "X-Request-Timeout", "in": "header", "required": False,
                   "description": "seconds until the request's deadline (the body's timeout)",
                   "schema": {"type": "number", "exclusiveMinimum": 0}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(summary: str, response: dict[str, Any], request: str | None = None, *,
        content_type: str = "application/json", status: str = "200", stream: bool = False,
        secured: bool = False) -> dict[str, Any]:
    content = {content_type: {"schema": response}}
    if stream:  # "stream": true answers with server-sent events
        content["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {"summary": summary, "responses": {
        status: {"description": "OK", "content": content},
        "default": {"description": "Error (OpenAI's shape)",
                    "content": {"application/json": {"schema": _ref("ErrorResponse")}}}}}
    if request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": _ref(request)}}}
    if stream:
        op["parameters"] = [_TIMEOUT_HEADER]
    if secured:
        op["security"] = _BEARER
    return op


def _bounded(components: dict[str, Any], config: ApiConfig, model_name: str | None) -> None:
    """The request limits of ``config`` and the one model name served, in place."""
    stop = {"type": "string", "minLength": 1, "maxLength": config.max_stop_len}
    limits: dict[str, Any] = {
        "stop": {"anyOf": [stop, {"type": "array", "maxItems": config.max_stop_strings,
                                  "items": stop}, {"type": "null"}]},
        "stop_token_ids": {"anyOf": [{"type": "array", "maxItems": config.max_stop_token_ids,
                                      "items": {"type": "integer", "minimum": 0}},
                                     {"type": "null"}]},
        "n": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": config.max_n},
                        {"type": "null"}]},
    }
    if model_name is not None:
        limits["model"] = {"anyOf": [{"enum": [model_name]}, {"type": "null"}]}
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest",
                 "DetokenizeRequest"):
        properties = components[name]["properties"]
        properties.update({k: v for k, v in limits.items() if k in properties})


def openapi_document(config: ApiConfig | None = None, model_name: str | None = None
                     ) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        _TYPES, ref_template="#/components/schemas/{name}")
    _bounded(components, config or ApiConfig(), model_name)
    paths = {
        "/v1/models": {"get": _op("List the served model", _ref("ModelList"), secured=True)},
        "/v1/completions": {"post": _op("Create a completion", _ref("Completion"),
                                        "CompletionRequest", stream=True, secured=True)},
        "/v1/chat/completions": {"post": _op("Create a chat completion", _ref("ChatCompletion"),
                                             "ChatCompletionRequest", stream=True,
                                             secured=True)},
        "/tokenize": {"post": _op("Token ids of a prompt or of chat messages",
                                  _ref("TokenizeResponse"), "TokenizeRequest", secured=True)},
        "/detokenize": {"post": _op("Text of token ids", _ref("DetokenizeResponse"),
                                    "DetokenizeRequest", secured=True)},
        "/health": {"get": _op("200 when every engine is healthy, else 503", _ref("Health"))},
        "/version": {"get": _op("Server version", _ref("Version"))},
        "/metrics": {"get": _op("Prometheus metrics", {"type": "string"},
                                content_type="text/plain")},
        "/openapi.json": {"get": _op("This document", {"type": "object"})},
        "/fault_tolerance/apply": {"post": _op("Start recovery of the data-parallel group",
                                               _ref("FaultToleranceAccepted"),
                                               "FaultToleranceApply", status="202",
                                               secured=True)},
        "/fault_tolerance/status": {"get": _op("Per-engine health", _ref("EngineStatusList"),
                                               secured=True)},
        "/fault_tolerance/inject": {"post": _op("Inject a fault (--enable-fault-injection)",
                                                {"type": "object"}, "FaultInjection",
                                                secured=True)},
        "/v1/load_lora_adapter": {"post": _op("Load a LoRA adapter (--enable-lora, admin key)",
                                              {"type": "string"}, "LoadLoRAAdapter",
                                              content_type="text/plain", secured=True)},
        "/v1/unload_lora_adapter": {"post": _op("Unload a LoRA adapter (admin key)",
                                                {"type": "string"}, "UnloadLoRAAdapter",
                                                content_type="text/plain", secured=True)},
    }
    return {"openapi": "3.1.0",
            "info": {"title": "bastion", "version": __version__,
                     "description": "OpenAI-compatible LLM inference server"},
            "paths": paths,
            "components": {"schemas": components,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
