"""The group's recovery state machine, run by sentinel 0.

On a fault anywhere in the DP group: every engine is marked unhealthy and, when recovery is
automatic, an attempt runs at once; otherwise the engines are paused and the group waits for
an operator's ``/fault_tolerance/apply``. An attempt is two phases over all sentinels:

    pause   every engine drops its batch and KV state (reinit: a dead, hung or failing engine
            is killed and started again, paused)
    recover every engine re-creates its DP groups at the new epoch and runs again

A fault during an attempt fails the attempt; attempts are bounded, with exponential backoff.
When they are exhausted the group is dead and the API processes exit non-zero.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from typing import TYPE_CHECKING

from bastion.ipc.messages import EngineState, EngineStatus, PeerMessage

if TYPE_CHECKING:
    from bastion.sentinel.sentinel import Sentinel

logger = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, sentinel: Sentinel) -> None:
        self.sentinel = sentinel
        self.ft = sentinel.ft
        self.size = sentinel.config.parallel.data_parallel_size
        self.epoch = 0
        self.statuses = [EngineStatus(i, EngineState.STARTING) for i in range(self.size)]
        self.hellos = {0}
        self.started = False
        self.recovering = False
        self.pending: collections.deque[tuple[str, str, str | None]] = collections.deque()
        self.replies: dict[tuple[str, int], dict[int, tuple[bool, str | None]]] = {}
        self.failures: dict[int, str | None] = {}  # rank -> error, of the last phase

    # ---------------------------------------------------------------------------- events

    def on_message(self, msg: PeerMessage) -> None:
        if msg.kind == "hello":
            self.hellos.add(msg.sender)
            if self.started:  # a peer that came back (its API restarted it): resend status
                self.broadcast()
        elif msg.kind == "fault":
            self.on_fault(msg.sender, msg.info or "fault")
        elif msg.kind == "apply":
            self.pending.append((msg.instruction or "", "manual", msg.request_id))
        elif msg.kind in ("paused", "recovered"):
            self.replies.setdefault((msg.kind, msg.epoch), {})[msg.sender] = (msg.ok, msg.info)

    def on_fault(self, rank: int, info: str) -> None:
        if self.recovering or not self.started:
            return  # part of the attempt in progress, which fails or succeeds as a whole
        if all(s.state != EngineState.HEALTHY for s in self.statuses):
            return  # already handled; waiting for an operator
        logger.error("coordinator: engine %d faulted: %s", rank, info)
        for status in self.statuses:
            status.state = EngineState.UNHEALTHY
            status.fault_info = info if status.engine_id == rank else f"paused: engine {rank} faulted"
        self.statuses[rank].fault_info = info
        self.broadcast()
        if self.ft.ft_auto_recovery:
            self.pending.append(("reinit", "auto", f"auto-{uuid.uuid4().hex[:12]}"))
        else:
            self.pending.append(("pause", "auto", None))

    def tick(self) -> None:
        if not self.started:
            if len(self.hellos) == self.size:
                self.started = True
                for status in self.statuses:
                    status.state = EngineState.HEALTHY
                self.broadcast()
            return
        if self.pending:
            instruction, source, request_id = self.pending.popleft()
            if instruction == "pause":
                self._pause_only()
            else:
                self.run_recovery(instruction, source, request_id)

    # -------------------------------------------------------------------------- recovery

    def run_recovery(self, instruction: str, source: str, request_id: str | None) -> bool:
        action = f"{source}-{instruction}"
        self.recovering = True
        error = None
        # An operator's instruction is one attempt whose error they read in the status; only
        # automatic recovery retries, and only its exhaustion is fatal.
        max_attempts = self.ft.ft_max_attempts if source == "auto" else 1
        try:
            for attempt in range(1, max_attempts + 1):
                self.epoch += 1
                t0 = time.monotonic()
                self._set_all(EngineState.RECOVERING, action, request_id)
                logger.warning("coordinator: %s attempt %d at epoch %d", action, attempt,
                               self.epoch)
                error = (self._phase("pause", instruction)
                         or self._phase("recover", instruction))
                if error is None:
                    for status in self.statuses:
                        status.fault_info = None
                    self._set_all(EngineState.HEALTHY, action, request_id)
                    logger.warning("coordinator: group healthy at epoch %d after %.2f s",
                                   self.epoch, time.monotonic() - t0)
                    return True
                logger.error("coordinator: attempt %d failed: %s", attempt, error)
                for status in self.statuses:
                    status.last_action_error = error
                if attempt < max_attempts:
                    self._sleep(self.ft.ft_backoff_s * 2 ** (attempt - 1))
            if source == "auto":
                self._give_up(action, request_id, error)
            else:
                self._mark_failed(action, request_id, error)
            return False
        finally:
            self.recovering = False
            # Faults seen during the attempt belong to it.
            self.sentinel.fault_reported = False

    def _phase(self, kind: str, instruction: str) -> str | None:
        """Run one phase on every sentinel, self last (peers must be in the rendezvous too);
        an error message, or None when every engine succeeded.

        # NOTE: the peers' replies are awaited even when this engine failed at once (a port
        taken, say): the next attempt's orders would otherwise queue behind a peer still
        waiting in this attempt's rendezvous, and find its engine stuck.
        """
        epoch = self.epoch
        for rank in range(1, self.size):
            if not self.sentinel.peers.to_peer(rank, PeerMessage(kind, 0, epoch,
                                                                 instruction=instruction)):
                return f"sentinel {rank} is unreachable"
        if kind == "pause":
            local_ok, local_info = self.sentinel.prepare_local(instruction, epoch)
        else:
            local_ok, local_info = self.sentinel.recover_local(epoch)
        reply_kind = "paused" if kind == "pause" else "recovered"
        deadline = time.monotonic() + self.ft.ft_recovery_timeout_s
        replies = self.replies.setdefault((reply_kind, epoch), {})
        missing: list[int] = []
        while len(replies) < self.size - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - set(replies))
                break
            self.sentinel.pump(0.05)
        self.replies.pop((reply_kind, epoch), None)
        self.failures = {r: info for r, (ok, info) in replies.items() if not ok}
        if not local_ok:
            self.failures[0] = local_info
        failed = [f"engine {r}: {info}" for r, info in sorted(self.failures.items())]
        if missing:
            failed.append(f"no {reply_kind} reply from sentinel(s) {missing} at epoch {epoch}")
        return "; ".join(failed) or None

    def _pause_only(self) -> None:
        """Manual mode: stop every engine (so none hangs on a dead peer) and wait for apply."""
        self._phase("pause", "retry")
        for rank, info in self.failures.items():
            if info and "process is dead" in info:
                self.statuses[rank].state = EngineState.DEAD
                self.statuses[rank].fault_info = info
        self.broadcast()

    def _mark_failed(self, action: str, request_id: str | None, error: str | None) -> None:
        """A manual attempt failed: engines whose process is gone are dead, the others
        unhealthy; the group waits for the next instruction."""
        self._set_all(EngineState.UNHEALTHY, action, request_id, error)
        for rank, info in self.failures.items():
            if info and "process is dead" in info:
                self.statuses[rank].state = EngineState.DEAD
        self.broadcast()

    def _give_up(self, action: str, request_id: str | None, error: str | None) -> None:
        logger.critical("coordinator: recovery exhausted after %d attempts: %s",
                        self.ft.ft_max_attempts, error)
        self._set_all(EngineState.DEAD, action, request_id, error)
        self.broadcast(PeerMessage("fatal", 0, self.epoch, info=error))

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sentinel.pump(0.05)

    # ---------------------------------------------------------------------------- status

    def _set_all(self, state: EngineState, action: str, request_id: str | None,
                 error: str | None = None) -> None:
        for status in self.statuses:
            status.state = state
            status.epoch = self.epoch
            status.last_action = action
            status.last_action_id = request_id
            if state != EngineState.RECOVERING:
                status.last_action_error = error
        self.broadcast()

    def broadcast(self, msg: PeerMessage | None = None) -> None:
        msg = msg or PeerMessage("status", 0, self.epoch, statuses=list(self.statuses))
        for rank in range(1, self.size):
            self.sentinel.peers.to_peer(rank, msg)
        self.sentinel.publish(msg)
