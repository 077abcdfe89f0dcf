"""Tool calling and reasoning output over HTTP, against test_api's fake engine replaying a
recorded answer (the 135M model seldom calls a tool on its own), with SmolLM2's hermes tool
template: what reaches the template, the parsed answers whole and streamed (through the
official ``openai`` client), ``finish_reason``, and the 400s."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_api import FakeEngine, FakeStream, sse_events
from test_cli import quiet_serve  # noqa: F401 (fixture)

from bastion.api.chat_output import constrain_after_reasoning
from bastion.api.errors import ApiError
from bastion.api.server import ApiConfig, build_app
from bastion.api.tools import ToolRequest, forced_schema
from bastion.ipc.messages import FinishReason, SamplingParams, StructuredOutputsParams
from bastion.procs.cli import main

TEMPLATE = (
    Path(__file__).parents[1]
    / "configs"
    / "chat_templates"
    / "tool_chat_template_smollm2_hermes.jinja"
).read_text()
AUTO = ApiConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"$ref": "#/$defs/tz"}},
            "required": ["tz"],
            "$defs": {"tz": {"type": "string"}},
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    "\n</tool_call>"
)
TWO_CALLS_TEXT = (
    'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {"tz": "CET"}}\n</tool_call>'
)


class StopStream(FakeStream):
    """Ends with ``stop`` after the script's last token, as a model that emitted EOS."""

    def _output(self, cid, i, step):
        output = super()._output(cid, i, step)
        if step + 1 >= len(self.engine.script) and output.finish_reason is None:
            output.finish_reason = FinishReason.STOP
        return output


class ScriptEngine(FakeEngine):
    max_model_len = 2048

    def generate(self, request_id, prompt_token_ids, params, deadline=None):
        self.requests.append((request_id, prompt_token_ids, params, deadline))
        return StopStream(self, request_id, prompt_token_ids, params)


class TemplateTokenizer:
    """The embedded tokenizer rendering with another chat template (a deep copy costs 10 s)."""

    def __init__(self, wrapped, template: str) -> None:
        self._tokenizer, self._template = wrapped, template

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:  # dunders skip __getattr__
        return len(self._tokenizer)

    def apply_chat_template(self, *args, **kwargs):
        return self._tokenizer.apply_chat_template(*args, chat_template=self._template, **kwargs)


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    return TemplateTokenizer(tokenizer, TEMPLATE)


@pytest.fixture
async def serve_script(tool_tokenizer):
    clients: list[TestClient] = []

    async def start(text: str, config: ApiConfig = AUTO):
        engine = ScriptEngine(tool_tokenizer)
        engine.script = tool_tokenizer.encode(text)
        assert tool_tokenizer.decode(engine.script) == text
        client = TestClient(TestServer(build_app(engine, config)))
        await client.start_server()
        clients.append(client)
        return client, engine

    yield start
    for client in clients:
        await client.close()


def rendered_ids(tok, messages, tools=None, **kwargs) -> list[int]:
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return tok.encode(text, add_special_tokens=False)


async def chat(http, **body):
    resp = await http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    return resp.status, await resp.json()


def streamed_message(events) -> tuple[dict, str]:
    """A stream's deltas joined as a client would: content, reasoning, calls by index."""
    content, reasoning, calls, finish = "", "", {}, None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for piece in delta.get("tool_calls", []):
                if "id" in piece:
                    assert piece["index"] not in calls and piece["type"] == "function"
                    calls[piece["index"]] = {
                        "id": piece["id"],
                        "type": "function",
                        "function": {"name": piece["function"]["name"], "arguments": ""},
                    }
                else:
                    assert set(piece["function"]) == {"arguments"}
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    message = {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message, finish


def without_ids(calls: list[dict]) -> list[dict]:
    return [{**c, "id": None} for c in calls]


# --------------------------------------------------------------------------------- auto


async def test_auto_parses_calls_and_tools_reach_the_template(serve_script, tool_tokenizer):
    http, engine = await serve_script(TWO_CALLS_TEXT)
    status, body = await chat(http, tools=[WEATHER, TIME])
    assert status == 200, body
    assert engine.requests[0][1] == rendered_ids(tool_tokenizer, MESSAGES, [WEATHER, TIME])
    assert engine.requests[0][2].structured_outputs is None  # auto is not forced
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking both."
    assert without_ids(message["tool_calls"]) == [
        {
            "id": None,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": None,
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
        },
    ]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])


