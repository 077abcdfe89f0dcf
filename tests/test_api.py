"""The OpenAI-compatible HTTP layer against a fake engine client (no processes, no model).

The fake replays a fixed token script through the real ``OutputProcessor`` and the embedded
SmolLM2 tokenizer, so texts, stop strings and usage are checked exactly.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from bastion.api.auth import is_authorized, is_loopback
from bastion.api.config import METRICS_KEY, STATE_KEY, ApiConfigError
from bastion.api.server import ApiConfig, build_app
from bastion.core.config import CacheConfig
from bastion.core.output_processor import OutputProcessor, fan_out
from bastion.ipc.messages import (
    EngineCoreOutput,
    EngineState,
    EngineStatus,
    FinishReason,
    Logprobs,
    SamplingParams,
    SchedulerStats,
)

SCRIPT_TEXT = " Hello world, this is a test of the bastion server."
MAX_MODEL_LEN = 64
NUM_CACHED_TOKENS = 3


class FakeStream:
    """Choice i emits SCRIPT[(step + i) % len] per step; length-limited by max_tokens."""

    def __init__(self, engine: FakeEngine, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = 0
        self.children = fan_out(request_id, prompt_token_ids, params, None, time.time())
        self.processor = OutputProcessor(engine.tokenizer)
        for i, child in enumerate(self.children):
            self.processor.add(child, request_id, i)
        self.open = {c.request_id: i for i, c in enumerate(self.children)}
        self.aborted = asyncio.Event()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        step = 0
        while self.open:
            if self.engine.hang:
                await self.aborted.wait()
            await asyncio.sleep(self.engine.step_delay)
            if self.aborted.is_set():
                return
            for cid, i in list(self.open.items()):
                delta, _ = self.processor.process(self._output(cid, i, step))
                self.num_cached_tokens = NUM_CACHED_TOKENS
                if delta.finish_reason is not None:
                    del self.open[cid]
                yield delta
            step += 1

    def _output(self, cid: str, i: int, step: int) -> EngineCoreOutput:
        engine = self.engine
        if engine.fail_at == step:
            return EngineCoreOutput(cid, [], engine.fail_reason, error=engine.fail_message)
        params = self.children[i].sampling_params
        token = engine.script[(step + i) % len(engine.script)]
        finish = FinishReason.LENGTH if step + 1 >= params.max_tokens else None
        logprobs = None
        if params.logprobs is not None:
            top = [token + k for k in range(params.logprobs)]
            logprobs = Logprobs([[token] + top], [[-0.25] + [-0.25 - k for k in range(len(top))]],
                                [1])
        # As the engine does: the first output carries the queue and prefill times (and the
        # prompt's logprobs when asked: token p scored -p/10, then ids 1..k at -1-j).
        prompt_logprobs = None
        k = params.prompt_logprobs
        if step == 0 and k is not None:
            rest = self.prompt_token_ids[1:]
            prompt_logprobs = Logprobs(
                [[t, *range(1, k + 1)] for t in rest],
                [[-p / 10, *(-1.0 - j for j in range(k))] for p in range(1, len(rest) + 1)],
                [7] * len(rest))
        return EngineCoreOutput(cid, [token], finish, num_cached_tokens=NUM_CACHED_TOKENS,
                                logprobs=logprobs, queue_time_s=0.25 if step == 0 else 0.0,
                                prefill_time_s=0.5 if step == 0 else 0.0,
                                prompt_logprobs=prompt_logprobs)

    async def abort(self) -> None:
        self.engine.aborted.append(self.request_id)
        self.open.clear()
        self.aborted.set()


class FakeEngine:
    model_name = "smollm2"
    max_model_len = MAX_MODEL_LEN

    def __init__(self, tokenizer, step_delay: float = 0.0, hang: bool = False,
                 fail_at: int | None = None, fail_reason: FinishReason = FinishReason.ERROR,
                 fail_message: str = "engine 0 failed", ready: bool = True) -> None:
        self.tokenizer = tokenizer
        self.script = tokenizer.encode(SCRIPT_TEXT)
        self.step_delay, self.hang = step_delay, hang
        self.fail_at, self.fail_reason, self.fail_message = fail_at, fail_reason, fail_message
        self.ready = ready
        self.requests: list[tuple[str, list[int], SamplingParams, float | None]] = []
        self.aborted: list[str] = []
        self.stats = [SchedulerStats(2, 1, 0.5, 100, 40, 1), SchedulerStats(1, 0, 0.25, 10, 5, 0)]

    def generate(self, request_id, prompt_token_ids, params, deadline=None) -> FakeStream:
        self.requests.append((request_id, prompt_token_ids, params, deadline))
        return FakeStream(self, request_id, prompt_token_ids, params)

    def is_ready(self) -> bool:
        return self.ready

    def engine_statuses(self) -> list[EngineStatus]:
        state = EngineState.HEALTHY if self.ready else EngineState.RECOVERING
        return [EngineStatus(0, state, epoch=1), EngineStatus(1, EngineState.HEALTHY, epoch=1)]

    def scheduler_stats(self) -> list[SchedulerStats]:
        return self.stats


class FakeFaultHandler:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def apply(self, instruction: str, params: dict) -> str:
        self.calls.append(("apply", instruction, params))
        return "ft-1"

    def status(self) -> list[dict]:
        return [{"engine_id": 0, "state": "healthy", "epoch": 3}]

    def inject(self, kind: str, engine: int) -> None:
        self.calls.append(("inject", kind, engine))


@pytest.fixture
async def serve(tokenizer):
    clients: list[TestClient] = []

    async def start(config: ApiConfig | None = None, ft_handler=None,
                    handler_cancellation: bool = True, **engine_kwargs):
        engine = FakeEngine(tokenizer, **engine_kwargs)
        app = build_app(engine, config or ApiConfig(), ft_handler)
        client = TestClient(TestServer(app, handler_cancellation=handler_cancellation))
        await client.start_server()
        clients.append(client)
        return client, engine

    yield start
    for client in clients:
        await client.close()


def expected_text(tokenizer, num_tokens: int, shift: int = 0) -> str:
    script = tokenizer.encode(SCRIPT_TEXT)
    return tokenizer.decode([script[(k + shift) % len(script)] for k in range(num_tokens)])


async def sse_events(resp) -> list[Any]:
    """Parse an SSE body; asserts the framing (``data: ...`` blocks) and the final [DONE]."""
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    events = []
    for block in blocks[:-2]:
        assert block.startswith("data: ") and "\n" not in block
        events.append(json.loads(block[len("data: "):]))
    return events


async def wait_until(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------ completions


async def test_completion_exact_text_and_usage(serve, tokenizer):
    http, engine = await serve()
    resp = await http.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi there",
                                                    "max_tokens": 5, "temperature": 0})
    assert resp.status == 200
    body = await resp.json()
    num_prompt = len(tokenizer.encode("Hi there"))
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "text_completion" and body["model"] == "smollm2"
    assert body["choices"] == [{"index": 0, "text": expected_text(tokenizer, 5), "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 5,
                             "total_tokens": num_prompt + 5,
                             "prompt_tokens_details": {"cached_tokens": NUM_CACHED_TOKENS}}
    request_id, prompt_ids, params, deadline = engine.requests[0]
    assert request_id == body["id"] and prompt_ids == tokenizer.encode("Hi there")
    assert (params.temperature, params.max_tokens, deadline) == (0.0, 5, None)


async def test_completion_max_tokens_defaults_to_16_and_null_fills_the_context(serve, tokenizer):
    """Absent: OpenAI's legacy default of 16 (vLLM's too), cut to what the context leaves;
    an explicit null: the rest of the context."""
    http, engine = await serve()
    resp = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "top_k": 5,
                                                    "min_p": 0.1, "seed": 7, "ignore_eos": True,
                                                    "stop_token_ids": [2], "min_tokens": 2})
    assert resp.status == 200
    params = engine.requests[0][2]
    assert params.max_tokens == 16
    assert (params.top_k, params.min_p, params.seed, params.ignore_eos) == (5, 0.1, 7, True)
    assert (params.stop_token_ids, params.min_tokens) == ([2], 2)
    assert (await resp.json())["choices"][0]["text"] == expected_text(tokenizer, 16)

    resp = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": None})
    assert resp.status == 200 and engine.requests[1][2].max_tokens == MAX_MODEL_LEN - 3
    long_prompt = [1] * (MAX_MODEL_LEN - 5)
    resp = await http.post("/v1/completions", json={"prompt": long_prompt})
    assert resp.status == 200 and engine.requests[2][2].max_tokens == 5


async def test_completion_stop_string(serve, tokenizer):
    http, _ = await serve()
    resp = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 20,
                                                    "stop": " test"})
    choice = (await resp.json())["choices"][0]
    assert choice["text"] == " Hello world, this is a"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", " test")


async def test_completion_n2_and_batched_prompts(serve, tokenizer):
    http, engine = await serve()
    body = await (await http.post("/v1/completions",
                                  json={"prompt": "x", "n": 2, "max_tokens": 3})).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, expected_text(tokenizer, 3)), (1, expected_text(tokenizer, 3, shift=1))]
    assert body["usage"]["completion_tokens"] == 6
    body = await (await http.post("/v1/completions",
                                  json={"prompt": ["a", "b c"], "max_tokens": 2, "echo": True}
                                  )).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a" + expected_text(tokenizer, 2)), (1, "b c" + expected_text(tokenizer, 2))]
    assert [r[0] for r in engine.requests[1:]] == [body["id"] + "-0", body["id"] + "-1"]
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("a")) + len(
        tokenizer.encode("b c"))


async def test_completion_logprobs(serve, tokenizer):
    http, _ = await serve()
    body = await (await http.post("/v1/completions",
                                  json={"prompt": "x", "max_tokens": 2, "logprobs": 2})).json()
    script = tokenizer.encode(SCRIPT_TEXT)
    t0, t1 = tokenizer.decode([script[0]]), tokenizer.decode([script[1]])
    assert body["choices"][0]["logprobs"] == {
        "tokens": [t0, t1], "token_logprobs": [-0.25, -0.25],
        "top_logprobs": [{t0: -0.25, tokenizer.decode([script[0] + 1]): -1.25},
                         {t1: -0.25, tokenizer.decode([script[1] + 1]): -1.25}],
        "text_offset": [0, len(t0)]}


def fake_prompt_scores(tokenizer, prompt: str) -> tuple[list[int], list[str], list]:
    """The fake engine's prompt logprobs: prompt token p (p >= 1) scored -p/10."""
    ids = tokenizer.encode(prompt)
    return ids, [tokenizer.decode([t]) for t in ids], [None] + [-p / 10 for p in
                                                              range(1, len(ids))]


