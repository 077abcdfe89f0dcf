"""``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the
format of the Hermes, Qwen2.5 and Qwen3 chat templates (and of bastion's SmolLM2 tool template).

Text outside the tags is content; whitespace next to a call is dropped, so a message of two
calls on their own lines has no content. A last call whose closing tag never came (the model
stopped after the object) still counts.
"""

from __future__ import annotations

from enum import Enum

from bastion.api.tool_parsers.base import ToolParser, held_suffix
from bastion.api.tool_parsers.json_scan import Scan

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"


class _Mode(Enum):
    TEXT = 0
    CALL = 1  # inside the tags, scanning the object
    AFTER_CALL = 2  # the object closed; waiting for the end tag


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = _Mode.TEXT
        self._buffer = ""  # text not yet decided (a possible tag, whitespace)
        self._is_after_call = False  # drop the whitespace that follows a call

    def _scan_text(self, delta: str) -> None:
        if self._mode is _Mode.TEXT and "<" not in delta and "<" not in self._buffer:
            # Plain text, most answers: what a character at a time would do, at once.
            text = self._buffer + delta
            body = text.rstrip()
            self._content(body)
            self._buffer = text[len(body) :]
            return
        for char in delta:
            self._char(char)

    def _char(self, char: str) -> None:
        if self._mode is _Mode.CALL:
            state = self._feed_call(char)
            if state is Scan.DONE:
                self._mode = _Mode.AFTER_CALL
            elif state is Scan.ERROR:
                self._mode = _Mode.TEXT
            return
        self._buffer += char
        if self._mode is _Mode.AFTER_CALL:
            rest = self._buffer.lstrip()
            if rest == END_TAG:
                self._mode, self._buffer, self._is_after_call = _Mode.TEXT, "", True
            elif not END_TAG.startswith(rest):
                # Not the end tag: what follows the object is text again.
                self._mode, self._buffer, self._is_after_call = _Mode.TEXT, "", True
                self._scan_text(rest)
            return
        start = self._buffer.find(START_TAG)
        if start >= 0:
            before = self._buffer[:start].rstrip()
            # The whitespace before the tag goes with the call: dropped if it is one, kept
            # if it falls back to content.
            self._content(before)
            self._open_call(self._buffer[len(before) : start] + START_TAG)
            self._buffer = ""
            self._mode = _Mode.CALL
            return
        hold = held_suffix(self._buffer, START_TAG)
        self._content(self._buffer[:hold])
        self._buffer = self._buffer[hold:]

    def _content(self, text: str) -> None:
        if self._is_after_call:
            text = text.lstrip()
        if text:
            self._is_after_call = False
            self._emit_content(text)

    def _end_of_text(self) -> None:
        if self._mode is _Mode.CALL:
            self._end_open_call()
        elif self._mode is _Mode.TEXT:
            self._content(self._buffer.rstrip() if self._num_calls else self._buffer)
        self._mode, self._buffer = _Mode.TEXT, ""
