"""What completions and chat share: submitting to the engine client, merging the deltas of a
batch of prompts, answering as one JSON body or as server-sent events, and aborting the engine
requests of a client that went away.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import HttpVersion11, web

from bastion.api.config import CONFIG_KEY, STATE_KEY
from bastion.api.connections import with_idle_timeout
from bastion.api.engine_protocol import EngineClient, RequestStream
from bastion.api.errors import ApiError, bad_request, error_body
from bastion.api.metrics import ApiMetrics, RequestTracker
from bastion.api.protocol import GenerateRequest
from bastion.core.output_processor import SeqDelta
from bastion.core.outputs import TokenLogprob

logger = logging.getLogger(__name__)

_SSE_DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


@dataclass
class Choice:
    """One choice as it accumulates (``index`` counts over all prompts: prompt * n + i)."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None


class Run:
    """One client request in flight: one engine stream per prompt, and its choices."""

    def __init__(self, request_id: str, model: str, req: GenerateRequest,
                 streams: list[RequestStream], tracker: RequestTracker, tokenizer: Any) -> None:
        self.request_id = request_id
        self.tokenizer = tokenizer
        self.model = model
        self.created = int(time.time())
        self.req = req
        self.streams = streams
        self.tracker = tracker
        self.choices = [Choice(p * req.n + i, p) for p in range(len(req.prompts))
                        for i in range(req.n)]
        self._finished_streams: set[int] = set()

    async def deltas(self) -> AsyncIterator[tuple[Choice, SeqDelta]]:
        """Every delta of every prompt, applied to its choice before it is yielded."""
        async for prompt_index, delta in self._merged():
            choice = self.choices[prompt_index * self.req.n + delta.index]
            choice.text += delta.text
            choice.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            if delta.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            self.tracker.on_delta(choice.index, delta)
            yield choice, delta
        self.tracker.on_finish(self.num_prompt_tokens)

    async def _merged(self) -> AsyncIterator[tuple[int, SeqDelta]]:
        if len(self.streams) == 1:
            # aclosing: a reader that stops early closes the stream's iterator now, not
            # whenever the garbage collector finalizes it.
            async with contextlib.aclosing(aiter(self.streams[0])) as deltas:
                async for delta in deltas:
                    yield 0, delta
            self._finished_streams.add(0)
            return
        queue: asyncio.Queue[tuple[int, SeqDelta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait((index, delta))
            except Exception as exc:  # surfaced to the handler, which answers 500
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            num_open = len(tasks)
            while num_open:
                index, item = await queue.get()
                if item is None:
                    num_open -= 1
                    self._finished_streams.add(index)
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def abort(self) -> None:
        """Abort every engine request that has not finished; safe to call more than once."""
        for index, stream in enumerate(self.streams):
            if index not in self._finished_streams:
                self._finished_streams.add(index)
                await stream.abort()

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.req.prompts)

    def usage(self) -> dict[str, Any]:
        num_completion_tokens = sum(len(c.token_ids) for c in self.choices)
        num_cached_tokens = sum(s.num_cached_tokens for s in self.streams)
        return {"prompt_tokens": self.num_prompt_tokens,
                "completion_tokens": num_completion_tokens,
                "total_tokens": self.num_prompt_tokens + num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def apply_generation_defaults(body: dict, defaults: dict[str, Any]) -> dict:
    """``body`` with the model's sampling defaults (``--generation-config``) for the fields it
    leaves out; a field it sends, even as null, is its own. A chat request's
    ``max_completion_tokens`` counts as its ``max_tokens``."""
    if not defaults:
        return body
    missing = {k: v for k, v in defaults.items() if k not in body}
    if "max_completion_tokens" in body:
        missing.pop("max_tokens", None)
    return {**missing, **body}
# NOTE: one thread, on purpose: it is enough to keep the event loop free (the tokenizers'
# encode releases the GIL), and a Hugging Face fast tokenizer must not be driven from several
# threads at once (its truncation state is shared).
_PARSE_EXECUTOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bastion-parse")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run CPU-heavy request preparation (chat template, tokenization: seconds for a 4 MiB
    prompt) off the event loop, so /health and other requests' chunks never wait for it."""
    return await asyncio.get_running_loop().run_in_executor(_PARSE_EXECUTOR, fn, *args)


def reject_if_draining(app: web.Application) -> None:
    if app[STATE_KEY].is_draining:
        raise ApiError(503, "The server is shutting down and accepts no new requests",
                       code="server_draining", headers={"Retry-After": "1"})


async def submit(client: EngineClient, metrics: ApiMetrics, request_id: str, model: str,
                 req: GenerateRequest) -> Run:
    """Hand every prompt to the engine client; a batch gets ids ``{request_id}-{p}``."""
    tracker = metrics.track_request(req.params)
    streams: list[RequestStream] = []
    for p, (prompt, params) in enumerate(zip(req.prompts, req.params)):
        engine_request_id = request_id if len(req.prompts) == 1 else f"{request_id}-{p}"
        try:
            # The keyword only for adapters: engine clients without LoRA keep their signature.
            lora = {} if req.lora_request is None else {"lora_request": req.lora_request}
            streams.append(client.generate(engine_request_id, prompt.token_ids, params,
                                           req.deadline, **lora))
        except Exception as exc:
            logger.exception("engine client refused request %s", engine_request_id)
            for stream in streams:
                await stream.abort()
            raise ApiError(503, f"The engine could not accept the request: {exc}",
                           code="engine_unavailable", headers={"Retry-After": "1"}) from None
    return Run(request_id, model, req, streams, tracker, client.tokenizer)


# Finish reasons that fail the whole request.
FAILED = ("error", "abort", "timeout", "rejected")


def failure(client: EngineClient, delta: SeqDelta) -> ApiError:
    """The error for a choice that ended in ``error``, ``abort``, ``timeout`` or ``rejected``:
    400 for input the engine found it cannot serve, 504 for a passed deadline, 503 while the
    engines are not all healthy (a recovery case: retrying later can work), 500 otherwise."""
    if delta.finish_reason == "rejected":
        return bad_request(delta.error or "The request cannot be served", code="invalid_grammar")
    if delta.finish_reason == "timeout":
        # NOTE: x-should-retry: the OpenAI SDKs retry every 5xx unless told not to, and a
        # retry of a request whose deadline passed can only pass its deadline again.
        return ApiError(504, delta.error or "The request's deadline passed",
                        "timeout", "deadline_exceeded", headers={"x-should-retry": "false"})
    if delta.finish_reason == "abort":
        message = delta.error or "The request was aborted by the server"
        return ApiError(503, message, code="request_aborted", headers={"Retry-After": "1"})
    message = delta.error or "The engine failed to serve the request"
    if not client.is_ready():
        return ApiError(503, message, code="engine_unavailable", headers={"Retry-After": "1"})
    return ApiError(500, message, code="engine_error")


class StreamFormatter(Protocol):
    chunk_object: str  # "text_completion" or "chat.completion.chunk"

    def start_chunks(self, run: Run) -> list[dict[str, Any]]:
        """Chunks sent before any delta (chat's ``role: assistant``)."""

    def chunk(self, run: Run, choice: Choice, delta: SeqDelta) -> dict[str, Any] | None:
        """The chunk for one delta, or None when it carries nothing to send."""


async def collect(client: EngineClient, run: Run) -> list[Choice]:
    """Wait for every choice to finish; a failed choice fails the whole request."""
    try:
        async with contextlib.aclosing(run.deltas()) as deltas:
            async for _, delta in deltas:
                if delta.finish_reason in FAILED:
                    await run.abort()
                    raise failure(client, delta)
    except BaseException:
        # The client went away (aiohttp cancels the handler when it runs with
        # handler_cancellation=True, as ``start_server`` does) or the stream failed: either
        # way the engine must stop working for nobody. ``abort`` is idempotent.
        await run.abort()
        raise
    return run.choices


async def respond(run: Run, build: Callable[[Run, list[Choice]], dict[str, Any]],
                  choices: list[Choice]) -> web.Response:
    """The non-streamed answer. Built and encoded off the event loop: with n=16, 64 prompts
    and 20 logprobs per token the body holds millions of entries."""
    body = await off_loop(lambda: msgspec.json.encode(build(run, choices)))
    return web.Response(body=body, content_type="application/json", charset="utf-8",
                        headers={"X-Request-Id": run.request_id})


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def stream_sse(request: web.Request, client: EngineClient, run: Run,
                     formatter: StreamFormatter) -> web.StreamResponse:
    """Answer with server-sent events: chunks, an optional usage chunk, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": run.request_id})
    if request.version < HttpVersion11:
        # NOTE: HTTP/1.0 has no chunked encoding, and an event stream has no length up front:
        # the only end of the body an HTTP/1.0 client can see is the close of the connection.
        response.force_close()
    config = request.app[CONFIG_KEY]

    async def send(data: bytes) -> None:
        # A client that stops reading fills the socket's buffer and would hold the request.
        await with_idle_timeout(response.write(data), config, "reading the stream")

    try:
        await response.prepare(request)
        for chunk in formatter.start_chunks(run):
            await send(sse_event(chunk))
        async with contextlib.aclosing(run.deltas()) as deltas:
            async for choice, delta in deltas:
                if delta.finish_reason in FAILED:
                    await run.abort()
                    error = failure(client, delta)
                    await send(sse_event(error_body(error.status, error.message, error.param,
                                                    error.code)))
                    break
                chunk = formatter.chunk(run, choice, delta)
                if chunk is not None:
                    await send(sse_event(chunk))
            else:
                if run.req.include_usage:
                    await send(sse_event(usage_chunk(run, formatter)))
        await send(_SSE_DONE)
        await response.write_eof()
    except (ConnectionResetError, TimeoutError):
        await run.abort()
        response.force_close()
    except asyncio.CancelledError:
        await run.abort()
        raise
    except Exception:
        # Headers are gone already: the error can only travel as a last event.
        logger.exception("stream %s failed", run.request_id)
        await run.abort()
        with contextlib.suppress(Exception):
            await response.write(sse_event(error_body(500, "Internal server error", None,
                                                      "internal_error")))
            await response.write(_SSE_DONE)
    return response


def usage_chunk(run: Run, formatter: StreamFormatter) -> dict[str, Any]:
    chunk = chunk_header(run, formatter.chunk_object)
    chunk["choices"] = []
    chunk["usage"] = run.usage()
    return chunk


def chunk_header(run: Run, object_name: str) -> dict[str, Any]:
    return {"id": run.request_id, "object": object_name, "created": run.created,
            "model": run.model}


def with_usage_field(run: Run, chunk: dict[str, Any]) -> dict[str, Any]:
    """With ``include_usage`` OpenAI sends ``"usage": null`` on every other chunk."""
    if run.req.include_usage:
        chunk["usage"] = None
    return chunk


def token_text(entry: TokenLogprob) -> str:
    return entry.decoded if entry.decoded is not None else f"token_id:{entry.token_id}"


def top_entries(entry: dict[int, TokenLogprob], k: int) -> list[TokenLogprob]:
    """The entry's own token (listed first) and its top ``k`` by rank."""
    own = next(iter(entry.values()))
    return [own, *(e for e in entry.values() if e is not own and e.rank <= k)]


def vllm_prompt_logprobs(entries: list[dict[int, TokenLogprob] | None] | None, k: int
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), token id ->
    ``{logprob, rank, decoded_token}`` for that token and the top ``k``."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(e)}
        for e in top_entries(entry, k)} for entry in entries]