async def test_completion_echo_with_logprobs_scores_the_prompt_first(serve, tokenizer):
    http, engine = await serve()
    prompt = "The sky is blue"
    ids, texts, scores = fake_prompt_scores(tokenizer, prompt)
    body = await (await http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "logprobs": 1, "echo": True})).json()
    assert engine.requests[0][2].prompt_logprobs == 1
    choice = body["choices"][0]
    assert choice["text"] == prompt + expected_text(tokenizer, 2)
    lp = choice["logprobs"]
    script = tokenizer.encode(SCRIPT_TEXT)
    t0, t1 = tokenizer.decode([script[0]]), tokenizer.decode([script[1]])
    assert lp["tokens"] == [*texts, t0, t1]
    assert lp["token_logprobs"] == [*scores, -0.25, -0.25]
    # Top-1: the prompt token itself (rank 7 in the fake) and id 1 (rank 1).
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {texts[1]: -0.1, tokenizer.decode([1]): -1.0}
    assert lp["text_offset"] == [sum(len(t) for t in (texts + [t0])[:i])
                                 for i in range(len(ids) + 2)]
    assert "prompt_logprobs" not in choice  # vLLM's own field was not asked for
    # Streamed: the first chunk carries the echoed prompt and its scores.
    events = await sse_events(await http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "logprobs": 1, "echo": True, "stream": True}))
    first = events[0]["choices"][0]
    assert first["text"] == prompt + t0
    assert first["logprobs"]["token_logprobs"] == [*scores, -0.25]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