async def test_auto_streamed_joins_to_the_whole(serve_script):
    http, _ = await serve_script(TWO_CALLS_TEXT)
    _, whole = await chat(http, tools=[WEATHER, TIME])
    resp = await http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "tools": [WEATHER, TIME], "stream": True},
    )
    events = await sse_events(resp)
    message, finish = streamed_message(events)
    assert finish == "tool_calls"
    assert message["content"] == whole["choices"][0]["message"]["content"]
    assert without_ids(message["tool_calls"]) == without_ids(
        whole["choices"][0]["message"]["tool_calls"]
    )
    # Arguments arrive in fragments, after their call's header.
    pieces = [p for e in events for c in e["choices"] for p in c["delta"].get("tool_calls", [])]
    assert len(pieces) > 4


async def test_auto_with_the_openai_client(serve_script):
    import openai

    http, _ = await serve_script(CALL_TEXT)
    client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)
    try:
        whole = await client.chat.completions.create(
            model="smollm2", messages=MESSAGES, tools=[WEATHER], tool_choice="auto"
        )
        call = whole.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather",
            {"city": "Paris", "unit": "c"},
        )
        assert whole.choices[0].finish_reason == "tool_calls"
        assert whole.choices[0].message.content is None
        stream = await client.chat.completions.create(
            model="smollm2", messages=MESSAGES, tools=[WEATHER], stream=True
        )
        name, arguments = "", ""
        async for chunk in stream:
            for piece in chunk.choices[0].delta.tool_calls or []:
                name += piece.function.name or ""
                arguments += piece.function.arguments or ""
        assert (name, arguments) == ("get_weather", call.function.arguments)
    finally:
        await client.close()


async def test_parallel_tool_calls_false_keeps_the_first(serve_script):
    http, _ = await serve_script(TWO_CALLS_TEXT)
    _, body = await chat(http, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == [
        "get_weather"
    ]
    resp = await http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "tools": [WEATHER, TIME],
            "parallel_tool_calls": False,
            "stream": True,
        },
    )
    message, _ = streamed_message(await sse_events(resp))
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']


async def test_malformed_call_is_content(serve_script):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'
    http, _ = await serve_script(text)
    status, body = await chat(http, tools=[WEATHER])
    assert status == 200
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
async def test_an_empty_tools_list_is_no_tools(serve_script, tool_tokenizer, tool_choice):
    http, engine = await serve_script(CALL_TEXT, ApiConfig())
    status, body = await chat(http, tools=[], tool_choice=tool_choice)
    assert status == 200, body
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert engine.requests[0][1] == rendered_ids(tool_tokenizer, MESSAGES)
    assert engine.requests[0][2].structured_outputs is None


async def test_tool_choice_none_leaves_the_text_alone(serve_script, tool_tokenizer):
    http, engine = await serve_script(CALL_TEXT)
    status, body = await chat(http, tools=[WEATHER], tool_choice="none")
    assert status == 200
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert body["choices"][0]["finish_reason"] == "stop"
    # As vLLM by default: the template still shows the tools.
    assert engine.requests[0][1] == rendered_ids(tool_tokenizer, MESSAGES, [WEATHER])


