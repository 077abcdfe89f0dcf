"""Output demultiplexing: each client request's stream, fed from its engines' outputs.

A client request (``n`` choices) is one ``RequestStream``; each choice is a sequence that hold/
resume places in an engine. One step's outputs arrive per engine; each output is detokenized
and checked for stop strings (the ``OutputProcessor``) and its delta queued on its request's
stream. A stream that ends, or is aborted, leaves nothing behind in the API process's tables.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from bastion.core.output_processor import OutputProcessor, SeqDelta, fan_out
from bastion.ipc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LoRARequest,
    SamplingParams,
)
from bastion.procs.client.holds import HoldResume, Seq

# CPU the output loop spends on one step's outputs before it lets other tasks run.
OUTPUT_SLICE_S = 0.005


@dataclass(eq=False)
class RequestStream:
    """One client request's deltas (all ``n`` choices), fed by the output loop
    (``api.engine_protocol.RequestStream``)."""

    demux: OutputDemux
    request_id: str
    num_prompt_tokens: int
    seqs: list[Seq] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_cached_tokens: int = 0
    num_open: int = 0

    def __aiter__(self) -> AsyncIterator[SeqDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SeqDelta]:
        try:
            while self.num_open > 0:
                delta: SeqDelta = await self.queue.get()
                if delta.finish_reason is not None:
                    self.num_open -= 1
                yield delta
        finally:
            # NOTE: also when the reader stops early (an error delta, a client gone): a stream
            # whose last delta was read must not stay in the client's tables.
            self.demux.release(self)

    async def abort(self) -> None:
        """Stop every open choice in its engine and forget the request. Safe to call more
        than once and after the stream ended (then it only makes sure nothing is left)."""
        self.num_open = 0
        self.demux.release(self)


class OutputDemux:
    """The streams by client request id, and the per-sequence output state behind them.

    ``send_abort(engine_id, engine_request_ids)`` tells an engine to drop requests: those of a
    released stream still in it, and those whose stop string only the front end saw."""

    def __init__(self, tokenizer, holds: HoldResume,
                 send_abort: Callable[[int, list[str]], None]) -> None:
        self.processor = OutputProcessor(tokenizer)
        self.holds = holds
        self.streams: dict[str, RequestStream] = {}
        self._send_abort = send_abort

    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             eos_token_id: int | None, deadline: float | None,
             lora_request: LoRARequest | None) -> RequestStream:
        """A stream for a new client request; its sequences are held, for the caller to
        dispatch."""
        stream = RequestStream(self, request_id, len(prompt_token_ids))
        for i, req in enumerate(fan_out(request_id, prompt_token_ids, params, eos_token_id,
                                        time.time(), deadline, lora_request=lora_request)):
            self.processor.add(req, request_id, i)
            seq = Seq(req.request_id, req, stream)
            stream.seqs.append(seq)
            self.holds.add(seq)
        stream.num_open = len(stream.seqs)
        self.streams[request_id] = stream
        return stream

    def streamed(self, seq: Seq) -> list[int]:
        """The tokens of ``seq`` its client already has (what a resubmission resumes after)."""
        return self.processor.output_token_ids(seq.child_id)

    def release(self, stream: RequestStream) -> None:
        """Drop every trace of a client request; abort its sequences still in an engine."""
        by_engine: dict[int, list[str]] = {}
        for seq in stream.seqs:
            self.processor.remove(seq.child_id)
            if self.holds.is_open(seq) and self.holds.close(seq):
                by_engine.setdefault(seq.engine_id, []).append(seq.engine_request_id)
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]
        for engine_id, ids in by_engine.items():
            self._send_abort(engine_id, ids)

    def finish(self, seq: Seq, reason: FinishReason, error: str) -> None:
        """End a sequence from the front end (deadline, fatal fault, --ft-inflight abort)."""
        out = EngineCoreOutput(seq.child_id, [], reason, error=error)
        delta, _ = self.processor.process(out)
        self.holds.close(seq)
        if delta is not None:
            seq.stream.queue.put_nowait(delta)

    async def route(self, outs: EngineCoreOutputs) -> None:
        """Detokenize and match stop strings for one step's outputs, in slices of at most
        ``OUTPUT_SLICE_S`` of CPU between which the event loop serves everything else."""
        to_abort: list[str] = []
        slice_end = time.perf_counter() + OUTPUT_SLICE_S
        for out in outs.outputs:
            if time.perf_counter() > slice_end:
                # NOTE: a step of a full batch (hundreds of sequences, each with stop strings
                # and logprobs) costs tens of ms here; in one go it would hold up /health and
                # every other request's chunks for as long (vLLM V1 chunks its output handler
                # the same way). What runs meanwhile may abort or resubmit sequences: each
                # output is looked up again below, so a dropped one is skipped.
                await asyncio.sleep(0)
                slice_end = time.perf_counter() + OUTPUT_SLICE_S
            engine_request_id = out.request_id
            if self._route_one(out):
                to_abort.append(engine_request_id)
        if to_abort:
            self._send_abort(outs.engine_id, to_abort)

    def _route_one(self, out: EngineCoreOutput) -> bool:
        """Route one output to its stream; True when the engine must abort it (a stop string
        matched, which only the front end sees)."""
        seq = self.holds.lookup(out.request_id)
        if seq is None:
            return False  # aborted, finished, or a stale output of an earlier epoch
        out.request_id = seq.child_id
        delta, must_abort = self.processor.process(out)
        if delta is None:
            return False
        seq.stream.num_cached_tokens = max(seq.stream.num_cached_tokens, out.num_cached_tokens)
        if delta.finish_reason is not None:
            self.holds.close(seq)
        seq.stream.queue.put_nowait(delta)
        return must_abort

    def table_sizes(self) -> dict[str, int]:
        return {"streams": len(self.streams), "output_states": len(self.processor.seqs)}
