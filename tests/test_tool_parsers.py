"""Tool-call parsers on recorded model texts: what the non-streamed answer holds, and that the
streamed pieces, in 1-character, random-size and two-part chunks, join to exactly that."""

from __future__ import annotations

import json
import random

import pytest

from bastion.api.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    join_pieces,
)

# Recorded in the formats of Qwen2.5's / Hermes' template (the first two from Qwen2.5-7B).
HERMES_ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}\n</tool_call>'
)
HERMES_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"tz": "Europe/Paris", "24h": true}}\n</tool_call>'
)
HERMES_TEXT_FIRST = (
    "Let me look that up for you.\n\n<tool_call>\n"
    '{"name": "search", "arguments": {"query": "caf\\u00e9 \\"de Flore\\"", '
    '"limit": 3, "filters": {"open": null, "rating": [4.5, 5e0]}}}\n'
    "</tool_call>"
)
LLAMA_ONE = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": -2}}'
LLAMA_TWO = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "UTC"}}'
)


def streamed(parser: ToolParser, chunks: list[str]):
    pieces = [piece for chunk in chunks for piece in parser.feed(chunk)] + parser.finish()
    return pieces, join_pieces(pieces)


def chunkings(text: str) -> list[list[str]]:
    """1-character chunks, seeded random sizes of 1-7, and a split at every boundary."""
    out = [list(text)]
    for seed in range(3):
        rng, chunks, i = random.Random(seed), [], 0
        while i < len(text):
            size = rng.randint(1, 7)
            chunks.append(text[i : i + size])
            i += size
        out.append(chunks)
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    return out


def calls(extracted) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls]


def assert_streams_join(make: type[ToolParser] | object, text: str) -> None:
    expected = make().extract(text)
    for chunks in chunkings(text):
        pieces, joined = streamed(make(), chunks)
        assert (joined.content, [(c.name, c.arguments) for c in joined.tool_calls]) == (
            expected.content,
            [(c.name, c.arguments) for c in expected.tool_calls],
        ), chunks
        # OpenAI's order: a call's header (id, name) comes before any of its arguments.
        seen: set[int] = set()
        for piece in pieces:
            if piece.is_tool_call:
                assert (piece.name is not None) == (piece.index not in seen)
                seen.add(piece.index)


@pytest.mark.parametrize("text", [HERMES_ONE, HERMES_TWO, HERMES_TEXT_FIRST])
def test_hermes_streams_join_to_the_whole(text):
    assert_streams_join(TOOL_PARSERS["hermes"], text)


def test_hermes_extract():
    hermes = TOOL_PARSERS["hermes"]
    one = hermes().extract(HERMES_ONE)
    assert one.content is None
    assert calls(one) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    # The arguments are the model's own JSON text.
    assert one.tool_calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    assert one.tool_calls[0].call_id.startswith("call_")
    two = hermes().extract(HERMES_TWO)
    assert two.content is None
    assert calls(two) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "Europe/Paris", "24h": True}),
    ]
    assert two.tool_calls[0].call_id != two.tool_calls[1].call_id
    first = hermes().extract(HERMES_TEXT_FIRST)
    assert first.content == "Let me look that up for you."
    assert calls(first) == [
        (
            "search",
            {
                "query": 'café "de Flore"',
                "limit": 3,
                "filters": {"open": None, "rating": [4.5, 5.0]},
            },
        )
    ]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {city: "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',  # not an object
        '<tool_call>\n["get_weather"]\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"n": 01}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    ],
)
def test_hermes_malformed_call_is_content(text):
    assert TOOL_PARSERS["hermes"]().extract(text) == (text, [])


def test_hermes_malformed_before_its_name_streams_as_content():
    text = 'Sure. <tool_call>\n{name: "get_weather"}</tool_call> done'
    assert_streams_join(TOOL_PARSERS["hermes"], text)
    assert TOOL_PARSERS["hermes"]().extract(text) == (text, [])


def test_hermes_call_broken_after_its_name_keeps_what_was_sent():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, b}}</tool_call>'
    _, joined = streamed(TOOL_PARSERS["hermes"](), list(text))
    assert [(c.name, c.arguments) for c in joined.tool_calls] == [("f", '{"a": 1, ')]
    assert joined.content == "b}}</tool_call>"


def test_hermes_unclosed_tag_after_a_whole_object_counts():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    extracted = TOOL_PARSERS["hermes"]().extract(text)
    assert extracted.content == "Checking."
    assert calls(extracted) == [("get_weather", {"city": "Oslo"})]
    assert_streams_join(TOOL_PARSERS["hermes"], text)