async def test_vllm_prompt_logprobs_on_completions_and_chat(serve, tokenizer):
    http, engine = await serve()
    ids, texts, scores = fake_prompt_scores(tokenizer, "Hello there")
    body = await (await http.post("/v1/completions", json={
        "prompt": "Hello there", "max_tokens": 1, "prompt_logprobs": 2})).json()
    assert engine.requests[0][2].prompt_logprobs == 2
    assert body["choices"][0]["logprobs"] is None
    expected = [None] + [{
        str(ids[p]): {"logprob": scores[p], "rank": 7, "decoded_token": texts[p]},
        "1": {"logprob": -1.0, "rank": 1, "decoded_token": tokenizer.decode([1])},
        "2": {"logprob": -2.0, "rank": 2, "decoded_token": tokenizer.decode([2])}}
        for p in range(1, len(ids))]
    assert body["choices"][0]["prompt_logprobs"] == expected
    chat = await (await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0})).json()
    prompt_ids = engine.requests[1][1]
    assert len(chat["prompt_logprobs"]) == len(prompt_ids) and chat["prompt_logprobs"][0] is None
    assert [list(e) for e in chat["prompt_logprobs"][1:]] == [[str(t)] for t in prompt_ids[1:]]
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                    {"prompt_logprobs": 1, "stream": True}):
            resp = await http.post(path, json={**body, **bad})
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "prompt_logprobs"