async def test_history_with_calls_and_results_reaches_the_template(serve_script, tool_tokenizer):
    http, engine = await serve_script("It is 18 C in Paris.")
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    resp = await http.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["choices"][0]["message"]["content"] == "It is 18 C in Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    expected = copy.deepcopy(history)
    expected[1]["content"] = ""
    expected[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    ids = rendered_ids(tool_tokenizer, expected, [WEATHER])
    assert engine.requests[0][1] == ids
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in tool_tokenizer.decode(ids)


# ------------------------------------------------------------------------------- forced


def test_forced_schemas():
    named = ToolRequest([WEATHER, TIME], "named", "get_weather")
    assert forced_schema(named) == WEATHER["function"]["parameters"]
    required = forced_schema(ToolRequest([WEATHER, TIME], "required"))
    assert required["type"] == "array" and required["minItems"] == 1
    assert "maxItems" not in required and required["$defs"] == {"tz": {"type": "string"}}
    good = [
        {"name": "get_time", "arguments": {"tz": "CET"}},
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}},
    ]
    jsonschema.validate(good, required)
    for bad in (
        [],
        [{"name": "get_time", "arguments": {"tz": 1}}],
        [{"name": "get_weather", "arguments": {"tz": "CET"}}],
        [{"name": "nope", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = forced_schema(ToolRequest([WEATHER], "required", is_parallel=False))
    assert single["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[1:] * 2, single)


FORCED = [
    ("required", '[{"name": "get_time", "arguments": {"tz": "CET"}}]'),
    ({"type": "function", "function": {"name": "get_time"}}, '{"tz": "CET"}'),
]


@pytest.mark.parametrize("tool_choice, text", FORCED)
async def test_forced_choice_sets_the_grammar_and_parses_its_output(
    serve_script, monkeypatch, tool_choice, text
):
    # The engine's side (honouring the grammar) is branch struct's; the fake replays what the
    # grammar allows, and this checks everything the API does around it.
    monkeypatch.setattr("bastion.api.tools.structured_outputs_available", lambda: True)
    http, engine = await serve_script(text, ApiConfig())  # forced needs no parser flags
    status, body = await chat(http, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert status == 200, body
    request = (
        ToolRequest([WEATHER, TIME], "required")
        if tool_choice == "required"
        else ToolRequest([WEATHER, TIME], "named", "get_time")
    )
    assert json.loads(engine.requests[0][2].structured_outputs.json) == forced_schema(request)
    message = body["choices"][0]["message"]
    expected = [
        {
            "id": None,
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
        }
    ]
    assert message["content"] is None and without_ids(message["tool_calls"]) == expected
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    resp = await http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "tools": [WEATHER, TIME],
            "tool_choice": tool_choice,
            "stream": True,
        },
    )
    streamed, finish = streamed_message(await sse_events(resp))
    assert (streamed["content"], without_ids(streamed["tool_calls"]), finish) == (
        None,
        expected,
        "tool_calls",
    )


@pytest.mark.parametrize("tool_choice, text", FORCED)
async def test_forced_choice_is_refused_without_structured_outputs(
    serve_script, monkeypatch, tool_choice, text
):
    monkeypatch.setattr("bastion.api.tools.structured_outputs_available", lambda: False)
    http, engine = await serve_script(text, ApiConfig())
    status, body = await chat(http, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert status == 400 and body["error"]["param"] == "tool_choice"
    assert (
        "needs structured outputs, which this server does not implement yet"
        in (body["error"]["message"])
    )
    assert engine.requests == []


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "config, body, message",
    [
        (
            ApiConfig(),
            {"tools": [WEATHER]},
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser',
        ),
        (AUTO, {"tool_choice": "auto"}, "tool_choice needs tools"),
        (AUTO, {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be none"),
        (
            AUTO,
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not in tools",
        ),
        (AUTO, {"tools": [{"type": "code_interpreter"}]}, "only function tools"),
        (AUTO, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "1-64 letters"),
        (AUTO, {"tools": [WEATHER, WEATHER]}, "used twice"),
        (
            AUTO,
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": 5}}},
                        },
                    }
                ]
            },
            "not a valid JSON schema",
        ),
        (AUTO, {"tools": "get_weather"}, "Expected `array | null`, got `str` - at `$.tools`"),
        (AUTO, {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (AUTO, {"functions": [WEATHER["function"]]}, "functions is not supported"),
        (AUTO, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set tools"),
        (AUTO, {"chat_template_kwargs": ["x"]},
         "Expected `object | null`, got `array` - at `$.chat_template_kwargs`"),
        (
            AUTO,
            {"messages": [*MESSAGES, {"role": "tool", "content": "18 C"}]},
            "needs tool_call_id",
        ),
        (
            AUTO,
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": "{bad"}}
                        ],
                    },
                ]
            },
            "must be JSON text",
        ),
        (
            AUTO,
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "belongs to assistant messages",
        ),
    ],
)
async def test_bad_tool_requests_get_400(serve_script, config, body, message):
    http, engine = await serve_script("x", config)
    resp = await http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["type"] == "BadRequestError", error
    assert message in error["message"]
    assert error["param"] in (
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "chat_template_kwargs",
        "messages",
    )
    assert engine.requests == []


class ThinkTokenizer(TemplateTokenizer):
    """A vocabulary with ``</think>`` as one token (Qwen3's and DeepSeek-R1's have it; the
    embedded model's splits it), id ``END_ID``."""

    END_ID = 49151

    def encode(self, text, *args, **kwargs):
        if text == "</think>":
            return [self.END_ID]
        return self._tokenizer.encode(text, *args, **kwargs)


async def test_forced_choice_under_a_reasoning_parser_starts_after_the_reasoning(
    serve_script, tokenizer, monkeypatch
):
    monkeypatch.setattr("bastion.api.tools.structured_outputs_available", lambda: True)
    text = ("<think>\nThe user wants the weather; call the tool.\n</think>"
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    http, engine = await serve_script(text, ApiConfig(reasoning_parser="qwen3"))
    engine.tokenizer = ThinkTokenizer(tokenizer, TEMPLATE)
    status, body = await chat(http, tools=[WEATHER], tool_choice="required")
    assert status == 200, body
    spec = engine.requests[0][2].structured_outputs
    assert spec.start_after_token_id == ThinkTokenizer.END_ID and spec.json is not None
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the weather; call the tool."
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tool-call-parser", "mistral"], "tool_call_parser must be one of hermes, llama3_json"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--reasoning-parser", "r2"], "reasoning_parser must be one of qwen3, deepseek_r1"),
    ],
)
def test_parser_flags_fail_at_start_up(quiet_serve, capsys, argv, message):  # noqa: F811
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"bastion: error: {message}"), err
    ApiConfig(
        enable_auto_tool_choice=True, tool_call_parser="llama3_json", reasoning_parser="qwen3"
    )


