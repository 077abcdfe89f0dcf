"""``bastion serve`` end to end: real processes on the CPU, driven by the official ``openai`` client.

One server (with an API key) serves the whole module; its teardown is itself a test of SIGTERM
(exit code 0, no ``bastion::`` process left, runtime dir removed). Greedy outputs are compared
token for token (as text) against the offline ``LLM`` running in this process.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from serve_fixture import SMALL_SERVER_ARGS, ServerProcess, bastion_titles, descendants

from bastion import LLM, SamplingParams
from bastion.api.tool_parsers import TOOL_PARSERS

API_KEY = "e2e-secret"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
]
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
MAX_TOKENS = 16
# SmolLM2's template plus tools (it renders every conversation without tools exactly as the
# GGUF's own, so the other tests compare against the offline LLM unchanged).
TOOL_TEMPLATE = (Path(__file__).parents[1] / "configs" / "chat_templates"
                 / "tool_chat_template_smollm2_hermes.jinja")
TOOL_ARGS = ("--chat-template", str(TOOL_TEMPLATE), "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes")
# A sentinel (bastion::sentinel-0) may run beside these; every bastion:: child must die.
EXPECTED_CHILDREN = {"bastion::engine-0", "bastion::worker-0-0"}


# NOTE: one torch thread per process. On a small shared CPU, two OpenMP threads per process
# competing with the other processes (API, engine, sentinel, this test) make every op wait at
# barriers for a descheduled thread: a decode step measured 19x slower, long enough for the
# sentinel to report a false hang.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> None:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    srv = ServerProcess((*SMALL_SERVER_ARGS, *TOOL_ARGS), api_key=API_KEY,
                        workdir=str(tmp_path_factory.mktemp("serve")), env=SERVER_ENV)
    try:
        srv.wait_healthy(timeout_s=120)
        tree = descendants(srv.pid)
        assert EXPECTED_CHILDREN <= set(bastion_titles(tree).values())
        assert len(srv.runtime_dirs()) == 1
    except BaseException:
        srv.kill_tree()
        raise
    yield srv
    # SIGTERM with nothing in flight: exit 0, no process left, runtime dir removed.
    code = srv.stop(signal.SIGTERM, timeout_s=60)
    left, runtime_dirs = bastion_titles(tree), srv.runtime_dirs()
    srv.kill_tree()
    assert code == 0, srv.log_tail()
    assert not left, f"processes left after SIGTERM: {left}"
    assert runtime_dirs == [], f"runtime dir not removed: {runtime_dirs}"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def llm(embedded_llm: LLM) -> LLM:
    return embedded_llm  # the server's settings: float32 on the CPU, max_model_len 512


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference_texts(llm: LLM) -> list[str]:
    return [out.outputs[0].text for out in llm.generate(PROMPTS, greedy())]


@pytest.fixture(scope="module")
def reference_chat(llm: LLM) -> str:
    return llm.chat(CHAT, greedy(24))[0].outputs[0].text


IGNORE_EOS = {"ignore_eos": True}


def test_list_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    # The served name first; the GGUF file name (the name earlier versions served) and the
    # Hugging Face id stay accepted.
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                      "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert models[0].object == "model"


def test_completion_greedy_matches_offline(client: openai.OpenAI, model_name: str,
                                           reference_texts: list[str]) -> None:
    resp = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body=IGNORE_EOS)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == reference_texts[0]
    assert resp.choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream(client: openai.OpenAI, model_name: str,
                                       reference_chat: str) -> None:
    full = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24,
                                          temperature=0, extra_body=IGNORE_EOS)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == reference_chat
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 extra_body=IGNORE_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference_chat
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_n_two_choices(client: openai.OpenAI, model_name: str,
                       reference_texts: list[str]) -> None:
    resp = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                     temperature=0, n=2, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    # Greedy: both choices are the reference continuation.
    assert [c.text for c in resp.choices] == [reference_texts[1]] * 2
    assert resp.usage.completion_tokens == 2 * MAX_TOKENS


def test_stop_string(client: openai.OpenAI, model_name: str, reference_texts: list[str]) -> None:
    ref = reference_texts[2]
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    assert stop.strip(), f"pick another stop string from {ref!r}"
    expected = ref[:ref.index(stop)]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                     temperature=0, stop=[stop], extra_body=IGNORE_EOS)
    choice = resp.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop


def test_completion_logprobs(client: openai.OpenAI, model_name: str, llm: LLM) -> None:
    ref = llm.generate(PROMPTS[0], greedy(8, logprobs=2))[0].outputs[0]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=8,
                                     temperature=0, logprobs=2, extra_body=IGNORE_EOS)
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text == ref.text
    assert len(lp.token_logprobs) == 8 and len(lp.top_logprobs) == 8
    for i, (entry, top) in enumerate(zip(ref.logprobs, lp.top_logprobs)):
        # Greedy: the sampled token is the top-1, so top-2 holds exactly two entries.
        assert len(top) == 2
        assert lp.token_logprobs[i] == pytest.approx(max(top.values()))
        expected = sorted(e.logprob for e in entry.values())
        assert sorted(top.values()) == pytest.approx(expected, abs=1e-4)
    assert lp.text_offset[0] == 0


def test_chat_logprobs(client: openai.OpenAI, model_name: str, reference_chat: str) -> None:
    resp = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body=IGNORE_EOS)
    content = resp.choices[0].logprobs.content
    assert len(content) == 8 == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    assert reference_chat.startswith(resp.choices[0].message.content)
    for tok in content:
        assert len(tok.top_logprobs) == 2
        assert tok.top_logprobs[0].token == tok.token
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob)
        assert tok.top_logprobs[1].logprob <= tok.logprob <= 0.0


def test_logit_bias_steers_greedy_tokens(client: openai.OpenAI, model_name: str,
                                         llm: LLM) -> None:
    # The unbiased greedy token and the runner-up, from the offline model's top-2 logprobs.
    entry = llm.generate(PROMPTS[0], greedy(1, logprobs=2))[0].outputs[0].logprobs[0]
    first, second = (tok for tok, _ in sorted(entry.items(), key=lambda kv: kv[1].rank))
    resp = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=1,
                                     temperature=0, logit_bias={str(first): -100},
                                     extra_body=IGNORE_EOS)
    assert resp.choices[0].text == llm.tokenizer.decode([second])
    # +100 on an unlikely id makes it every output token, on both routes.
    chosen = llm.tokenizer.encode(" banana")[0]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=4,
                                     temperature=0, logit_bias={str(chosen): 100},
                                     extra_body=IGNORE_EOS)
    assert resp.choices[0].text == llm.tokenizer.decode([chosen] * 4)
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=3,
                                          temperature=0, logit_bias={str(chosen): 100},
                                          extra_body=IGNORE_EOS)
    assert chat.choices[0].message.content == llm.tokenizer.decode([chosen] * 3)
    with pytest.raises(openai.BadRequestError, match="logit_bias") as err:
        client.completions.create(model=model_name, prompt="hi", logit_bias={"1": 101})
    assert err.value.body["param"] == "logit_bias"


def test_prompt_logprobs_cross_the_processes(client: openai.OpenAI, model_name: str,
                                             llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[2])
    ref = llm.generate(PROMPTS[2], greedy(1, prompt_logprobs=1))[0].prompt_logprobs
    expected = [None] + [entry[ids[p]].logprob for p, entry in enumerate(ref[1:], 1)]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=1,
                                     temperature=0, logprobs=1, echo=True,
                                     extra_body=IGNORE_EOS)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith(PROMPTS[2])
    assert lp.token_logprobs[:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert lp.tokens[:len(ids)] == [llm.tokenizer.decode([t]) for t in ids]
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1,
                                          temperature=0,
                                          extra_body={**IGNORE_EOS, "prompt_logprobs": 0})
    prompt_logprobs = chat.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(chat_ids)
    assert [list(e) for e in prompt_logprobs[1:]] == [[str(t)] for t in chat_ids[1:]]


def test_usage(client: openai.OpenAI, model_name: str, llm: LLM) -> None:
    num_prompt = len(llm.tokenizer.encode(PROMPTS[3]))
    resp = client.completions.create(model=model_name, prompt=PROMPTS[3], max_tokens=5,
                                     temperature=0, extra_body=IGNORE_EOS)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens,
            resp.usage.total_tokens) == (num_prompt, 5, num_prompt + 5)
    chunks = list(client.completions.create(
        model=model_name, prompt=PROMPTS[3], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (num_prompt, 5)
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == resp.choices[0].text


def test_client_errors(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        client.completions.create(model=model_name, prompt=" hello" * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model_name, prompt="hi", temperature=-1.0)
    with pytest.raises(openai.BadRequestError, match="n must be at most"):
        client.completions.create(model=model_name, prompt="hi", n=100)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model_name, messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi")
    wrong = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # The server is unaffected by all of the above.
    resp = client.completions.create(model=model_name, prompt="hi", max_tokens=2)
    assert resp.usage.completion_tokens >= 1


def test_concurrent_streams_match_offline(server: ServerProcess, model_name: str,
                                          reference_texts: list[str]) -> None:
    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await aclient.completions.create(model=model_name, prompt=prompt,
                                                  max_tokens=MAX_TOKENS, temperature=0,
                                                  stream=True, extra_body=IGNORE_EOS)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % len(PROMPTS)])
                                          for i in range(64)))

    results = asyncio.run(main())
    expected = [(reference_texts[i % len(PROMPTS)], "length") for i in range(64)]
    assert results == expected


def test_engine_timings_and_cache_config_reach_metrics(client: openai.OpenAI,
                                                      server: ServerProcess) -> None:
    client.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt=PROMPTS[1],
                              max_tokens=3, temperature=0)
    m = server.metrics()
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "iteration_tokens_total"):
        assert m[f"bastion:{name}_count"] >= 1, name
    assert m["bastion:request_prefill_time_seconds_sum"] > 0
    _, body = server.get("/metrics")
    info = re.search(r"^bastion:cache_config_info{(.*)} 1.0$", body.decode(), re.MULTILINE)
    assert info and 'num_gpu_blocks="364"' in info[1] and 'block_size="16"' in info[1]


def _wait_for_idle_engine(server: ServerProcess, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["bastion:num_requests_running"] == 0 and m["bastion:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_disconnect_aborts_and_frees_blocks(client: openai.OpenAI, model_name: str,
                                            server: ServerProcess) -> None:
    stream = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=400,
                                       temperature=0, stream=True, extra_body=IGNORE_EOS)
    for num_chunks, _ in enumerate(stream, 1):
        if num_chunks == 3:
            break
    busy = server.metrics()
    assert busy["bastion:num_requests_running"] == 1
    assert busy["bastion:kv_cache_usage_perc"] > 0
    stream.close()
    idle = _wait_for_idle_engine(server, timeout_s=10)
    assert idle["bastion:num_requests_running"] == 0
    assert idle["bastion:kv_cache_usage_perc"] == 0
    assert idle["bastion:num_requests_waiting"] == 0


# ---------------------------------------------------------------------------- tool calling

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "The forecast for the next days",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TOOL_MAX_TOKENS = 40
# One worked example is enough for the 135M model to answer in the hermes format.
TOOL_CHAT = [
    {"role": "system", "content": "You only answer with tool calls."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "user", "content": "Weather in Tokyo?"},
]


@pytest.fixture(scope="module")
def tool_reference(llm: LLM) -> tuple[str, str]:
    """Greedy text and finish reason offline for TOOL_CHAT with WEATHER, rendered with the
    tool template (history arguments as objects, as the server hands them to the template)."""
    history = json.loads(json.dumps(TOOL_CHAT))
    history[2]["content"] = ""
    history[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    text = llm.tokenizer.apply_chat_template(history, tools=[WEATHER], tokenize=False,
                                             add_generation_prompt=True,
                                             chat_template=TOOL_TEMPLATE.read_text())
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0,
                                                                  max_tokens=TOOL_MAX_TOKENS))
    return out[0].outputs[0].text, out[0].outputs[0].finish_reason


def joined_stream(chunks) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a streamed answer."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_choice_auto_parses_the_models_call(client: openai.OpenAI, model_name: str,
                                                 tool_reference: tuple[str, str]) -> None:
    text, _ = tool_reference
    expected = TOOL_PARSERS["hermes"]().extract(text)
    # The recorded answer: the worked example steers the model into a call.
    assert [(c.name, json.loads(c.arguments)) for c in expected.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})]
    resp = client.chat.completions.create(model=model_name, messages=TOOL_CHAT, tools=[WEATHER],
                                          temperature=0, max_tokens=TOOL_MAX_TOKENS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == expected.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(c.name, c.arguments) for c in expected.tool_calls]
    assert all(c.id.startswith("call_") and c.type == "function"
               for c in choice.message.tool_calls)
    chunks = list(client.chat.completions.create(model=model_name, messages=TOOL_CHAT,
                                                 tools=[WEATHER], temperature=0,
                                                 max_tokens=TOOL_MAX_TOKENS, stream=True))
    assert joined_stream(chunks) == (expected.content,
                                     [(c.name, c.arguments) for c in expected.tool_calls],
                                     "tool_calls")


def test_tool_choice_none_ignores_tools(client: openai.OpenAI, model_name: str,
                                        tool_reference: tuple[str, str]) -> None:
    text, finish = tool_reference
    resp = client.chat.completions.create(model=model_name, messages=TOOL_CHAT, tools=[WEATHER],
                                          tool_choice="none", temperature=0,
                                          max_tokens=TOOL_MAX_TOKENS)
    assert resp.choices[0].message.content == text  # the call's text, unparsed
    assert not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == finish == "stop"


try:
    import bastion.core.structured_output  # noqa: F401
    NO_STRUCTURED_OUTPUTS = None
except ImportError as exc:
    NO_STRUCTURED_OUTPUTS = (f"tool_choice required/named need the engine's structured outputs "
                             f"(issue #21, branch struct), absent here: {exc}")
needs_structured_outputs = pytest.mark.skipif(NO_STRUCTURED_OUTPUTS is not None,
                                              reason=str(NO_STRUCTURED_OUTPUTS))


def assert_valid_calls(calls: list[tuple[str, str]], tools: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


@needs_structured_outputs
@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True), ({"type": "function", "function": {"name": "get_forecast"}}, False)],
    ids=["required", "named"])
def test_forced_tool_choice_gives_arguments_that_match(client: openai.OpenAI, model_name: str,
                                                       tool_choice, parallel: bool) -> None:
    tools = [WEATHER, FORECAST]
    request = {"model": model_name, "messages": TOOL_CHAT, "tools": tools,
               "tool_choice": tool_choice, "parallel_tool_calls": parallel, "temperature": 0,
               "max_tokens": 120}
    resp = client.chat.completions.create(**request)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert_valid_calls(calls, tools)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_forecast"]
    if not parallel:
        assert len(calls) == 1
    content, streamed, finish = joined_stream(client.chat.completions.create(**request,
                                                                             stream=True))
    assert (streamed, finish) == (calls, "tool_calls")
    assert content == choice.message.content
