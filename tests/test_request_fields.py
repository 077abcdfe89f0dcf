"""Every request field of OpenAI's completions and chat APIs, and of vLLM's extensions, is either
honoured (a non-default value has the effect asserted here) or refused with a 400 naming it.

OpenAI's fields come from the installed ``openai`` package's request types, so a field a new
release adds fails ``test_every_field_is_classified`` until it is put in one of the tables.
vLLM's extra fields are listed from its documentation ("Extra Parameters" of
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html).
"""

from __future__ import annotations

import json

from collections.abc import Callable
from typing import Any

import pytest
from openai.types import completion_create_params as openai_completion
from openai.types.chat import completion_create_params as openai_chat
from test_api import serve, sse_events  # noqa: F401 (fixture)

from bastion.api.fields import NO_EFFECT, unsupported_fields
from bastion.api.schemas import ChatCompletionRequest, CompletionRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
SYSTEM_MESSAGES = [{"role": "system", "content": "Be terse."}, *MESSAGES]
BASE = {COMPLETIONS: {"prompt": "Hi", "max_tokens": 2}, CHAT: {"messages": MESSAGES,
                                                               "max_tokens": 2}}


def openai_fields(module: Any) -> set[str]:
    return (set(module.CompletionCreateParamsStreaming.__annotations__)
            | set(module.CompletionCreateParamsNonStreaming.__annotations__))


_VLLM_SAMPLING = {"use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
                  "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
                  "skip_special_tokens", "spaces_between_special_tokens",
                  "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "bad_words"}
_VLLM_COMMON = {"add_special_tokens", "response_format", "structured_outputs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
                "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
                "kv_transfer_params", "vllm_xargs"}
VLLM_FIELDS = {
    COMPLETIONS: _VLLM_SAMPLING | _VLLM_COMMON | {"prompt_embeds"},
    CHAT: _VLLM_SAMPLING | _VLLM_COMMON | {
        "best_of", "echo", "add_generation_prompt", "continue_final_message", "documents",
        "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning",
        "reasoning_effort"},
}
ALL_FIELDS = {COMPLETIONS: openai_fields(openai_completion) | VLLM_FIELDS[COMPLETIONS],
              CHAT: openai_fields(openai_chat) | VLLM_FIELDS[CHAT]}


def params(engine):
    return engine.requests[0][2]


# A check gets (engine, response body: a dict, or the SSE events of a stream, tokenizer).
Check = Callable[[Any, Any, Any], bool]


def _sampling(name: str, value: Any) -> tuple[dict, Check]:
    return {name: value}, lambda e, b, t: getattr(params(e), name) == value


_SAMPLING = {
    "frequency_penalty": _sampling("frequency_penalty", 0.5),
    "presence_penalty": _sampling("presence_penalty", -0.5),
    "temperature": _sampling("temperature", 0.5),
    "top_p": _sampling("top_p", 0.5),
    "seed": _sampling("seed", 7),
    "stop": _sampling("stop", ["x"]),
    "top_k": _sampling("top_k", 5),
    "min_p": _sampling("min_p", 0.1),
    "repetition_penalty": _sampling("repetition_penalty", 1.2),
    "stop_token_ids": _sampling("stop_token_ids", [5]),
    "include_stop_str_in_output": _sampling("include_stop_str_in_output", True),
    "ignore_eos": _sampling("ignore_eos", True),
    "min_tokens": _sampling("min_tokens", 1),
    "skip_special_tokens": _sampling("skip_special_tokens", False),
    "max_tokens": _sampling("max_tokens", 3),
    "logit_bias": ({"logit_bias": {"5": 10}}, lambda e, b, t: params(e).logit_bias == {5: 10.0}),
    "n": ({"n": 2}, lambda e, b, t: sorted(c["index"] for c in b["choices"]) == [0, 1]),
    "stream": ({"stream": True}, lambda e, b, t: b[0]["id"] == b[-1]["id"]
               and b[-1]["choices"][0]["finish_reason"] == "length"),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}},
                       lambda e, b, t: b[-1]["choices"] == [] and b[-1]["usage"] is not None),
    "prompt_logprobs": ({"prompt_logprobs": 1}, lambda e, b, t: params(e).prompt_logprobs == 1
                        and (b.get("prompt_logprobs") or b["choices"][0]["prompt_logprobs"])[0]
                        is None),
    # bastion's own (also the X-Request-Timeout header).
    "timeout": ({"timeout": 30}, lambda e, b, t: e.requests[0][3] is not None),
    # Structured outputs (api/structured_outputs.py): one constraint for the engine.
    "response_format": ({"response_format": {"type": "json_object"}},
                        lambda e, b, t: params(e).structured_outputs.json_object),
    "structured_outputs": ({"structured_outputs": {"regex": "a+"}},
                           lambda e, b, t: params(e).structured_outputs.regex == "a+"),
    "guided_json": ({"guided_json": {"type": "object"}}, lambda e, b, t:
                    json.loads(params(e).structured_outputs.json) == {"type": "object"}),
    "guided_regex": ({"guided_regex": "b+"},
                     lambda e, b, t: params(e).structured_outputs.regex == "b+"),
    "guided_choice": ({"guided_choice": ["yes", "no"]},
                      lambda e, b, t: params(e).structured_outputs.choice == ["yes", "no"]),
    "guided_grammar": ({"guided_grammar": 'root ::= "a" | "b"'}, lambda e, b, t:
                       params(e).structured_outputs.grammar == 'root ::= "a" | "b"'),
}


