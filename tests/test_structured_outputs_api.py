"""Structured outputs over HTTP (issue #21), with the official ``openai`` client against one
live ``bastion serve`` (the embedded model on the CPU): ``response_format``, vLLM's
``structured_outputs`` and ``guided_*`` on chat and completions, streamed and not, n = 2; a spec
that cannot compile is a 400 in OpenAI's shape before anything is queued; a grammar request
resumed after an injected engine fault still ends valid, with the fault-free tokens."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import jsonschema
import openai
import pytest
from serve_fixture import SMALL_SERVER_ARGS, ServerProcess
from structured_schemas import SCHEMAS

SERVER_ENV = {"OMP_NUM_THREADS": "1"}
MESSAGES = [{"role": "user", "content": "Answer with a JSON object."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    srv = ServerProcess((*SMALL_SERVER_ARGS, "--served-model-name", "m",
                         "--enable-fault-injection", "--ft-backoff-s", "0.5"),
                        workdir=str(tmp_path_factory.mktemp("structured")), env=SERVER_ENV)
    try:
        srv.wait_healthy(timeout_s=120)
        yield srv
        assert srv.stop() == 0, srv.log_tail()
    finally:
        srv.kill_tree()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0,
                         timeout=300)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def stream_chat(client: openai.OpenAI, **kwargs) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="m", stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def test_json_schemas_on_chat_streamed_and_not_with_n_2(client):
    """Every choice parses and validates; unconstrained requests running alongside keep the
    tokens they get alone."""
    free = {"model": "m", "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0}
    alone = client.completions.create(**free).choices[0].text
    beside: list[str] = []
    thread = threading.Thread(target=lambda: beside.append(
        client.completions.create(**free).choices[0].text))
    thread.start()
    for i, schema in enumerate(SCHEMAS[:2]):
        kwargs = {"messages": MESSAGES, "response_format": schema_format(schema), "n": 2,
                  "max_tokens": 80, "temperature": 0.7, "seed": i}
        reply = client.chat.completions.create(model="m", **kwargs)
        assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]
        for choice in reply.choices:
            jsonschema.validate(json.loads(choice.message.content), schema)
        texts, reasons = stream_chat(client, **kwargs)
        assert reasons == {0: "stop", 1: "stop"}
        # Seeded: the streamed choices are the same draws as the unstreamed ones.
        assert texts == {c.index: c.message.content for c in reply.choices}
    thread.join(300)
    assert beside == [alone]


def test_vllm_and_guided_fields_on_completions(client):
    prompt = "Q: Name a European capital and a two-digit number.\nA:"
    cases = [
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8} [0-9]{2}"}},
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", t)),
        ({"guided_regex": "[A-Z][a-z]{2,8} [0-9]{2}"},
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", t)),
        ({"structured_outputs": {"choice": ["Paris", "Rome"]}}, lambda t: t in ("Paris", "Rome")),
        ({"guided_choice": ["Paris", "Rome"]}, lambda t: t in ("Paris", "Rome")),
        ({"guided_grammar": 'root ::= "It is " [0-9] [0-9] "."'},
         lambda t: re.fullmatch(r"It is [0-9]{2}\.", t)),
        ({"guided_json": SCHEMAS[0]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0])
         is None),
        ({"structured_outputs": {"json": json.dumps(SCHEMAS[7])}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS[7]) is None),
    ]
    for extra, is_valid in cases:
        reply = client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0,
                                          extra_body=extra)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and is_valid(choice.text), (extra, choice.text)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=prompt, max_tokens=40, temperature=0, stream=True,
            extra_body=extra) if c.choices)
        assert streamed == choice.text


def test_json_object_response_format(client):
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": 'Return {"a": 1}'}], max_tokens=40,
        temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"response_format": schema_format({"type": "objekt"})}, "response_format",
     "response_format: the JSON schema cannot be compiled: Unsupported type"),
    ({"guided_json": '{"type": '}, "guided_json", "the JSON schema is not valid JSON"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs",
     ("the regex cannot be compiled: Regex parsing error at position 4: The parenthesis is not "
     "closed")),
    ({"guided_grammar": "root ::= digit"}, "guided_grammar",
     ('the grammar cannot be compiled: EBNF parser error at line 1, column 10: Rule "digit" is '
     "not defined")),
    ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "set at most one output constraint; this request sets guided_regex, guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "must set exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs",
     "structured_outputs.structural_tag is not supported"),
    ({"response_format": {"type": "yaml"}}, "response_format",
     "response_format.type must be text, json_object or json_schema; got 'yaml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema is required"),
])
def test_uncompilable_or_malformed_specs_are_400(client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8,
                                       extra_body=extra)
    error = info.value.body
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "BadRequestError"


def test_a_grammar_that_dead_ends_in_the_engine_is_400_streamed_or_not(client, server):
    """No token of the embedded vocabulary spells 0x1d: found only once the grammar runs, and
    still the client's error, not the server's (the fuzzer's case, with a stray '^')."""
    body = {"model": "m", "prompt": "Hello", "max_tokens": 8, "guided_regex": "\x1d^a"}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="Hello", max_tokens=8,
                                  extra_body={"guided_regex": body["guided_regex"]})
    error = info.value.body
    assert error["code"] == "invalid_grammar" and error["type"] == "BadRequestError", error
    assert error["message"].startswith("no token of the model's vocabulary can continue")
    request = urllib.request.Request(server.base_url + "/v1/completions", method="POST",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [line[6:] for line in response.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"] == error


def test_grammar_request_resumed_after_an_injected_fault_stays_valid(client, server):
    schema = SCHEMAS[9]
    kwargs = {"messages": MESSAGES, "response_format": schema_format(schema), "max_tokens": 80,
              "temperature": 0}
    reference = client.chat.completions.create(model="m", **kwargs).choices[0].message.content
    pieces: list[str] = []
    reasons: list[str] = []
    stream = client.chat.completions.create(model="m", stream=True, **kwargs)
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
        if len(pieces) == 6:  # tokens flow: fault the busy loop mid-request
            body = json.dumps({"kind": "raise", "engine": 0}).encode()
            req = urllib.request.Request(server.base_url + "/fault_tolerance/inject", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
    text = "".join(pieces)
    assert reasons == ["stop"]
    jsonschema.validate(json.loads(text), schema)
    assert text == reference
    metrics = server.metrics()
    assert any(k.startswith("bastion:engine_recoveries") and v >= 1
               for k, v in metrics.items()), metrics
