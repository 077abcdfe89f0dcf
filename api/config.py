"""The API server's config and the keys under which the app keeps its shared objects."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


class ApiConfigError(ValueError):
    """An API config that cannot work; the message says what would be accepted."""


@dataclass(frozen=True)
class ApiConfig:
    """``bastion serve``'s HTTP flags, one to one (``--api-key`` -> ``api_key``).

    ``admin_key`` guards ``/fault_tolerance/*``; when unset those routes fall back to
    ``api_key`` (and are open only when neither is set).
    """

    host: str = "127.0.0.1"  # NOTE: loopback by default; exposing the server is a choice
    port: int = 8000
    api_key: str | None = None
    admin_key: str | None = None
    served_model_name: str | None = None  # None: the engine client's model_name
    model_aliases: tuple[str, ...] = ()  # other names clients may send as ``model``
    metrics_prefix: str = "bastion"  # vllm: /metrics in vLLM's names, for its dashboards
    # Sampling defaults for what a request leaves out (--generation-config).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 16
    max_logprobs: int = 20
    max_num_prompts: int = 64  # prompts in one batched /v1/completions request
    # Stop strings per request and characters per stop string (README: "Limits").
    max_stop_strings: int = 64
    max_stop_len: int = 256
    max_stop_token_ids: int = 1024
    enable_fault_injection: bool = False
    enable_lora: bool = False  # /v1/load_lora_adapter and adapters as ``model`` names
    # HTTP hygiene (README: "Connections"); 0 disables a timeout.
    http_header_timeout_s: float = 10.0
    http_idle_timeout_s: float = 60.0
    max_connections: int = 1000
    # Tool calling and reasoning output (api/tools.py, api/reasoning/), vLLM's flags.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ApiConfigError(f"port must be in [0, 65535]; got {self.port}")
        if self.max_body_bytes < 1024:
            raise ApiConfigError(f"max_body_bytes must be at least 1024; got {self.max_body_bytes}")
        if self.max_n < 1:
            raise ApiConfigError(f"max_n must be at least 1; got {self.max_n}")
        if not 0 <= self.max_logprobs <= 20:
            raise ApiConfigError(f"max_logprobs must be in [0, 20]; got {self.max_logprobs}")
        if self.max_num_prompts < 1:
            raise ApiConfigError(f"max_num_prompts must be at least 1; got {self.max_num_prompts}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ApiConfigError("metrics_prefix must be a Prometheus name such as bastion or "
                                 f"vllm; got {self.metrics_prefix!r}")
        for name in ("max_stop_strings", "max_stop_len", "max_stop_token_ids",
                     "max_connections"):
            if getattr(self, name) < 1:
                raise ApiConfigError(f"{name} must be at least 1; got {getattr(self, name)}")
        for name in ("http_header_timeout_s", "http_idle_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ApiConfigError(f"{name} must be >= 0 (0: no timeout); got "
                                     f"{getattr(self, name)}")
        _check_output_parsers(self)
        for name in ("api_key", "admin_key"):
            if getattr(self, name) == "":
                raise ApiConfigError(f"{name} must not be empty (leave it unset to disable it)")


def _check_output_parsers(config: ApiConfig) -> None:
    from bastion.api.reasoning import REASONING_PARSERS
    from bastion.api.tool_parsers import TOOL_PARSERS

    if config.tool_call_parser is not None and config.tool_call_parser not in TOOL_PARSERS:
        raise ApiConfigError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; got "
                             f"{config.tool_call_parser!r}")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ApiConfigError("--enable-auto-tool-choice requires --tool-call-parser "
                             f"({' or '.join(TOOL_PARSERS)})")
    if config.reasoning_parser is not None and config.reasoning_parser not in REASONING_PARSERS:
        raise ApiConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {config.reasoning_parser!r}")


CONFIG_KEY = web.AppKey("bastion_config", ApiConfig)
CLIENT_KEY = web.AppKey("bastion_client", object)  # an EngineClient
METRICS_KEY = web.AppKey("bastion_metrics", object)  # an api.metrics.ApiMetrics
FT_HANDLER_KEY = web.AppKey("bastion_ft_handler", object)  # a FaultToleranceHandler or None
MODEL_NAME_KEY = web.AppKey("bastion_model_name", str)  # the name answers carry as ``model``
MODEL_NAMES_KEY = web.AppKey("bastion_model_names", tuple)  # every name a client may send


@dataclass
class ServerState:
    """Run-time state the launcher changes while serving (aiohttp freezes the app's own mapping
    once it starts). ``is_draining``: SIGTERM arrived; new requests get 503, in-flight ones end."""

    is_draining: bool = False


STATE_KEY = web.AppKey("bastion_state", ServerState)
