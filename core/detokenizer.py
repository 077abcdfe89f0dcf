"""Incremental detokenization with stop strings, for streaming.

Token ids arrive a few at a time; text must leave as soon as it is final. Two things make a
character not final yet:

- an incomplete UTF-8 sequence: byte-level tokenizers split one emoji or CJK character over
  several tokens, and decoding a prefix of them gives U+FFFD. We decode a small window of ids
  twice (the context already emitted, and context plus pending ids) and only emit the difference
  once it no longer ends in U+FFFD (the prefix/read-offset technique).
- a possible stop string: the tail of the text that is a proper prefix of some stop string is
  held back until the next token decides it (a match cuts it, anything else releases it), or
  until ``flush()`` when the request ends for another reason.

Stop strings are matched by a ``StopMatcher`` (Aho-Corasick), fed each new character once: the
cost per token does not grow with the number or length of the stop strings. The first stop
string to complete wins (the longest of those completing at the same character), so the result
does not depend on how the ids were split into updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from bastion.core.stop_matcher import StopMatcher

# Prompt tokens decoded ahead of the output so that the first output token decodes in context
# (SentencePiece decoders strip the leading space of a window's first token).
_NUM_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class DetokenizerDelta(NamedTuple):
    """What one ``update`` produced.

    ``text`` is the new text to send now. ``stop_string`` is the stop string that matched in
    this update, or ``None``; once it is set the text was cut before the stop string (after it
    when ``include_stop_str_in_output``) and every later update returns ``("", None)``.
    """

    text: str
    stop_string: str | None


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a delta at a time.

    ``tokenizer`` is a Hugging Face tokenizer (only ``decode`` is used). ``output_text`` is all
    text decoded so far, including the tail held back because it may begin a stop string; after
    a stop string matched it is the final, cut text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self._matcher = StopMatcher(self.stop) if self.stop else None  # raises on "" stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self.output_text = ""
        self.stop_string: str | None = None
        self.is_finished = False
        # The decoding window: _window[:_read_offset] is context whose text was already
        # produced (the prompt's tail at first), the rest is pending.
        self._window: list[int] = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window)
        self._num_emitted_chars = 0

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False
               ) -> DetokenizerDelta:
        """Add newly sampled ids and return the text that became final.

        ``stop_terminated`` says the last id is the EOS or stop token that ended the request:
        its text is then left out unless ``include_stop_str_in_output`` (as vLLM does).
        """
        if self.is_finished:
            return DetokenizerDelta("", None)
        ids = list(new_token_ids)
        if stop_terminated and ids and not self.include_stop_str_in_output:
            ids.pop()
        for token_id in ids:
            self._window.append(token_id)
            self.output_text += self._decode_pending(allow_incomplete=False)
        if self._match_stop():
            self.is_finished = True
            return DetokenizerDelta(self._take(len(self.output_text)), self.stop_string)
        return DetokenizerDelta(self._take(len(self.output_text) - self._num_held_chars()), None)

    def flush(self) -> str:
        """End of the request (length, EOS, abort): return everything still held back.

        An incomplete UTF-8 sequence left at the end is decoded as U+FFFD, exactly as
        ``tokenizer.decode`` of all ids would. Later calls return ``""``.
        """
        if self.is_finished:
            return ""
        self.output_text += self._decode_pending(allow_incomplete=True)
        self.is_finished = True
        # A stop string cannot hide in held-back text (it would have matched already), but
        # the forced decode above may complete one, e.g. a stop string that contains U+FFFD.
        self._match_stop()
        return self._take(len(self.output_text))

    def _decode_pending(self, allow_incomplete: bool) -> str:
        """Decode the window; return the new text once it is complete, else ``""``."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[:self._read_offset])
        full_text = self._decode(self._window)
        if not allow_incomplete and (len(full_text) <= len(prefix_text)
                                     or full_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        new_text = full_text[len(prefix_text):]
        # NOTE: the ids just decoded become the whole context of the next call and older
        # ones are dropped, so each call decodes a handful of tokens, not the whole output.
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        # NOTE: ``decode`` rather than convert_ids_to_tokens + convert_tokens_to_string: only
        # ``decode`` skips exactly the tokens that ``decode`` of the whole output skips (added
        # tokens flagged special, not just ``all_special_ids``).
        if not token_ids:
            return ""
        # Space clean-up (" ." -> ".") would change text across window edges; it is off in
        # the tokenizers of every model we serve, and must be off here for the diff to be exact.
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _match_stop(self) -> bool:
        """Feed the text added since the last call to the matcher; on a match, cut
        ``output_text`` and record the stop string."""
        if self._matcher is None:
            return False
        match = self._matcher.feed(self.output_text[self._matcher.num_fed_chars:])
        if match is None:
            return False
        start = match.end - len(match.stop)
        end = match.end if self.include_stop_str_in_output else start
        # NOTE: never cuts into emitted text: a stop string that started before this update
        # had its beginning held back by _num_held_chars.
        assert end >= self._num_emitted_chars
        self.output_text = self.output_text[:end]
        self.stop_string = match.stop
        return True

    def _num_held_chars(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return 0 if self._matcher is None else self._matcher.num_pending_chars

    def _take(self, end: int) -> str:
        end = max(end, self._num_emitted_chars)
        text = self.output_text[self._num_emitted_chars:end]
        self._num_emitted_chars = end
        return text
