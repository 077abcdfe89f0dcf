"""Splitting ``<think>…</think>`` reasoning from the answer, streamed or whole.

A parser starts in the answer unless the prompt left a ``<think>`` open (the chat template
opened it) or the parser's model always thinks first (``starts_in_reasoning``). An output that
opens with ``<think>`` enters the reasoning; ``</think>`` leaves it. Whitespace around the
reasoning and between it and the answer is dropped; an answer with no reasoning is passed on
unchanged. The non-streamed ``extract`` feeds the whole text at once, so a streamed answer
always joins to it.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from bastion.api.tool_parsers.base import held_suffix

START_TAG = "<think>"
END_TAG = "</think>"


class Split(NamedTuple):
    reasoning: str
    content: str


class Reasoning(NamedTuple):
    reasoning_content: str | None
    content: str | None


class _Mode(Enum):
    START = 0  # a leading "<think>" may still come
    REASONING = 1
    CONTENT = 2


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends with a ``<think>`` the template opened (not one a
    message merely mentions)."""
    return prompt.rstrip().endswith(START_TAG)


def prompt_closes_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends with a ``</think>``: the template wrote the reasoning
    block itself (empty, when thinking is off) and the answer comes next."""
    return prompt.rstrip().endswith(END_TAG)


class ReasoningParser:
    starts_in_reasoning = False  # the model's template always opens the reasoning

    def __init__(self, prompt: str = "") -> None:
        self._in_reasoning = self.starts_in_reasoning or prompt_opens_reasoning(prompt)
        self._mode = _Mode.START
        self._buffer = ""
        self._is_reasoning_start = True  # drop the whitespace that opens the reasoning
        self._is_content_start = False  # drop the whitespace after "</think>"

    def feed(self, delta: str) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        self._scan(delta, reasoning, content)
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        buffer, self._buffer = self._buffer, ""
        if self._mode is _Mode.START:
            if self._in_reasoning:
                return Split(buffer.strip(), "")
            return Split("", buffer)
        if self._mode is _Mode.REASONING:
            return Split(self._reasoning_text(buffer.rstrip()), "")
        return Split("", "")

    def extract(self, text: str) -> Reasoning:
        first, last = self.feed(text), self.finish()
        return Reasoning(
            first.reasoning + last.reasoning or None, first.content + last.content or None
        )

    def _scan(self, delta: str, reasoning: list[str], content: list[str]) -> None:
        if self._mode is _Mode.CONTENT:
            if self._is_content_start:
                delta = delta.lstrip()
                self._is_content_start = not delta
            if delta:
                content.append(delta)
            return
        self._buffer += delta
        if self._mode is _Mode.START:
            rest = self._buffer.lstrip()
            if rest.startswith(START_TAG):
                self._mode, self._buffer = _Mode.REASONING, rest[len(START_TAG) :]
            elif not rest or START_TAG.startswith(rest):
                return
            else:
                self._mode = _Mode.REASONING if self._in_reasoning else _Mode.CONTENT
                buffer, self._buffer = self._buffer, ""
                self._scan(buffer, reasoning, content)
                return
        end = self._buffer.find(END_TAG)
        if end >= 0:
            reasoning.append(self._reasoning_text(self._buffer[:end].rstrip()))
            rest = self._buffer[end + len(END_TAG) :]
            self._mode, self._buffer, self._is_content_start = _Mode.CONTENT, "", True
            self._scan(rest, reasoning, content)
            return
        hold = held_suffix(self._buffer, END_TAG)
        reasoning.append(self._reasoning_text(self._buffer[:hold]))
        self._buffer = self._buffer[hold:]

    def _reasoning_text(self, text: str) -> str:
        if self._is_reasoning_start:
            text = text.lstrip()
            self._is_reasoning_start = not text
        return text