def _chat_prompt(tok, add_generation_prompt: bool, messages: list = MESSAGES,
                 **template_kwargs: Any) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt,
                                   **template_kwargs)
    return tok.encode(text, add_special_tokens=False)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
NAMED_F = {"type": "function", "function": {"name": "f"}}


def _forced_schema(engine) -> dict:
    return json.loads(params(engine).structured_outputs.json)


HONOURED: dict[str, dict[str, tuple[dict, Check]]] = {
    COMPLETIONS: {
        **_SAMPLING,
        "model": ({"model": "smollm2"}, lambda e, b, t: b["model"] == "smollm2"),
        "prompt": ({"prompt": [1, 2, 3]}, lambda e, b, t: e.requests[0][1] == [1, 2, 3]),
        "echo": ({"echo": True}, lambda e, b, t: b["choices"][0]["text"].startswith("Hi")),
        "logprobs": ({"logprobs": 2}, lambda e, b, t: params(e).logprobs == 2
                     and len(b["choices"][0]["logprobs"]["top_logprobs"]) == 2),
        # The embedded tokenizer adds no BOS, so the flag reaches encode() with no visible
        # difference in ids; what is asserted is that the prompt is still encoded as asked.
        "add_special_tokens": ({"add_special_tokens": False}, lambda e, b, t:
                               e.requests[0][1] == t.encode("Hi", add_special_tokens=False)),
    },
    CHAT: {
        **_SAMPLING,
        "model": ({"model": "smollm2"}, lambda e, b, t: b["model"] == "smollm2"),
        "messages": ({"messages": SYSTEM_MESSAGES}, lambda e, b, t:
                     e.requests[0][1] == _chat_prompt(t, True, SYSTEM_MESSAGES)
                     != _chat_prompt(t, True)),
        "max_completion_tokens": ({"max_completion_tokens": 3},
                                  lambda e, b, t: params(e).max_tokens == 3),
        "logprobs": ({"logprobs": True}, lambda e, b, t: params(e).logprobs == 0
                     and len(b["choices"][0]["logprobs"]["content"]) == 2),
        "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, lambda e, b, t:
                         params(e).logprobs == 2 and
                         len(b["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2),
        "add_generation_prompt": ({"add_generation_prompt": False}, lambda e, b, t:
                                  e.requests[0][1] == _chat_prompt(t, False)
                                  != _chat_prompt(t, True)),
        "add_special_tokens": ({"add_special_tokens": True}, lambda e, b, t:
                               e.requests[0][1] == _chat_prompt(t, True)),
        # Tools (api/tools.py): they reach the template; a forced choice is a JSON schema.
        "tools": ({"tools": [TOOL], "tool_choice": "none"}, lambda e, b, t:
                  e.requests[0][1] == _chat_prompt(t, True, tools=[TOOL])
                  and params(e).structured_outputs is None),
        "tool_choice": ({"tools": [TOOL], "tool_choice": NAMED_F}, lambda e, b, t:
                        _forced_schema(e) == TOOL["function"]["parameters"]),
        "parallel_tool_calls": ({"tools": [TOOL], "tool_choice": "required",
                                 "parallel_tool_calls": False},
                                lambda e, b, t: _forced_schema(e)["maxItems"] == 1),
        "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}},
                                 lambda e, b, t: e.requests[0][1]
                                 == _chat_prompt(t, True, enable_thinking=False)),
    },
}

# Accepted, no effect on the output: the engine gets exactly what it gets without them.
INERT = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
         "safety_identifier": "s-1", "prompt_cache_key": "k-1", "prompt_cache_retention": "24h",
         "prompt_cache_options": {}, "guided_decoding_backend": "xgrammar"}

