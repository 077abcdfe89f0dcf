"""``llama3_json``: Llama 3.1-3.3's JSON tool calls, ``{"name": ..., "parameters": {...}}``,
optionally after ``<|python_tag|>``, several separated by ``;``.

Calls count only at the start of the message (after whitespace); a message that starts with
anything else is content throughout, as vLLM's parser has it. ``arguments`` is accepted for
``parameters``.
"""

from __future__ import annotations

from enum import Enum

from bastion.api.tool_parsers.base import ToolParser
from bastion.api.tool_parsers.json_scan import Scan

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class _Mode(Enum):
    START = 0  # nothing but whitespace yet
    CALL = 1
    BETWEEN = 2  # after a call: whitespace, then ";" or the end
    TEXT = 3  # content to the end


class Llama3JsonToolParser(ToolParser):
    arguments_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._mode = _Mode.START
        self._buffer = ""

    def _scan_text(self, delta: str) -> None:
        self._scan_chars(delta)

    def _is_text(self) -> bool:
        return self._mode is _Mode.TEXT

    def _char(self, char: str) -> None:
        if self._mode is _Mode.CALL:
            state = self._feed_call(char)
            if state is Scan.DONE:
                self._mode = _Mode.BETWEEN
            elif state is Scan.ERROR:
                self._mode = _Mode.TEXT
            return
        self._buffer += char
        rest = self._buffer.lstrip()
        if not rest:
            return
        if self._mode is _Mode.BETWEEN:
            if rest == SEPARATOR:
                self._buffer = ""
                self._open_call(SEPARATOR)
                self._mode = _Mode.CALL
            else:  # text after the calls
                self._buffer = ""
                self._mode = _Mode.TEXT
                self._emit_content(rest)
            return
        if rest == PYTHON_TAG:
            self._open_call(self._buffer)
            self._buffer, self._mode = "", _Mode.CALL
        elif rest == "{":
            self._open_call(self._buffer[:-1])
            self._buffer, self._mode = "", _Mode.CALL
            self._char("{")
        elif not PYTHON_TAG.startswith(rest):
            self._emit_content(self._buffer)
            self._buffer, self._mode = "", _Mode.TEXT

    def _end_of_text(self) -> None:
        if self._mode is _Mode.CALL:
            self._end_open_call()
        elif self._mode is _Mode.START:
            self._emit_content(self._buffer)
        self._mode, self._buffer = _Mode.TEXT, ""
