"""What every tool-call parser shares: the pieces it emits and the one code path that serves
both the streamed and the non-streamed answer.

A parser is fed the model's text in deltas and returns ``Piece``s: plain content, or a part of a
tool call (its header, index, id and name, first; then fragments of its arguments). The
non-streamed ``extract`` feeds the whole text at once and joins the pieces, so a streamed answer
joins to exactly the non-streamed one whenever the parser did not have to change its mind (see
``ToolParser``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from bastion.api.tool_parsers.json_scan import CallScanner, Scan


@dataclass
class Piece:
    """One output piece: ``content`` text, or for the tool call ``index``, its header
    (``name`` and ``call_id`` set, sent once) or an ``arguments`` fragment."""

    content: str = ""
    index: int | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""

    @property
    def is_tool_call(self) -> bool:
        return self.index is not None


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: str  # the model's raw JSON text

    def to_openai(self) -> dict:
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class Extracted(NamedTuple):
    content: str | None  # None when the text held only tool calls
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_suffix(text: str, tag: str) -> int:
    """Where the part of ``text`` that must wait begins: a trailing prefix of ``tag`` and the
    whitespace before it (dropped if the tag does follow)."""
    hold = len(text)
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            hold = len(text) - size
            break
    return len(text[:hold].rstrip())


def join_pieces(pieces: list[Piece]) -> Extracted:
    """The pieces of one answer joined into its content and tool calls."""
    content = "".join(p.content for p in pieces if not p.is_tool_call)
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        if not piece.is_tool_call:
            continue
        if piece.name is not None:
            calls[piece.index] = ToolCall(piece.call_id, piece.name, "")
        calls[piece.index].arguments += piece.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    return Extracted(content if content or not tool_calls else None, tool_calls)


@dataclass
class _OpenCall:
    """A call being scanned: its raw text (for the fall-back to content) and what was sent."""

    scanner: CallScanner
    raw_prefix: str  # the text before the object that belongs to the call (a start tag)
    index: int
    call_id: str = field(default_factory=new_call_id)
    is_started: bool = False  # the header went out
    num_arguments_sent: int = 0


class ToolParser:
    """Splits model text into content and tool calls, streamed or not.

    Subclasses say where calls start and end (``_scan_text``); this class scans each call's
    JSON with a ``CallScanner`` and decides what to send. A call's pieces are sent at the end
    of each ``feed``, never before the scanner has seen everything fed so far, so a call that
    turns out malformed before any of it was sent falls back to plain content, exactly as
    ``extract`` does with the whole text.

    NOTE: the streamed answer can only differ from ``extract`` for a call that breaks after
    its header went out (cut off by ``max_tokens``, or invalid JSON after the name): the
    stream has sent the name and the valid part of the arguments; ``extract`` returns that
    call's text as content.
    """

    arguments_keys: tuple[str, ...] = ("arguments",)

    def __init__(self) -> None:
        self._pieces: list[Piece] = []
        self._call: _OpenCall | None = None
        self._num_calls = 0

    # ---------------------------------------------------------------------------- interface

    def feed(self, delta: str) -> list[Piece]:
        """The pieces ``delta`` completes (content, call headers, argument fragments)."""
        self._scan_text(delta)
        self._flush_call()
        return self._take()

    def finish(self) -> list[Piece]:
        """The pieces held back until the end (a possible tag's prefix, an unfinished call)."""
        self._end_of_text()
        return self._take()

    def extract(self, text: str) -> Extracted:
        """The whole answer at once: its content and tool calls."""
        # NOTE: no flush between the two: a call the text leaves unfinished has sent
        # nothing, so it falls back to content.
        self._scan_text(text)
        self._end_of_text()
        return join_pieces(self._take())

    # ----------------------------------------------------------------- for the subclasses

    def _scan_text(self, delta: str) -> None:
        raise NotImplementedError

    def _end_of_text(self) -> None:
        raise NotImplementedError

    def _scan_chars(self, delta: str) -> None:
        """``_scan_text`` for parsers that read one character at a time (``_char``) until
        their state says the rest is plain text (``_is_text``)."""
        for i, char in enumerate(delta):
            if self._is_text():
                self._emit_content(delta[i:])
                return
            self._char(char)

    def _is_text(self) -> bool:
        raise NotImplementedError

    def _char(self, char: str) -> None:
        raise NotImplementedError

    def _emit_content(self, text: str) -> None:
        if text:
            self._pieces.append(Piece(content=text))

    def _open_call(self, raw_prefix: str) -> None:
        self._call = _OpenCall(CallScanner(self.arguments_keys), raw_prefix, self._num_calls)

    def _feed_call(self, char: str) -> Scan:
        """One character of the open call's object; on DONE the call is sent and closed, on
        ERROR it falls back to content (``_broken_call``)."""
        call = self._call
        state = call.scanner.feed(char)
        if state is Scan.DONE:
            self._flush_call()
            self._call = None
        elif state is Scan.ERROR:
            self._broken_call()
        return state

    def _end_open_call(self) -> None:
        """The text ended inside a call: one that sent nothing yet falls back to content."""
        call, self._call = self._call, None
        if call is not None and not call.is_started:
            self._emit_content(call.raw_prefix + call.scanner.text)

    def _broken_call(self) -> None:
        """The open call cannot be a tool call: before any of it went out its text becomes
        content; after, it keeps the valid part of its arguments, and the text from the
        character that broke it becomes content."""
        call, self._call = self._call, None
        scanner = call.scanner
        if not call.is_started:
            self._emit_content(call.raw_prefix + scanner.text)
            return
        self._send_arguments(call, scanner.arguments_text(call.num_arguments_sent, scanner.pos - 1))
        self._emit_content(scanner.text[scanner.pos - 1 :])

    def _flush_call(self) -> None:
        call = self._call
        if call is None or call.scanner.name is None:
            return
        scanner = call.scanner
        if not call.is_started:
            call.is_started = True
            self._num_calls += 1
            self._pieces.append(Piece(index=call.index, call_id=call.call_id, name=scanner.name))
        # NOTE: only the part not yet sent is joined: a long call streamed token by token
        # would otherwise cost the square of its length.
        fragment = scanner.arguments_text(call.num_arguments_sent)
        if scanner.state is Scan.DONE and scanner.arguments_start is None:
            fragment = "{}"  # a call without arguments
        self._send_arguments(call, fragment)

    def _send_arguments(self, call: _OpenCall, fragment: str) -> None:
        if fragment:
            self._pieces.append(Piece(index=call.index, arguments=fragment))
            call.num_arguments_sent += len(fragment)

    def _take(self) -> list[Piece]:
        pieces, self._pieces = self._pieces, []
        return pieces
