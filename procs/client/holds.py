"""Hold/resume: where each open sequence of the API process is, and what it is resubmitted with.

A sequence (one choice of a client request) is either *held* (waiting for an engine that
serves) or *in* one engine under an engine request id. It is held when it is new and again
when its engine stops serving or comes back at a new epoch; then its engine-side state is gone,
so the next submission carries the tokens it already streamed and resumes after them, under a
fresh engine request id, so a stale output of the earlier submission can never be taken for a
new one. No sockets here: the client sends what ``submit`` builds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import msgspec

from bastion.ipc.messages import EngineCoreRequest


@dataclass(eq=False)
class Seq:
    """One engine-side sequence (a choice of a client request), across epochs."""

    child_id: str
    request: EngineCoreRequest
    stream: Any  # the RequestStream it feeds (output demultiplexing's; never read here)
    engine_id: int = -1
    engine_request_id: str = ""


class HoldResume:
    """The open sequences and their placement.

    NOTE: every open sequence is held or in exactly one engine; ``num_inflight[e]`` is the
    number in engine ``e`` (what the router balances on), and an output is routed only while
    its engine request id is the sequence's current one."""

    def __init__(self, engine_ids: list[int]) -> None:
        self.open: dict[str, Seq] = {}  # child id -> seq, in the order the requests came
        # An ordered set (dict keys; a Seq hashes by identity), in the order they were held.
        self.held: dict[Seq, None] = {}
        self.by_engine_request_id: dict[str, Seq] = {}
        self.num_inflight = {i: 0 for i in engine_ids}
        self.num_submitted = {i: 0 for i in engine_ids}  # since start, per engine (status)
        self._submission_ids = itertools.count()

    def add(self, seq: Seq) -> None:
        """Track a new sequence; it is held until ``take_held`` hands it out."""
        self.open[seq.child_id] = seq
        self.held[seq] = None

    def hold(self, seq: Seq) -> None:
        self.held[seq] = None

    def take_held(self) -> list[Seq]:
        """Every held sequence, in the order it was held; none is held afterwards."""
        held = list(self.held)
        self.held.clear()
        return held

    def submit(self, seq: Seq, engine_id: int, streamed: list[int]) -> EngineCoreRequest:
        """Place ``seq`` in ``engine_id``: the ADD to send, resuming after ``streamed`` (the
        tokens the client already has) under a fresh engine request id."""
        seq.engine_id = engine_id
        seq.engine_request_id = f"{seq.child_id}@{next(self._submission_ids)}"
        self.by_engine_request_id[seq.engine_request_id] = seq
        self.num_inflight[engine_id] += 1
        self.num_submitted[engine_id] += 1
        return msgspec.structs.replace(seq.request, request_id=seq.engine_request_id,
                                       resumed_output_token_ids=list(streamed))

    def lookup(self, engine_request_id: str) -> Seq | None:
        """The sequence an output belongs to; None when it was aborted, finished, or the output
        is a stale one of an earlier submission."""
        return self.by_engine_request_id.get(engine_request_id)

    def is_open(self, seq: Seq) -> bool:
        return seq.child_id in self.open

    def close(self, seq: Seq) -> bool:
        """Stop tracking a sequence; True when an engine still had it (to abort there)."""
        self.open.pop(seq.child_id, None)
        self.held.pop(seq, None)
        return self.detach(seq)

    def detach(self, seq: Seq) -> bool:
        """Forget the engine-side request of a sequence (its outputs become stale)."""
        if self.by_engine_request_id.pop(seq.engine_request_id, None) is None:
            return False
        self.num_inflight[seq.engine_id] -= 1
        return True

    def take_back(self, engine_id: int) -> list[Seq]:
        """Detach every sequence engine ``engine_id`` has (it stopped serving or restarted), in
        the order the requests came; the caller holds them again or ends them."""
        seqs = [s for s in self.open.values() if s.engine_id == engine_id
                and s not in self.held and s.engine_request_id in self.by_engine_request_id]
        for seq in seqs:
            self.detach(seq)
        return seqs

    def expired(self, now: float) -> list[Seq]:
        """Held sequences whose deadline passed (in an engine, the engine enforces it)."""
        return [s for s in self.held
                if s.request.deadline is not None and s.request.deadline < now]

    def table_sizes(self) -> dict[str, int]:
        return {"sequences": len(self.open), "engine_requests": len(self.by_engine_request_id),
                "held": len(self.held), "inflight": sum(self.num_inflight.values())}
