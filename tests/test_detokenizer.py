"""Incremental detokenization against the embedded SmolLM2 tokenizer (byte-level BPE, so emoji
and CJK characters are split over several tokens)."""

from __future__ import annotations

import random

import pytest
from bastion.core.detokenizer import DetokenizerDelta, IncrementalDetokenizer

# ``tokenizer``: conftest's (transformers' tokenizer of the embedded GGUF, one per session).


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[DetokenizerDelta]:
    return [detok.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]


TEXTS = [
    "Héllo wörld 🎉🦀 日本語のテキスト ñandú — “quotes” 👩‍👩‍👧",
    "café ☕ naïve — 你好，世界",
    "Ünïcödé façade 😀👍🏽 привет мир 안녕하세요 عربى",
    "東京は日本語で",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_text_streams_exactly(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Repeat:"), True, [], False)
    deltas = stream(detok, ids, chunk)
    assert all("\ufffd" not in d.text and d.stop_string is None for d in deltas)
    assert detok.flush() == ""  # all characters were complete
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids) == text
    assert detok.output_text == text


def test_split_emoji_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("Hi 🎉!")
    assert len(ids) == 5  # 'Hi', ' \xf0\x9f', '\x8e', '\x89', '!'
    detok = IncrementalDetokenizer(tokenizer, [], True, [], False)
    assert [d.text for d in stream(detok, ids)] == ["Hi", "", "", " 🎉", "!"]


def test_incomplete_sequence_at_the_end_is_flushed_like_decode(tokenizer):
    ids = tokenizer.encode("ok 🎉")[:-1]  # cut the emoji's last byte
    detok = IncrementalDetokenizer(tokenizer, [], True, [], False)
    assert "".join(d.text for d in stream(detok, ids)) == "ok"
    tail = detok.flush()
    assert tail.startswith(" \ufffd")
    assert "ok" + tail == tokenizer.decode(ids) == detok.output_text
    assert detok.flush() == "" and detok.update([17]) == ("", None)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_decode(tokenizer, skip_special_tokens):
    """Random ids, half of them single-byte tokens, so invalid UTF-8 and special tokens abound:
    the deltas plus flush must still equal decode of all ids."""
    rng = random.Random(1234)
    vocab_size = len(tokenizer)
    for _ in range(60):
        ids = [rng.randrange(vocab_size) if rng.random() < 0.5 else rng.randrange(0, 260)
               for _ in range(30)]
        detok = IncrementalDetokenizer(tokenizer, [rng.randrange(vocab_size)], skip_special_tokens,
                                       [], False)
        pieces = [d.text for d in stream(detok, ids, rng.randint(1, 4))] + [detok.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_skip_special_tokens(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("a") + [im_end] + tokenizer.encode(" b")
    skipped = IncrementalDetokenizer(tokenizer, [], True, [], False)
    assert [d.text for d in stream(skipped, ids)] == ["a", "", " b"]
    kept = IncrementalDetokenizer(tokenizer, [], False, [], False)
    assert [d.text for d in stream(kept, ids)] == ["a", "<|im_end|>", " b"]


def test_stop_token_text_left_out_unless_included(tokenizer):
    ids = tokenizer.encode("done") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], False, [], False)
    assert detok.update(ids, stop_terminated=True).text == "done"
    detok = IncrementalDetokenizer(tokenizer, [], False, [], True)
    assert detok.update(ids, stop_terminated=True).text == "done<|im_end|>"


def test_stop_string_spanning_two_tokens_cuts_exactly(tokenizer):
    ids = tokenizer.encode("The answer is 42.")  # 'The', ' answer', ' is', ' ', '4', '2', '.'
    detok = IncrementalDetokenizer(tokenizer, [], True, ["swer is"], False)
    deltas = stream(detok, ids)
    # "swer" may begin the stop string, so only " an" of " answer" leaves before ' is' decides.
    assert deltas[:3] == [("The", None), (" an", None), ("", "swer is")]
    assert all(d == ("", None) for d in deltas[3:])
    assert detok.output_text == "The an" and detok.stop_string == "swer is"
    assert detok.flush() == ""


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("The answer is 42.")
    detok = IncrementalDetokenizer(tokenizer, [], True, ["swer is"], True)
    deltas = stream(detok, ids)
    assert deltas[:3] == [("The", None), (" an", None), ("swer is", "swer is")]
    assert "".join(d.text for d in deltas) == detok.output_text == "The answer is"


def test_stop_inside_one_token_and_earliest_match_wins(tokenizer):
    ids = tokenizer.encode("The answer is 42.")
    detok = IncrementalDetokenizer(tokenizer, [], True, ["42", "nsw", "e a"], False)
    deltas = stream(detok, ids)
    # 'e a' (from 'The' + ' answer') starts before 'nsw'; both complete with ' answer'.
    assert deltas[:2] == [("Th", None), ("", "e a")]
    assert detok.output_text == "Th"


def test_partial_stop_is_released_when_disproved_and_on_flush(tokenizer):
    ids = tokenizer.encode("The answer is 42.")
    detok = IncrementalDetokenizer(tokenizer, [], True, [" is 5", "2.x"], False)
    deltas = stream(detok, ids)
    texts = [d.text for d in deltas]
    # ' is' and ' ' are held as a possible " is 5" until '4' disproves it; then "2" and "2."
    # are held as a possible "2.x" until the request ends.
    assert texts == ["The", " answer", "", "", " is 4", "", ""]
    assert all(d.stop_string is None for d in deltas)
    assert detok.flush() == "2."
    assert detok.output_text == "The answer is 42."


def test_multibyte_stop_string_across_byte_tokens(tokenizer):
    ids = tokenizer.encode("東京は日本語で")
    detok = IncrementalDetokenizer(tokenizer, [], True, ["本語"], False)
    deltas = stream(detok, ids)
    assert "".join(d.text for d in deltas) == detok.output_text == "東京は日"
    assert [d.stop_string for d in deltas].count("本語") == 1
    assert all("\ufffd" not in d.text for d in deltas)


def test_several_tokens_per_update_match_one_at_a_time(tokenizer):
    ids = tokenizer.encode("Ünïcödé façade 😀👍🏽 привет мир")
    for stop in (["привет"], ["façade 😀"], ["👍"]):
        one = IncrementalDetokenizer(tokenizer, [], True, stop, False)
        many = IncrementalDetokenizer(tokenizer, [], True, stop, False)
        text_one = "".join(d.text for d in stream(one, ids))
        text_many = "".join(d.text for d in stream(many, ids, 5))
        assert text_one == text_many == one.output_text == many.output_text
        assert one.stop_string == many.stop_string == stop[0]
        assert text_one == "Ünïcödé façade 😀👍🏽 привет мир".split(stop[0])[0]


def test_empty_stop_string_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], True, [""], False)
