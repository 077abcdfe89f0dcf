"""What a chat answer's text becomes: reasoning (``--reasoning-parser``), content and tool
calls (api/tools.py), for one choice, streamed as OpenAI's deltas or whole as its message.

The text flows reasoning parser first, then the tool parser over what is left as content, so a
model that thinks before it calls gets both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from bastion.api.config import ApiConfig
from bastion.api.errors import bad_request
from bastion.api.reasoning import REASONING_PARSERS, ReasoningParser
from bastion.api.reasoning.base import END_TAG, prompt_closes_reasoning
from bastion.api.tool_parsers import Piece, ToolParser
from bastion.api.tools import ToolRequest
from bastion.ipc.messages import SamplingParams


def constrain_after_reasoning(params: SamplingParams, config: ApiConfig, prompt_text: str,
                              tokenizer: Any, param: str = "response_format") -> SamplingParams:
    """Under a reasoning parser, ``params`` whose constraint (response_format,
    structured_outputs, a forced tool choice) applies only after the reasoning, as vLLM's: from
    the first ``</think>`` the model outputs on, or from the first token when the prompt already
    closed the reasoning (a template's empty block, ``enable_thinking: false``). A model whose
    vocabulary has no single ``</think>`` token gets a 400 naming ``param``.

    NOTE: a model that never writes ``</think>`` is never constrained (vLLM alike)."""
    spec = params.structured_outputs
    if spec is None or config.reasoning_parser is None or prompt_closes_reasoning(prompt_text):
        return params
    end_ids = tokenizer.encode(END_TAG, add_special_tokens=False)
    if len(end_ids) != 1:
        raise bad_request(
            f"under --reasoning-parser {config.reasoning_parser} a constraint starts after the "
            f"model's {END_TAG}, which is not one token in this model's vocabulary",
            param,
        )
    return msgspec.structs.replace(
        params, structured_outputs=msgspec.structs.replace(spec, start_after_token_id=end_ids[0])
    )


@dataclass(frozen=True)
class OutputSpec:
    """How one request's choices are parsed (``GenerateRequest.chat_output``)."""

    config: ApiConfig
    tools: ToolRequest | None
    prompt_text: str  # the rendered prompt: a template may open the reasoning in it

    def new_choice(self) -> ChoiceOutput:
        reasoning = None
        if self.config.reasoning_parser is not None:
            reasoning = REASONING_PARSERS[self.config.reasoning_parser](self.prompt_text)
        parser = self.tools.parser(self.config) if self.tools is not None else None
        max_calls = None if self.tools is None or self.tools.is_parallel else 1
        return ChoiceOutput(reasoning, parser, max_calls)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[Piece] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = _delta_tool_calls(self.tool_calls)
        return delta


class ChoiceOutput:
    """One choice's parsers; ``feed`` each text delta, ``finish`` once, or ``message`` for the
    whole text."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls  # parallel_tool_calls false: the first call only
        self.num_calls = 0

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        return self._tool_delta(reasoning, content, is_last=False)

    def finish(self) -> ChatDelta:
        reasoning, content = ("", "") if self.reasoning is None else self.reasoning.finish()
        return self._tool_delta(reasoning, content, is_last=True)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole choice as OpenAI's message, and its finish reason (``tool_calls`` when
        calls end it)."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
        tool_calls = []
        if self.tools is not None and content is not None:
            content, tool_calls = self.tools.extract(content)
            tool_calls = tool_calls[: self.max_calls]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = [call.to_openai() for call in tool_calls]
        return message, self.finish_reason(finish_reason, bool(tool_calls))

    def finish_reason(self, finish_reason: str | None, has_calls: bool | None = None) -> str | None:
        """``stop`` becomes ``tool_calls`` when the answer called tools (``length`` stays: the
        last call may be cut short)."""
        has_calls = self.num_calls > 0 if has_calls is None else has_calls
        return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason

    def _tool_delta(self, reasoning: str, content: str, is_last: bool) -> ChatDelta:
        if self.tools is None:
            return ChatDelta(reasoning, content)
        pieces = self.tools.feed(content) if content else []
        if is_last:
            pieces += self.tools.finish()
        calls = [
            p
            for p in pieces
            if p.is_tool_call and (self.max_calls is None or p.index < self.max_calls)
        ]
        self.num_calls += sum(p.name is not None for p in calls)
        text = "".join(p.content for p in pieces if not p.is_tool_call)
        return ChatDelta(reasoning, text, calls)


def _delta_tool_calls(pieces: list[Piece]) -> list[dict[str, Any]]:
    """OpenAI's ``delta.tool_calls``: per call, its header (index, id, type, name) once, then
    ``function.arguments`` fragments; the pieces of one call in one delta are merged."""
    entries: list[dict[str, Any]] = []
    for piece in pieces:
        if entries and entries[-1]["index"] == piece.index:
            entries[-1]["function"]["arguments"] += piece.arguments
            continue
        entry: dict[str, Any] = {"index": piece.index}
        if piece.name is not None:
            entry.update(id=piece.call_id, type="function")
            entry["function"] = {"name": piece.name, "arguments": piece.arguments}
        else:
            entry["function"] = {"arguments": piece.arguments}
        entries.append(entry)
    return entries
