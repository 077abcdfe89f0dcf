"""Tool calling for ``/v1/chat/completions``: the ``tools``, ``tool_choice`` and
``parallel_tool_calls`` fields, the messages that carry calls and their results, and the
grammar that forces ``required`` and named calls.

``auto`` parses the model's text with ``--tool-call-parser`` (needs
``--enable-auto-tool-choice``, as vLLM); ``required`` and a named function set
``SamplingParams.structured_outputs.json`` to a schema built from the tools, so the arguments
always parse and match the function's parameters; ``none`` passes the tools to the template
(vLLM's default) and parses nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from bastion.api.config import ApiConfig
from bastion.api.errors import bad_request
from bastion.api.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolParser
from bastion.ipc.messages import SamplingParams, StructuredOutputsParams

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A request's validated tools. ``choice``: none, auto, required or named (``name`` set)."""

    tools: list[dict[str, Any]]  # as the chat template gets them (OpenAI's shape)
    choice: str
    name: str | None = None
    is_parallel: bool = True

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "named")

    def parser(self, config: ApiConfig) -> ToolParser | None:
        """A fresh parser for one choice's text, or None when the text stays content."""
        if self.choice == "named":
            return NamedToolParser(self.name)
        if self.choice == "required":
            return RequiredToolParser()
        if self.choice == "auto":
            return TOOL_PARSERS[config.tool_call_parser]()
        return None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if not self.is_forced:
            return None
        return StructuredOutputsParams(json=json.dumps(forced_schema(self)))


def structured_outputs_available() -> bool:
    """Whether the engine honours ``SamplingParams.structured_outputs``.

    NOTE: the engine's constrained decoding (issue #21, package ``core/structured_output``) is
    built on another branch; until it is here, a forced tool call would be ignored, so it is
    refused instead. This is the only place that knows."""
    return importlib.util.find_spec("bastion.core.structured_output") is not None


