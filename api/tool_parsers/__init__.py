"""Tool-call parsers by name (``--tool-call-parser``): each turns model text, streamed or whole,
into content and OpenAI tool calls (base.py says how)."""

from __future__ import annotations

from bastion.api.tool_parsers.base import Extracted, Piece, ToolCall, ToolParser, join_pieces
from bastion.api.tool_parsers.forced import NamedToolParser, RequiredToolParser
from bastion.api.tool_parsers.hermes import HermesToolParser
from bastion.api.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "Extracted",
    "NamedToolParser",
    "Piece",
    "RequiredToolParser",
    "ToolCall",
    "ToolParser",
    "join_pieces",
]
