"""Reasoning parsers on recorded Qwen3- and DeepSeek-R1-style texts, whole and streamed
(split at every boundary and in 1-character chunks)."""

from __future__ import annotations

import pytest

from bastion.api.reasoning import REASONING_PARSERS

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]

# Qwen3-0.6B's shape with enable_thinking on: the model opens the block itself.
THINKING = "<think>\nThe user asks for 2 + 2. That is 4.\n</think>\n\n2 + 2 = **4**."
# With enable_thinking off the template renders an empty block into the prompt.
NO_THINKING_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"  # a template that opens the block


def streamed(make, text: str, chunks: list[str]) -> tuple[str | None, str | None]:
    parser = make()
    parts = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    return reasoning or None, content or None


def assert_streams_join(make, text: str) -> None:
    expected = tuple(make().extract(text))
    for chunks in [list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]:
        assert streamed(make, text, chunks) == expected, chunks


@pytest.mark.parametrize(
    "make, text, reasoning, content",
    [
        (QWEN3, THINKING, "The user asks for 2 + 2. That is 4.", "2 + 2 = **4**."),
        (QWEN3, "2 + 2 = 4.", None, "2 + 2 = 4."),  # no block: no reasoning
        (
            QWEN3,
            "<think>\nStill thinking when max_tokens hit",
            "Still thinking when max_tokens hit",
            None,
        ),
        (QWEN3, "<think>\n\n</think>\n\nHi!", None, "Hi!"),
        (QWEN3, "\n<thinking> is a tag", None, "\n<thinking> is a tag"),
        (QWEN3, "The tag </think> alone", None, "The tag </think> alone"),
        (
            R1,
            "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.",
            "Okay, 2 + 2 is 4.",
            "The answer is 4.",
        ),
        (R1, THINKING, "The user asks for 2 + 2. That is 4.", "2 + 2 = **4**."),
        (R1, "No end tag, all reasoning", "No end tag, all reasoning", None),
    ],
)
def test_split_whole_and_streamed(make, text, reasoning, content):
    assert tuple(make().extract(text)) == (reasoning, content)
    assert_streams_join(make, text)


def test_qwen3_follows_what_the_prompt_left_open():
    text = "Counting: 4.\n</think>\n\n4"
    assert tuple(QWEN3(OPEN_PROMPT).extract(text)) == ("Counting: 4.", "4")
    assert tuple(QWEN3(NO_THINKING_PROMPT).extract(text)) == (None, text)
    mentioned = "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"
    assert tuple(QWEN3(mentioned).extract(text)) == (None, text)
    assert_streams_join(lambda: QWEN3(OPEN_PROMPT), text)


def test_content_keeps_tool_calls_for_the_tool_parser():
    text = (
        '<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>'
    )
    reasoning, content = QWEN3().extract(text)
    assert reasoning == "I need the weather tool."
    assert content.startswith("<tool_call>\n{") and content.endswith("</tool_call>")