def parse_tools(body: dict, config: ApiConfig) -> ToolRequest | None:
    """The request's tool fields, checked as OpenAI and vLLM check them; None without tools."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    is_parallel = body.get("parallel_tool_calls", True)
    if is_parallel is None:
        is_parallel = True
    if not isinstance(is_parallel, bool):
        raise bad_request(
            f"parallel_tool_calls must be true or false, got {is_parallel!r}", "parallel_tool_calls"
        )
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or (tools == [] and choice in _CHOICES):
        # OpenAI: an empty list of tools behaves as none, ``required`` included.
        return ToolRequest(tools, "none", is_parallel=is_parallel) if tools else None
    if not tools:
        raise bad_request(
            "tool_choice needs tools: send the functions the model may call in tools", "tool_choice"
        )
    name = None
    if isinstance(choice, dict):
        name = _named_choice(choice, tools)
        choice = "named"
    elif choice not in _CHOICES:
        raise bad_request(
            f"tool_choice must be none, auto, required or "
            f'{{"type": "function", "function": {{"name": ...}}}}; got {choice!r}',
            "tool_choice",
        )
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
            "tool_choice",
        )
    request = ToolRequest(tools, choice, name, is_parallel)
    if request.is_forced and not structured_outputs_available():
        raise bad_request(
            f"tool_choice {_choice_text(request)} needs structured outputs, "
            "which this server does not implement yet; use auto",
            "tool_choice",
        )
    return request


def with_tool_constraint(params: SamplingParams, request: ToolRequest | None) -> SamplingParams:
    """``params`` with the grammar a forced tool choice needs (unchanged otherwise)."""
    constraint = request.structured_outputs() if request is not None else None
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise bad_request(
            f"tool_choice {_choice_text(request)} already constrains the output; "
            "it cannot be combined with response_format or structured_outputs",
            "tool_choice",
        )
    return msgspec.structs.replace(params, structured_outputs=constraint)


def _choice_text(request: ToolRequest) -> str:
    return f"naming {request.name!r}" if request.choice == "named" else repr(request.choice)


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools must be a list of tool objects", "tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"tools may hold at most {MAX_TOOLS} tools, got {len(value)}", "tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        tools.append(_tool(tool, i))
        name = tools[-1]["function"]["name"]
        if name in names:
            raise bad_request(f"tools[{i}]: the function name {name!r} is used twice", "tools")
        names.add(name)
    return tools


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(
            f'{where} must be {{"type": "function", "function": {{...}}}}; only '
            "function tools are supported",
            "tools",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object with name and parameters", "tools")
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise bad_request(
            f"{where}.function has unknown fields: {', '.join(sorted(unknown))}", "tools"
        )
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"{where}.function.name must be 1-64 letters, digits, _ or -; got {name!r}", "tools"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict must be true or false", "tools")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_schema(parameters, f"{where}.function.parameters")
    return {"type": "function", "function": function}


def _check_schema(schema: Any, where: str) -> None:
    import jsonschema

    if not isinstance(schema, dict) or not isinstance(schema.get("$schema", ""), str):
        raise bad_request(f"{where} must be a JSON schema object", "tools")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.path)
        raise bad_request(
            f"{where} is not a valid JSON schema: {exc.message} (at {path or 'the top'})",
            "tools",
        ) from None
    except RecursionError:
        raise bad_request(f"{where} is nested too deeply", "tools") from None


def _named_choice(choice: dict, tools: list[dict[str, Any]]) -> str:
    usage = 'use {"type": "function", "function": {"name": "my_function"}}'
    function = choice.get("function")
    if (
        choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise bad_request(f"tool_choice as an object must name a function: {usage}", "tool_choice")
    name = function["name"]
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
        )
    return name


# ---------------------------------------------------------------------------- forced schemas


def forced_schema(request: ToolRequest) -> dict[str, Any]:
    """The JSON schema the output must match: the named function's parameters, or (required)
    an array of one or more ``{"name", "arguments"}`` objects, one shape per tool, as vLLM
    builds it; at most one item without ``parallel_tool_calls``."""
    functions = {t["function"]["name"]: t["function"] for t in request.tools}
    if request.choice == "named":
        return _parameters(functions[request.name])
    defs: dict[str, Any] = {}
    shapes = []
    for name, function in functions.items():
        parameters = _parameters(function)
        _hoist_defs(parameters, defs, name)
        shapes.append(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {"name": {"type": "string", "enum": [name]}, "arguments": parameters},
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": shapes[0] if len(shapes) == 1 else {"anyOf": shapes},
    }
    if not request.is_parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if parameters is None:
        return {"type": "object", "properties": {}}
    return copy.deepcopy(parameters)


def _hoist_defs(parameters: dict[str, Any], defs: dict[str, Any], name: str) -> None:
    """``#/$defs/X`` refers to the document's root: a tool's ``$defs`` move up to the array's
    schema, where its references still find them."""
    if "definitions" in parameters:
        raise bad_request(
            f"the parameters of {name!r} keep subschemas in 'definitions'; with "
            "tool_choice required put them in '$defs'",
            "tools",
        )
    for def_name, definition in parameters.pop("$defs", {}).items():
        if def_name in defs and defs[def_name] != definition:
            raise bad_request(
                f"two tools define $defs/{def_name} differently; rename one to "
                "use tool_choice required",
                "tools",
            )
        defs[def_name] = definition


# ---------------------------------------------------------------------------- chat messages


def tool_message_fields(message: dict, i: int, role: str) -> dict[str, Any]:
    """The tool-calling fields of ``messages[i]`` as the chat template expects them:
    an assistant's ``tool_calls`` (arguments decoded to objects, as vLLM passes them) and a
    tool result's ``tool_call_id``."""
    fields: dict[str, Any] = {}
    if role == "assistant" and message.get("tool_calls") is not None:
        fields["tool_calls"] = [
            _history_call(call, i, k) for k, call in enumerate(_list(message["tool_calls"], i))
        ]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(
                f"messages[{i}] (role tool) needs tool_call_id, the id of the call it answers",
                "messages",
            )
        fields["tool_call_id"] = call_id
    elif "tool_call_id" in message:
        raise bad_request(
            f"messages[{i}].tool_call_id belongs to role tool messages only", "messages"
        )
    if role != "assistant" and "tool_calls" in message:
        raise bad_request(
            f"messages[{i}].tool_calls belongs to assistant messages only", "messages"
        )
    return fields


def _list(value: Any, i: int) -> list:
    if not isinstance(value, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list of tool calls", "messages")
    return value


def _history_call(call: Any, i: int, k: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{k}]"
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(function, dict)
        or call.get("type", "function") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise bad_request(
            f'{where} must be {{"id": ..., "type": "function", "function": '
            '{"name": ..., "arguments": "<JSON text>"}}',
            "messages",
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise bad_request(
                f"{where}.function.arguments must be JSON text, got {function['arguments']!r}",
                "messages",
            ) from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must hold a JSON object", "messages")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