async def test_completion_stream_framing_and_usage(serve, tokenizer):
    http, _ = await serve()
    resp = await http.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status == 200
    events = await sse_events(resp)
    *chunks, usage = events
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(tokenizer, 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


# ------------------------------------------------------------------------------------- chat


async def test_chat_uses_template_and_answers(serve, tokenizer):
    http, engine = await serve()
    messages = [{"role": "user", "content": "hi"}]
    resp = await http.post("/v1/chat/completions", json={"messages": messages,
                                                         "max_completion_tokens": 3})
    body = await resp.json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert engine.requests[0][1] == tokenizer.encode(text, add_special_tokens=False)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                        "content": expected_text(tokenizer, 3)},
                                "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]


async def test_chat_stream_role_first_then_content(serve, tokenizer):
    http, _ = await serve()
    resp = await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 3, "n": 2, "stream": True})
    events = await sse_events(resp)
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant",
                                                               "content": ""}] * 2
    for index in (0, 1):
        mine = [e["choices"][0] for e in events[2:] if e["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == expected_text(
            tokenizer, 3, shift=index)
        assert mine[-1]["finish_reason"] == "length"


async def test_chat_logprobs_shape(serve, tokenizer):
    http, _ = await serve()
    body = await (await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
        "top_logprobs": 2})).json()
    token = tokenizer.encode(SCRIPT_TEXT)[0]
    t0, alt = tokenizer.decode([token]), tokenizer.decode([token + 1])

    def info(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    assert body["choices"][0]["logprobs"] == {"content": [
        {**info(t0, -0.25), "top_logprobs": [info(t0, -0.25), info(alt, -1.25)]}]}


# ----------------------------------------------------------------------------------- errors

_LONG = " ".join(["word"] * 80)


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop[0]", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [49152]}, 400, "prompt", None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": _LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens",
     None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0].type",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs", None),
    # The bounds on stop strings (ApiConfig.max_stop_strings, max_stop_len, ...).
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 65}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 257}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * 1025}, 400, "stop_token_ids",
     None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"07": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 100.5}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": True}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"x": 1}}, 400, "logit_bias", None),
    # What a decoder can raise beyond a syntax error.
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, 400, None, None),
    ("/v1/completions", b'{"prompt": "x", "n": 1' + b"0" * 40 + b"}", 400, "n", None),
    ("/v1/completions", b'{"prompt": "x", "seed": -1' + b"0" * 40 + b"}", 400, "seed", None),
    ("/v1/completions", b'{"prompt": [1' + b"0" * 40 + b"]}", 400, "prompt[0]", None),
    ("/v1/completions", {"prompt": [1, "x"]}, 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', 400, "temperature", None),
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, None, None),
    ("/v1/completions", b"\xff\xfe", 400, None, None),
])
async def test_bad_requests_never_reach_the_engine(serve, path, body, status, param, code):
    http, engine = await serve()
    if isinstance(body, bytes):
        resp = await http.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        resp = await http.post(path, json=body)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert error["message"]
    assert engine.requests == []