# A value each refused field must be refused with.
REFUSED_VALUES: dict[str, Any] = {
    "suffix": "x", "best_of": 2, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "verbosity": "low", "moderation": {},
    "use_beam_search": True, "length_penalty": 0.5, "truncate_prompt_tokens": 4,
    "allowed_token_ids": [1], "bad_words": ["x"], "spaces_between_special_tokens": False,
    "prompt_embeds": "AAAA", "logits_processors": ["x"], "return_tokens_as_token_ids": True,
    "return_token_ids": True, "cache_salt": "s", "kv_transfer_params": {}, "vllm_xargs": {},
    "priority": 1, "request_id": "r-1", "mm_processor_kwargs": {},
    "echo": True, "continue_final_message": True, "documents": [], "chat_template": "{{ x }}",
    "guided_whitespace_pattern": " ",
    "functions": [{"name": "f"}], "function_call": "auto", "reasoning_effort": "low",
    "include_reasoning": False,
}


def _cases(kind: str) -> list[tuple[str, str]]:
    out = []
    for path in (COMPLETIONS, CHAT):
        if kind == "honoured":
            names = HONOURED[path]
        elif kind == "inert":
            names = INERT
        else:
            names = unsupported_fields(path == CHAT)
        out += [(path, name) for name in sorted(names)]
    return out


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_field_is_classified(path):
    refused = unsupported_fields(path == CHAT)
    unknown = ALL_FIELDS[path] - set(HONOURED[path]) - set(NO_EFFECT) - refused
    assert not unknown, f"{path}: fields neither honoured nor refused: {sorted(unknown)}"
    assert not set(HONOURED[path]) & refused
    assert set(INERT) == set(NO_EFFECT)
    assert refused <= set(REFUSED_VALUES)
    # The request type decodes every field the route reads or refuses (one it lacked would be
    # dropped as unknown, so neither honoured nor refused).
    fields = set((CompletionRequest if path == COMPLETIONS else ChatCompletionRequest)
                 .__struct_fields__)
    assert set(HONOURED[path]) | refused <= fields, sorted((set(HONOURED[path]) | refused) - fields)


async def _post(http, path: str, body: dict) -> tuple[int, Any]:
    resp = await http.post(path, json=body)
    if resp.status == 200 and body.get("stream"):
        return 200, await sse_events(resp)
    return resp.status, await resp.json()


@pytest.mark.parametrize("path, name", _cases("honoured"))
async def test_honoured_field_has_its_effect(serve, tokenizer, path, name):  # noqa: F811
    http, engine = await serve()
    extra, check = HONOURED[path][name]
    status, body = await _post(http, path, {**BASE[path], **extra})
    assert status == 200, body
    assert check(engine, body, tokenizer), body


@pytest.mark.parametrize("path, name", _cases("inert"))
async def test_inert_field_changes_nothing(serve, path, name):  # noqa: F811
    http, engine = await serve()
    assert (await _post(http, path, BASE[path]))[0] == 200
    status, body = await _post(http, path, {**BASE[path], name: INERT[name]})
    assert status == 200, body
    assert engine.requests[1][1:3] == engine.requests[0][1:3]


@pytest.mark.parametrize("path, name", _cases("refused"))
async def test_refused_field_gets_400_naming_it(serve, path, name):  # noqa: F811
    http, engine = await serve()
    status, body = await _post(http, path, {**BASE[path], name: REFUSED_VALUES[name]})
    assert status == 400, body
    assert body["error"]["param"] == name and name in body["error"]["message"]
    assert engine.requests == []
