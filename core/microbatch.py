"""A decode step as two micro-batches on two CUDA streams that take turns at attention.

At a decode step's batch sizes the four GEMMs and five small kernels of a layer are bound by
latency, not by bandwidth or FLOPs: they take about the same 30 us at batch 37 as at 256, while
attention reads the K/V cache at nearly the copy bandwidth. Run one after the other, the GPU's
memory system idles through the GEMMs. Split into two halves, the step can run one half's
attention while the other half runs its GEMMs (NanoFlow's nano-batches, for a dense model on one
GPU): half A on the step's own stream, half B on a side stream, and the attention kernels take
turns, A0 B0 A1 B1 ..., each one waiting for the previous one to finish. Between its turns a
half runs its output projection, MLP, next norm, QKV projection and rotary, under the other
half's attention.

The model issues the layers half by half (layer 0 of A, layer 0 of B, layer 1 of A, ...) so
every event a stream waits for was recorded before the wait is issued, which graph capture
needs. On a CPU (or without CUDA) the halves just run in that order; the results are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from bastion.core.forward_context import AttentionMetadata, set_forward_context


class AttentionTurns:
    """Makes the attention kernels of several streams run one at a time, in issue order."""

    def __init__(self, num_parts: int, cuda: bool) -> None:
        self._events = [torch.cuda.Event() for _ in range(num_parts)] if cuda else None
        self._last: int | None = None

    def reset(self) -> None:
        self._last = None

    @contextlib.contextmanager
    def turn(self, part: int) -> Iterator[None]:
        """Around one attention call of ``part``, on that part's current stream: wait for the
        attention issued before it (by another part), then mark this one's end."""
        if self._events is not None and self._last is not None and self._last != part:
            torch.cuda.current_stream().wait_event(self._events[self._last])
        yield
        if self._events is not None:
            self._events[part].record()
        self._last = part


@dataclass
class MicroBatch:
    rows: slice  # this part's rows of the step's tokens
    meta: AttentionMetadata  # its sequences only (``attention_turn`` set)
    stream: torch.cuda.Stream | None  # None: the caller's current stream


class MicroBatches:
    """The parts of one step, in row order. ``run`` executes the model's code for one part on
    its stream with its metadata as the forward context; ``join`` brings the parts' outputs back
    to the caller's stream."""

    def __init__(self, parts: list[MicroBatch], turns: AttentionTurns) -> None:
        self.parts = parts
        self.turns = turns

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.parts)

    def fork(self) -> None:
        """Start the parts' streams after what the caller's stream queued so far."""
        self.turns.reset()
        current = _current_stream(self.parts)
        for part in self.parts:
            if part.stream is not None:
                part.stream.wait_stream(current)

    @contextlib.contextmanager
    def run(self, part: MicroBatch) -> Iterator[None]:
        stream = torch.cuda.stream(part.stream) if part.stream is not None else None
        with stream or contextlib.nullcontext(), set_forward_context(part.meta):
            yield

    def join(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The parts' outputs concatenated in row order, on the caller's stream."""
        current = _current_stream(self.parts)
        for part in self.parts:
            if part.stream is not None:
                current.wait_stream(part.stream)
        return torch.cat(outputs)


def _current_stream(parts: list[MicroBatch]) -> torch.cuda.Stream | None:
    cuda = any(part.stream is not None for part in parts)
    return torch.cuda.current_stream() if cuda else None