async def test_context_length_messages_name_the_limit(serve):
    http, _ = await serve()
    error = (await (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000}
                                    )).json())["error"]
    assert error["message"] == (
        "This model's maximum context length is 64 tokens. However, you requested 1001 tokens "
        "(1 in the prompt, 1000 in the completion). Please reduce the length of the prompt or "
        "completion.")
    error = (await (await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": _LONG}]})).json())["error"]
    assert error["message"].startswith("This model's maximum context length is 64 tokens. "
                                       "However, you requested ")
    assert "in the messages" in error["message"]


async def test_http_errors_in_openai_shape(serve):
    http, _ = await serve(ApiConfig(max_body_bytes=2048))
    resp = await http.post("/v1/completions", data=b'{"prompt": "' + b"x" * 4000 + b'"}',
                           headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"
    resp = await http.get("/v1/nothing")
    assert resp.status == 404
    assert (await resp.json())["error"]["type"] == "NotFoundError"
    resp = await http.get("/v1/completions")
    assert resp.status == 405 and resp.headers["Allow"] == "POST"
    assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_api_key_guards_v1_only(serve):
    http, _ = await serve(ApiConfig(api_key="sekrit"))
    resp = await http.get("/v1/models")
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert resp.status == 401
    resp = await http.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert resp.status == 200
    assert (await resp.json())["data"][0]["id"] == "smollm2"
    assert (await http.get("/health")).status == 200
    # A token that is not UTF-8 (schemathesis sends such bytes) is a wrong key, not a 500.
    resp = await http.get("/v1/models", headers={"Authorization": "Bearer \xcd\xfe"})
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "invalid_api_key"
    assert not is_authorized("Bearer \udccd\udcfe", "sekrit")
    assert is_authorized("Bearer s\u00e9krit", "s\u00e9krit")


async def test_engine_error_non_streamed(serve):
    http, _ = await serve(fail_at=1, ready=False, fail_message="deadline passed in recovery")
    resp = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["message"] == "deadline passed in recovery"
    http, _ = await serve(fail_at=0)
    resp = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert resp.status == 500
    assert (await resp.json())["error"] == {"message": "engine 0 failed",
                                            "type": "InternalServerError", "param": None,
                                            "code": "engine_error"}


@pytest.mark.parametrize("reason, code", [(FinishReason.ERROR, "engine_unavailable"),
                                          (FinishReason.ABORT, "request_aborted")])
async def test_engine_error_streamed(serve, tokenizer, reason, code):
    http, _ = await serve(fail_at=2, fail_reason=reason, ready=False, fail_message="gone")
    resp = await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
    events = await sse_events(resp)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == \
        expected_text(tokenizer, 2)
    assert events[-1] == {"error": {"message": "gone", "type": "ServiceUnavailableError",
                                    "param": None, "code": code}}


# ------------------------------------------------------------------------------- disconnects


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_disconnect_mid_stream_aborts(serve, handler_cancellation):
    # Without handler cancellation the next write fails instead; both paths must abort.
    http, engine = await serve(step_delay=0.02, handler_cancellation=handler_cancellation)
    resp = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50,
                                                    "stream": True})
    first = await resp.content.readline()
    assert first.startswith(b"data: {")
    resp.close()
    await wait_until(lambda: engine.aborted == [engine.requests[0][0]])


async def test_disconnect_non_streamed_aborts(serve):
    http, engine = await serve(hang=True)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(http.post("/v1/completions", json={"prompt": "x"}), 0.3)
    await wait_until(lambda: engine.aborted == [engine.requests[0][0]])


async def test_deadline_from_header_and_body(serve):
    http, engine = await serve()
    before = time.time()
    await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                    headers={"X-Request-Timeout": "5"})
    await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "timeout": 2.5})
    assert before + 5 <= engine.requests[0][3] <= time.time() + 5
    assert before + 2.5 <= engine.requests[1][3] <= time.time() + 2.5
    resp = await http.post("/v1/completions", json={"prompt": "x"},
                           headers={"X-Request-Timeout": "soon"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "timeout"


async def test_stalled_body_gets_408(serve):
    http, engine = await serve(ApiConfig(http_idle_timeout_s=0.3))
    reader, writer = await asyncio.open_connection(http.host, http.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()
    assert engine.requests == []


async def test_client_that_stops_reading_its_stream_is_dropped(serve):
    http, engine = await serve(ApiConfig(http_idle_timeout_s=0.3))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few chunks
    sock.connect((http.host, http.port))
    _, writer = await asyncio.open_connection(sock=sock)
    body = json.dumps({"prompt": ["x"] * 64, "n": 16, "max_tokens": 60, "stream": True,
                       "logprobs": 20}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    # Never read: the server's writes stall, and after the idle timeout it gives up.
    await wait_until(lambda: len(engine.aborted) == 64, timeout=20)
    writer.close()


# -------------------------------------------------------------------- health, metrics, docs


async def test_health_and_version(serve):
    http, engine = await serve()
    resp = await http.get("/health")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}
    engine.ready = False
    resp = await http.get("/health")
    assert resp.status == 503
    assert (await resp.json())["error"]["message"] == (
        "Not every engine is healthy (engine 0: recovering, engine 1: healthy)")
    assert (await (await http.get("/version")).json()) == {"version": "0.1.0"}


async def test_draining_refuses_new_requests(serve):
    http, engine = await serve()
    http.server.app[STATE_KEY].is_draining = True
    resp = await http.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["code"] == "server_draining"
    assert (await http.get("/health")).status == 503
    assert engine.requests == []


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(1))


@pytest.mark.parametrize("prefix", ["bastion", "vllm"])
async def test_metrics(serve, tokenizer, prefix):
    http, engine = await serve(ApiConfig(metrics_prefix=prefix))
    engine.stats[0].iteration_tokens = [7, 300]
    engine.stats[0].num_gpu_blocks = engine.stats[1].num_gpu_blocks = 182
    http.server.app[METRICS_KEY].set_cache_config(CacheConfig(block_size=32))
    await http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 4, "n": 2})
    text = await (await http.get("/metrics")).text()
    num_prompt_tokens = len(tokenizer.encode("Hi there"))
    p = prefix
    assert _sample(text, f"{p}:num_requests_running") == 3
    assert _sample(text, f"{p}:num_requests_waiting") == 1
    assert _sample(text, f"{p}:kv_cache_usage_perc") == 0.375
    assert _sample(text, f"{p}:gpu_cache_usage_perc") == 0.375  # vLLM's older name
    assert _sample(text, f"{p}:prefix_cache_queries_total") == 110
    assert _sample(text, f"{p}:prefix_cache_hits_total") == 45
    assert _sample(text, f"{p}:num_preemptions_total") == 1
    assert _sample(text, f"{p}:prompt_tokens_total") == num_prompt_tokens
    assert _sample(text, f"{p}:generation_tokens_total") == 8
    assert f'{p}:request_success_total{{finished_reason="length",model_name="smollm2"}} 2.0' \
        in text
    # One observation per request, per choice or per token, as vLLM counts them.
    counts = {"time_to_first_token_seconds": 2, "inter_token_latency_seconds": 6,
              "time_per_output_token_seconds": 6, "request_time_per_output_token_seconds": 2,
              "e2e_request_latency_seconds": 1, "request_queue_time_seconds": 2,
              "request_prefill_time_seconds": 2, "request_decode_time_seconds": 2,
              "request_inference_time_seconds": 2, "request_prompt_tokens": 1,
              "request_generation_tokens": 2, "request_max_num_generation_tokens": 1,
              "request_params_n": 1, "request_params_max_tokens": 1,
              "iteration_tokens_total": 2}
    for name, count in counts.items():
        assert _sample(text, f"{p}:{name}_count") == count, name
    assert _sample(text, f"{p}:request_queue_time_seconds_sum") == 0.5
    assert _sample(text, f"{p}:request_prefill_time_seconds_sum") == 1.0
    assert _sample(text, f"{p}:request_prompt_tokens_sum") == num_prompt_tokens
    assert _sample(text, f"{p}:request_generation_tokens_sum") == 8
    assert _sample(text, f"{p}:request_params_n_sum") == 2
    assert _sample(text, f"{p}:request_params_max_tokens_sum") == 4
    assert _sample(text, f"{p}:iteration_tokens_total_sum") == 307
    assert f'{p}:iteration_tokens_total_bucket{{le="8.0",model_name="smollm2"}} 1.0' in text
    info = re.search(rf"^{p}:cache_config_info{{(.*)}} 1.0$", text, re.MULTILINE)
    assert info and 'block_size="32"' in info[1] and 'num_gpu_blocks="182"' in info[1]
    assert 'cache_dtype="auto"' in info[1] and 'enable_prefix_caching="True"' in info[1]
    other = "vllm" if prefix == "bastion" else "bastion"
    assert f"{other}:" not in text
    # A second scrape of the same engine reports adds nothing to the counters.
    text = await (await http.get("/metrics")).text()
    assert _sample(text, f"{p}:prefix_cache_queries_total") == 110
    assert _sample(text, f"{p}:iteration_tokens_total_count") == 2


