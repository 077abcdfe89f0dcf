"""``deepseek_r1``: DeepSeek-R1's template opens ``<think>`` in the prompt, so the output is
reasoning up to ``</think>`` (a leading ``<think>`` the model writes anyway is dropped), and
all of it when ``</think>`` never comes."""

from __future__ import annotations

from bastion.api.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
