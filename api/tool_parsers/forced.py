"""Parsers for output a grammar forced into tool calls (``tool_choice`` ``required`` or a named
function; api/tools.py builds the schemas).

``required``: a JSON array of ``{"name": ..., "arguments": {...}}`` objects. A named function:
the text is that function's arguments object, sent as it arrives.
"""

from __future__ import annotations

from enum import Enum

from bastion.api.tool_parsers.base import Piece, ToolParser, new_call_id
from bastion.api.tool_parsers.json_scan import Scan


class _Mode(Enum):
    START = 0  # before "["
    ITEM = 1  # before an object (after "[" or ",")
    CALL = 2
    BETWEEN = 3  # after an object: "," or "]"
    TEXT = 4  # not the array the grammar should have forced: content


class RequiredToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = _Mode.START
        self._raw = ""  # the text before the open object, for the fall-back

    def _scan_text(self, delta: str) -> None:
        self._scan_chars(delta)

    def _is_text(self) -> bool:
        return self._mode is _Mode.TEXT

    def _char(self, char: str) -> None:
        mode = self._mode
        if mode is _Mode.CALL:
            state = self._feed_call(char)
            if state is Scan.DONE:
                self._mode = _Mode.BETWEEN
            elif state is Scan.ERROR:
                self._mode = _Mode.TEXT
            return
        self._raw += char
        if char.isspace():
            return
        if mode is _Mode.START and char == "[":
            self._mode = _Mode.ITEM
        elif mode is _Mode.ITEM and char == "{":
            self._open_call(self._raw[:-1])
            self._raw, self._mode = "", _Mode.CALL
            self._feed_call(char)
        elif mode is _Mode.BETWEEN and char == ",":
            self._mode = _Mode.ITEM
        elif mode is _Mode.BETWEEN and char == "]":
            self._raw, self._mode = "", _Mode.TEXT  # nothing may follow; keep what does
        else:
            self._emit_content(self._raw if self._num_calls == 0 else char)
            self._raw, self._mode = "", _Mode.TEXT

    def _end_of_text(self) -> None:
        if self._mode is _Mode.CALL:
            self._end_open_call()
        elif self._mode is not _Mode.TEXT and self._num_calls == 0:
            self._emit_content(self._raw)
        self._mode, self._raw = _Mode.TEXT, ""


class NamedToolParser(ToolParser):
    """All of the text is the arguments of ``name``; whitespace around it is dropped."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._call_id = new_call_id()
        self._is_started = False
        self._held = ""  # trailing whitespace, sent once more text follows

    def _scan_text(self, delta: str) -> None:
        text = self._held + delta
        if not self._is_started:
            text = text.lstrip()
            if not text:
                return
            self._is_started = True
            self._pieces.append(Piece(index=0, call_id=self._call_id, name=self.name))
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            self._pieces.append(Piece(index=0, arguments=body))

    def _end_of_text(self) -> None:
        if not self._is_started:  # an empty answer is still the one forced call
            self._is_started = True
            self._pieces.append(Piece(index=0, call_id=self._call_id, name=self.name))
        self._held = ""