def test_metrics_prefix_must_be_a_prometheus_name():
    with pytest.raises(ApiConfigError, match="metrics_prefix must be a Prometheus name"):
        ApiConfig(metrics_prefix="vllm:x")


async def test_model_aliases_are_accepted_and_answers_carry_the_first_name(serve):
    http, _ = await serve(ApiConfig(served_model_name="SmolLM2-135M-Instruct",
                                    model_aliases=("SmolLM2-135M-Instruct.Q4_1.gguf",)))
    models = (await (await http.get("/v1/models")).json())["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct",
                                         "SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert {m["root"] for m in models} == {"SmolLM2-135M-Instruct"}
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"):
        resp = await http.post("/v1/completions", json={"model": name, "prompt": "x",
                                                        "max_tokens": 1})
        assert resp.status == 200 and (await resp.json())["model"] == "SmolLM2-135M-Instruct"
    resp = await http.post("/v1/completions", json={"model": "smollm2", "prompt": "x"})
    assert resp.status == 404


async def test_generation_defaults_fill_only_what_a_request_leaves_out(serve):
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5}
    http, engine = await serve(ApiConfig(generation_defaults=defaults))
    await http.post("/v1/completions", json={"prompt": "x"})
    await http.post("/v1/completions", json={"prompt": "x", "temperature": 0.0, "top_k": 0,
                                             "max_tokens": 2})
    await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3})
    first, second, chat = (params for _, _, params, _ in engine.requests)
    assert (first.temperature, first.top_k, first.max_tokens) == (0.6, 20, 5)
    assert (second.temperature, second.top_k, second.max_tokens) == (0.0, 0, 2)
    assert (chat.temperature, chat.max_tokens) == (0.6, 3)