# ----------------------------------------------------------------------------- reasoning


def test_a_constraint_under_a_reasoning_parser_starts_after_the_reasoning(tokenizer):
    """vLLM's rule: the grammar applies from the model's first ``</think>`` on, or from the
    first token when the prompt closed the reasoning; a vocabulary without a ``</think>``
    token cannot say where that is."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    think = ThinkTokenizer(tokenizer, TEMPLATE)
    qwen3 = ApiConfig(reasoning_parser="qwen3")
    assert constrain_after_reasoning(params, ApiConfig(), "<think>", think) == params
    assert constrain_after_reasoning(SamplingParams(), qwen3, "", think) == SamplingParams()
    after = constrain_after_reasoning(params, qwen3, "<|im_start|>assistant\n", think)
    assert after.structured_outputs == StructuredOutputsParams(
        json_object=True, start_after_token_id=ThinkTokenizer.END_ID)
    opened = ApiConfig(reasoning_parser="deepseek_r1")
    assert constrain_after_reasoning(params, opened, "<think>\n", think) == after
    # enable_thinking false: the template wrote an empty block, the answer comes next.
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert constrain_after_reasoning(params, qwen3, closed, think) == params
    with pytest.raises(ApiError) as error:
        constrain_after_reasoning(params, qwen3, "", tokenizer, "tool_choice")
    assert (error.value.status, error.value.param) == (400, "tool_choice")
    assert "</think>, which is not one token" in error.value.message


THINK_TEXT = "<think>\nThe user wants the weather; call the tool.\n</think>\n\n" + CALL_TEXT


async def test_reasoning_then_a_call_whole_and_streamed(serve_script):
    config = ApiConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    http, _ = await serve_script(THINK_TEXT, config)
    _, body = await chat(http, tools=[WEATHER])
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the weather; call the tool."
    assert message["content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
        '{"city": "Paris", "unit": "c"}'
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    resp = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER], "stream": True}
    )
    streamed, finish = streamed_message(await sse_events(resp))
    assert finish == "tool_calls"
    assert streamed["reasoning_content"] == message["reasoning_content"]
    assert without_ids(streamed["tool_calls"]) == without_ids(message["tool_calls"])


async def test_a_json_answer_after_reasoning(serve_script, tokenizer):
    text = '<think>\nA city and a number.\n</think>{"city": "Paris", "n": 2}'
    http, engine = await serve_script(text, ApiConfig(reasoning_parser="qwen3"))
    engine.tokenizer = ThinkTokenizer(tokenizer, TEMPLATE)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {
        "type": "integer"}}, "required": ["city", "n"]}
    status, body = await chat(http, response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema}})
    assert status == 200, body
    assert engine.requests[0][2].structured_outputs.start_after_token_id == ThinkTokenizer.END_ID
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "A city and a number."
    assert json.loads(message["content"]) == {"city": "Paris", "n": 2}


async def test_reasoning_without_tools(serve_script):
    http, _ = await serve_script(
        "<think>\nhmm\n</think>\n\nHello!", ApiConfig(reasoning_parser="deepseek_r1")
    )
    _, body = await chat(http)
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "hmm",
    }
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_chat_template_kwargs_reach_the_template(serve_script, tokenizer):
    tok = TemplateTokenizer(
        tokenizer,
        (
            "{{ messages[0]['content'] }}{% if enable_thinking is defined and not enable_thinking %}"
            "<think>\n\n</think>\n\n{% endif %}"
        ),
    )
    http, engine = await serve_script("Hi.", ApiConfig(reasoning_parser="qwen3"))
    engine.tokenizer = tok
    _, body = await chat(http, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(engine.requests[0][1]) == MESSAGES[0]["content"] + "<think>\n\n</think>\n\n"
    assert body["choices"][0]["message"]["content"] == "Hi."
