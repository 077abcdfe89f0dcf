"""``qwen3``: Qwen3's ``<think>…</think>``. The model opens the block itself; an answer
without it has no reasoning (``enable_thinking: false`` renders an empty block into the
prompt), unless the template left a ``<think>`` open at the end of the prompt
(Qwen3-2507's thinking models)."""

from __future__ import annotations

from bastion.api.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False