async def test_metrics_observe_counts_each_report_once(serve):
    http, engine = await serve()
    metrics = http.server.app[METRICS_KEY]
    report = SchedulerStats(prefix_cache_queries=7)
    metrics.observe_scheduler_stats(0, report)
    metrics.observe_scheduler_stats(0, report)
    engine.stats = [report]
    text = await (await http.get("/metrics")).text()
    assert _sample(text, "bastion:prefix_cache_queries_total") == 7


async def test_openapi_lists_every_route(serve):
    http, _ = await serve()
    doc = await (await http.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    routes = {(r.method.lower(), r.resource.canonical) for r in http.server.app.router.routes()
              if r.method != "HEAD"}
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == routes
    content = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    assert content["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert set(doc["components"]["schemas"]["CompletionRequest"]["properties"]) >= {
        "prompt", "max_tokens", "logprobs", "stream", "stop", "n"}
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["security"] == [{"bearer": []}] and "security" not in doc["paths"]["/health"]["get"]
    assert chat["parameters"][0]["name"] == "X-Request-Timeout"
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"add_generation_prompt", "tools", "response_format", "logit_bias"} <= set(props)
    assert props["n"]["anyOf"][0]["maximum"] == ApiConfig().max_n


@pytest.mark.parametrize("path, body, schema", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 1, "echo": True},
     "Completion"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "prompt_logprobs": 1, "n": 2},
     "Completion"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 0},
     "ChatCompletion"),
    ("/v1/chat/completions", {"messages": []}, "ErrorResponse"),
    ("/tokenize", {"prompt": "Hi", "return_token_strs": True}, "TokenizeResponse"),
    ("/detokenize", {"tokens": [1, 2]}, "DetokenizeResponse"),
])
async def test_responses_match_the_openapi_document(serve, path, body, schema):
    import jsonschema

    http, _ = await serve()
    doc = await (await http.get("/openapi.json")).json()
    answer = await (await http.post(path, json=body)).json()
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{schema}", "components": doc["components"]})
    errors = [e.message for e in validator.iter_errors(answer)]
    assert not errors, errors
    assert not validator.is_valid({})  # every documented body has required fields


# --------------------------------------------------------------------------- fault tolerance


async def test_fault_tolerance_routes(serve):
    handler = FakeFaultHandler()
    http, _ = await serve(ApiConfig(admin_key="root"), ft_handler=handler)
    auth = {"Authorization": "Bearer root"}
    resp = await http.post("/fault_tolerance/apply", json={"instruction": "retry"})
    assert resp.status == 401
    resp = await http.post("/fault_tolerance/apply", json={"instruction": "rm -rf"}, headers=auth)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "instruction"
    resp = await http.post("/fault_tolerance/apply", json={"instruction": "reinit",
                                                           "params": {}},
                           headers=auth)
    assert resp.status == 202 and (await resp.json())["request_id"] == "ft-1"
    assert handler.calls == [("apply", "reinit", {})]
    resp = await http.get("/fault_tolerance/status", headers=auth)
    assert (await resp.json()) == {"engines": [{"engine_id": 0, "state": "healthy", "epoch": 3}]}
    resp = await http.post("/fault_tolerance/inject", json={"kind": "raise"}, headers=auth)
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "not_found"
    assert len(handler.calls) == 1


