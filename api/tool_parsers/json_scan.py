"""An incremental JSON scanner for one tool-call object (``{"name": ..., "arguments": {...}}``).

Fed a character at a time, it checks that what it has seen is a valid prefix of JSON and
records, for the top-level object, the decoded ``name`` and where the arguments value starts
and ends, so a streamed parser can send the name as soon as it is complete and the arguments as
raw text while they arrive. The raw text is what both the streamed and the non-streamed answers
carry, so their arguments are equal by construction.
"""

from __future__ import annotations

import json
import re
from enum import Enum

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_WHITESPACE = frozenset(" \t\n\r")


class Scan(Enum):
    OPEN = 0  # a valid prefix; more text may follow
    DONE = 1  # the top-level object closed and is valid
    ERROR = 2  # not JSON, or not an object with a string name and an object of arguments


class _Expect(Enum):
    KEY = 0  # in an object, after "{" or ","
    KEY_OR_END = 1  # just after "{"
    COLON = 2
    VALUE = 3
    VALUE_OR_END = 4  # just after "["
    COMMA_OR_END = 5


class CallScanner:
    """Scans one JSON object; ``arguments_keys`` name the key holding the arguments.

    NOTE: offsets are relative to the first character fed (the object's ``{``).
    """

    def __init__(self, arguments_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.arguments_keys = arguments_keys
        self.state = Scan.OPEN
        self.name: str | None = None
        self.arguments_start: int | None = None
        self.arguments_end: int | None = None  # exclusive
        self._text: list[str] = []
        self._stack: list[str] = []  # "{" or "["
        self._expect = _Expect.VALUE
        self._in_string = False
        self._escape = 0  # 0: none; 1: after a backslash; 2..5: hex digits of \\u left + 1
        self._token_start = 0  # of the string or scalar being read
        self._scalar: list[str] = []
        self._key: str | None = None  # the top-level key whose value comes next
        self._value_key: str | None = None  # the top-level key whose value is being read

    @property
    def pos(self) -> int:
        return len(self._text)

    @property
    def text(self) -> str:
        return "".join(self._text)

    def feed(self, char: str) -> Scan:
        if self.state is not Scan.OPEN:
            return self.state
        self._text.append(char)
        if not self._step(char):
            self.state = Scan.ERROR
        return self.state

    def arguments_text(self, begin: int = 0, upto: int | None = None) -> str:
        """The arguments' raw text seen so far (all of it once the value has closed), from
        its ``begin``-th character, and before the scanner offset ``upto``."""
        if self.arguments_start is None:
            return ""
        end = self.pos if self.arguments_end is None else self.arguments_end
        if upto is not None:
            end = min(end, upto)
        return "".join(self._text[self.arguments_start + begin : end])

    # ------------------------------------------------------------------------------ internals

    def _step(self, char: str) -> bool:
        if self._in_string:
            return self._string_char(char)
        if self._scalar:
            if char in _SCALAR_CHARS:
                self._scalar.append(char)
                return self._scalar_prefix_ok()
            if not self._end_scalar():
                return False
        if char in _WHITESPACE:
            return True
        expect = self._expect
        if expect in (_Expect.VALUE, _Expect.VALUE_OR_END):
            if char == "]" and expect is _Expect.VALUE_OR_END:
                return self._close("[")
            return self._start_value(char)
        if expect in (_Expect.KEY, _Expect.KEY_OR_END):
            if char == "}" and expect is _Expect.KEY_OR_END:
                return self._close("{")
            if char != '"':
                return False
            self._in_string, self._token_start = True, self.pos - 1
            return True
        if expect is _Expect.COLON:
            if char != ":":
                return False
            self._expect = _Expect.VALUE
            return True
        # COMMA_OR_END
        if char == ",":
            self._expect = _Expect.KEY if self._stack[-1] == "{" else _Expect.VALUE
            return True
        if char in "}]":
            return self._close("{" if char == "}" else "[")
        return False

    def _start_value(self, char: str) -> bool:
        if not self._stack and char != "{":
            return False  # a tool call is an object
        at_top = len(self._stack) == 1
        if at_top:
            self._value_key, self._key = self._key, None
            if self._value_key in self.arguments_keys and self.arguments_start is None:
                if char != "{":
                    return False  # arguments must be an object
                self.arguments_start = self.pos - 1
        if char in "{[":
            self._stack.append(char)
            self._expect = _Expect.KEY_OR_END if char == "{" else _Expect.VALUE_OR_END
            return True
        if char == '"':
            self._in_string, self._token_start = True, self.pos - 1
            return True
        if char in _SCALAR_CHARS:
            self._scalar, self._token_start = [char], self.pos - 1
            return self._scalar_prefix_ok()
        return False

    def _string_char(self, char: str) -> bool:
        if self._escape == 1:
            if char not in _ESCAPES:
                return False
            self._escape = 5 if char == "u" else 0
            return True
        if self._escape > 1:
            if char not in _HEX:
                return False
            self._escape = 0 if self._escape == 2 else self._escape - 1
            return True
        if char == "\\":
            self._escape = 1
            return True
        if ord(char) < 0x20:
            return False
        if char != '"':
            return True
        self._in_string = False
        raw = "".join(self._text[self._token_start :])
        if self._expect in (_Expect.KEY, _Expect.KEY_OR_END):
            if len(self._stack) == 1:
                self._key = json.loads(raw)
            self._expect = _Expect.COLON
            return True
        return self._end_value(raw)

    def _scalar_prefix_ok(self) -> bool:
        token = "".join(self._scalar)
        if token[0] in "tfn":
            return any(lit.startswith(token) for lit in _LITERALS)
        return all(c in "0123456789+-.eE" for c in token)

    def _end_scalar(self) -> bool:
        token = "".join(self._scalar)
        self._scalar = []
        if token not in _LITERALS and not _NUMBER.fullmatch(token):
            return False
        return self._end_value(token)

    def _end_value(self, raw: str) -> bool:
        """A string or scalar value closed."""
        if len(self._stack) == 1 and self._value_key == "name" and self.name is None:
            if not raw.startswith('"'):
                return False  # the name must be a string
            self.name = json.loads(raw)
        self._expect = _Expect.COMMA_OR_END
        return True

    def _close(self, opener: str) -> bool:
        if not self._stack or self._stack[-1] != opener:
            return False
        self._stack.pop()
        self._expect = _Expect.COMMA_OR_END
        if (
            len(self._stack) == 1
            and self._value_key in self.arguments_keys
            and self.arguments_end is None
            and self.arguments_start is not None
        ):
            self.arguments_end = self.pos
        if self._stack:
            return True
        # NOTE: the top-level object closed. json.loads re-checks what the scanner accepted,
        # so a gap in the scanner can never turn invalid JSON into a tool call.
        try:
            json.loads(self.text)
        except ValueError:
            return False
        if self.name is None:
            return False
        self.state = Scan.DONE
        return True
