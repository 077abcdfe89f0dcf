"""Reasoning parsers by name (``--reasoning-parser``): they move ``<think>…</think>`` out of
the answer into ``reasoning_content`` (base.py says how)."""

from __future__ import annotations

from bastion.api.reasoning.base import Reasoning, ReasoningParser, Split
from bastion.api.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from bastion.api.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "Reasoning", "ReasoningParser", "Split"]