@pytest.mark.parametrize("text", ["", "Plain answer, no tools.\n", "a <tool", "x < y </tool_call>"])
def test_hermes_text_without_calls_is_unchanged(text):
    assert TOOL_PARSERS["hermes"]().extract(text) == (text, [])
    assert_streams_join(TOOL_PARSERS["hermes"], text)


def test_hermes_text_after_a_call_is_content():
    text = HERMES_ONE + "\nI will tell you once I know."
    extracted = TOOL_PARSERS["hermes"]().extract(text)
    assert extracted.content == "I will tell you once I know."
    assert calls(extracted) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert_streams_join(TOOL_PARSERS["hermes"], text)


def test_hermes_arguments_stream_in_fragments():
    pieces, _ = streamed(TOOL_PARSERS["hermes"](), list(HERMES_ONE))
    fragments = [p.arguments for p in pieces if p.is_tool_call and p.name is None]
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris", "unit": "celsius"}'
    assert pieces[0].name == "get_weather" and pieces[0].arguments == ""


@pytest.mark.parametrize("text", [LLAMA_ONE, LLAMA_TWO, "  " + LLAMA_TWO + " "])
def test_llama3_json_streams_join_to_the_whole(text):
    assert_streams_join(TOOL_PARSERS["llama3_json"], text)


def test_llama3_json_extract():
    llama = TOOL_PARSERS["llama3_json"]
    one = llama().extract(LLAMA_ONE)
    assert one.content is None
    assert calls(one) == [("get_weather", {"city": "Paris", "days": -2})]
    assert calls(llama().extract(LLAMA_TWO)) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "UTC"}),
    ]
    arguments = llama().extract('{"name": "f", "arguments": {"x": 1}}')
    assert calls(arguments) == [("f", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        'I would call {"name": "f", "parameters": {}} here',  # calls only at the start
        '{"name": "get_weather", "parameters": {"city": Paris}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"',
        '{"city": "Paris"}',  # no name
    ],
)
def test_llama3_json_not_a_call_is_content(text):
    assert TOOL_PARSERS["llama3_json"]().extract(text) == (text, [])


def test_llama3_json_second_call_malformed_keeps_the_first():
    text = '{"name": "a", "parameters": {}}; {"name": b}'
    extracted = TOOL_PARSERS["llama3_json"]().extract(text)
    assert calls(extracted) == [("a", {})]
    assert extracted.content == '; {"name": b}'
    assert_streams_join(TOOL_PARSERS["llama3_json"], text)


def test_required_array():
    text = (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    )
    extracted = RequiredToolParser().extract(text)
    assert extracted.content is None
    assert calls(extracted) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert_streams_join(RequiredToolParser, text)
    assert RequiredToolParser().extract("not json") == ("not json", [])


def test_named_function_is_all_arguments():
    text = ' {"city": "Paris", "note": "a  b "} \n'
    extracted = NamedToolParser("get_weather").extract(text)
    assert extracted.content is None
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == [
        ("get_weather", '{"city": "Paris", "note": "a  b "}')
    ]
    assert_streams_join(lambda: NamedToolParser("get_weather"), text)


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-(10**6), 10**6)
    if kind == 2:
        return rng.choice([0.5, -1e-3, 2.5e10, 3.0])
    if kind in (3, 4):
        return "".join(rng.choice('ab "\\/\n\té€😀{}[]<>:,') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(3))}


@pytest.mark.parametrize("seed", range(2))
def test_random_arguments_round_trip_and_corruptions_never_raise(seed):
    rng = random.Random(seed)
    hermes = TOOL_PARSERS["hermes"]
    for _ in range(40):
        arguments = {f"a{i}": _random_value(rng) for i in range(rng.randrange(4))}
        raw = json.dumps(arguments, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        text = f'<tool_call>\n{{"name": "f", "arguments": {raw}}}\n</tool_call>'
        extracted = hermes().extract(text)
        assert [(c.name, c.arguments) for c in extracted.tool_calls] == [("f", raw)]
        assert json.loads(extracted.tool_calls[0].arguments) == arguments
        chunks = [text[i : i + 3] for i in range(0, len(text), 3)]
        assert [(c.name, c.arguments) for c in streamed(hermes(), chunks)[1].tool_calls] == [
            ("f", raw)
        ]
        # One character dropped or changed: never an exception; a call that still comes out
        # carries arguments that parse.
        k = rng.randrange(len(text))
        for broken in (text[:k] + text[k + 1 :], text[:k] + rng.choice('{}[]",:x\\') + text[k:]):
            for call in hermes().extract(broken).tool_calls:
                json.loads(call.arguments)
            streamed(hermes(), list(broken))