async def test_fault_injection_when_enabled(serve):
    handler = FakeFaultHandler()
    http, _ = await serve(ApiConfig(enable_fault_injection=True), ft_handler=handler)
    resp = await http.post("/fault_tolerance/inject", json={"kind": "nuke"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "kind"
    resp = await http.post("/fault_tolerance/inject", json={"kind": "hang", "engine": 1})
    assert resp.status == 200
    assert handler.calls == [("inject", "hang", 1)]


def own_non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (connecting a UDP socket sends
    nothing; it only picks the interface a packet would leave by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.mark.parametrize("remote, expected", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.1", False), ("192.0.2.2", False), ("::ffff:10.0.0.1", False), ("fd00::2", False),
    ("", False), (None, False), ("not-an-ip", False)])
def test_is_loopback(remote, expected):
    assert is_loopback(remote) is expected


async def test_control_routes_answer_only_loopback_without_an_admin_key(tokenizer):
    address = own_non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for config, headers, allowed in ((ApiConfig(), {}, False),
                                     (ApiConfig(api_key="k"), {"Authorization": "Bearer k"},
                                      False),
                                     (ApiConfig(admin_key="a"), {"Authorization": "Bearer a"},
                                      True)):
        handler = FakeFaultHandler()
        app = build_app(FakeEngine(tokenizer), config, handler)
        async with TestClient(TestServer(app, host=address)) as http:
            resp = await http.post("/fault_tolerance/apply", json={"instruction": "retry"},
                                   headers=headers)
            status = await http.get("/fault_tolerance/status", headers=headers)
            models = await http.get("/v1/models", headers=headers)
            assert models.status == 200
            if allowed:
                assert (resp.status, status.status) == (202, 200)
            else:
                assert (resp.status, status.status) == (403, 403)
                assert (await resp.json())["error"]["code"] == "admin_key_required"
                assert handler.calls == []


async def test_fault_tolerance_bodies_are_strict(serve):
    handler = FakeFaultHandler()
    http, _ = await serve(ApiConfig(enable_fault_injection=True), ft_handler=handler)
    for body, param in (({"instruction": "retry", "params": None}, "params"),
                        ({"instruction": "retry", "params": {"engine": 0}}, "params"),
                        ({"instruction": "retry", "params": []}, "params"),
                        ({"instruction": "retry", "extra": 1}, "extra"),
                        ({"instruction": ["retry"]}, "instruction"),
                        ({}, "instruction")):
        resp = await http.post("/fault_tolerance/apply", json=body)
        assert resp.status == 400, body
        assert (await resp.json())["error"]["param"] == param, body
    for body, param in (({"kind": "raise", "engine": "0"}, "engine"),
                        ({"kind": "raise", "engine": True}, "engine"),
                        ({"kind": "raise", "engine": 10**30}, "engine"),
                        ({"kind": "raise", "target": 0}, "target")):
        resp = await http.post("/fault_tolerance/inject", json=body)
        assert resp.status == 400, body
        assert (await resp.json())["error"]["param"] == param, body
    resp = await http.post("/fault_tolerance/apply", data=b'{"instruction": "retry"}',
                           headers={"Content-Type": "text/plain"})
    assert resp.status == 415
    assert handler.calls == []
    resp = await http.post("/fault_tolerance/apply", json={"instruction": "retry"})
    assert resp.status == 202 and handler.calls == [("apply", "retry", {})]


async def test_fault_tolerance_status_without_handler(serve):
    http, _ = await serve()
    body = await (await http.get("/fault_tolerance/status")).json()
    assert body["engines"][0] == {"engine_id": 0, "state": "healthy", "epoch": 1,
                                  "fault_info": None, "last_action": None,
                                  "last_action_id": None, "last_action_error": None}
    resp = await http.post("/fault_tolerance/apply", json={"instruction": "retry"})
    assert resp.status == 503


# ------------------------------------------------------------------------ the openai client


async def test_openai_client_round_trip(serve, tokenizer):
    import openai

    http, _ = await serve(ApiConfig(api_key="k"))
    client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="k", max_retries=0)
    try:
        completion = await client.completions.create(model="smollm2", prompt="x", max_tokens=3)
        assert completion.choices[0].text == expected_text(tokenizer, 3)
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            expected_text(tokenizer, 4)
        assert chunks[-1].usage.completion_tokens == 4
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="gpt-4", prompt="x")
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="smollm2", prompt="x", temperature=-1)
        bad_key = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="nope",
                                     max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad_key.models.list()
        await bad_key.close()
    finally:
        await client.close()
