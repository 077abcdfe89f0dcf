"""Routing: which engines take requests now, and which of them gets the next sequence.

Dense data-parallel engines are independent: each serves while it is healthy, whatever the
others do. An expert-parallel (coupled) group serves only while every engine of the group is
healthy, the engines of other API servers (external load-balancer mode) included. Pure
bookkeeping over the statuses the sentinels report and the stats the engines send.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from bastion.ipc.messages import EngineState, EngineStatus, SchedulerStats


class Router:
    """The API process's view of its engines' health and load."""

    def __init__(self, engine_ids: list[int], dp_size: int, is_coupled: bool) -> None:
        self.engine_ids = engine_ids
        self.is_coupled = is_coupled
        # A coupled group's health is every engine's, so this server follows them all.
        shown = range(dp_size) if is_coupled else engine_ids
        self.statuses = {i: EngineStatus(i, EngineState.STARTING) for i in shown}
        self.stats = {i: SchedulerStats() for i in engine_ids}
        self._epochs = {i: 0 for i in engine_ids}  # the epoch each engine serves at
        self.fatal: str | None = None  # why the group is dead (it never serves again)

    def serving(self) -> list[int]:
        """The engines that take requests now, in engine order."""
        if self.fatal is not None:
            return []
        healthy = [i for i in self.engine_ids if self.statuses[i].state == EngineState.HEALTHY]
        if self.is_coupled and any(s.state != EngineState.HEALTHY
                                   for s in self.statuses.values()):
            return []
        return healthy

    def pick(self, serving: list[int], num_inflight: Mapping[int, int]) -> int:
        """Least loaded by the engines' last report plus what was sent since (``num_inflight``:
        the sequences each engine has now); the lowest engine id on a tie."""
        return min(serving, key=lambda i: num_inflight[i] * 4 + self.stats[i].num_waiting_reqs)

    def observe_stats(self, engine_id: int, stats: SchedulerStats) -> bool:
        """Keep an engine's latest report; False for an engine this server does not route to."""
        if engine_id not in self.stats:
            return False
        self.stats[engine_id] = stats
        return True

    def update(self, statuses: Iterable[EngineStatus]) -> list[int]:
        """Take the sentinels' report; returns the engines whose sequences must be taken back,
        in engine order: those that stopped serving, and those that serve at a new epoch (their
        engine-side state is gone). Their stats are reset: their queues went with it."""
        was_serving = set(self.serving())
        for status in statuses:
            if status.engine_id in self.statuses:
                self.statuses[status.engine_id] = status
        serving = set(self.serving())
        taken_back = []
        for engine_id in self.engine_ids:
            epoch = self.statuses[engine_id].epoch
            stopped = engine_id in was_serving and engine_id not in serving
            moved_on = engine_id in serving and epoch != self._epochs[engine_id]
            if stopped or moved_on:
                taken_back.append(engine_id)
                self.stats[engine_id] = SchedulerStats()
            if engine_id in serving:
                self._epochs[engine_id] = epoch
        return taken_back

    def is_ready(self) -> bool:
        """Serving: some engine takes requests (dense DP: the others may be recovering, a
        degraded state that ``/fault_tolerance/status`` and the metrics show), and none is
        still starting."""
        return bool(self.serving()) and all(s.state != EngineState.STARTING
                                            for s in self.statuses.values())

    def is_progressing(self) -> bool:
        """Serving, starting or recovering: anything but sitting faulted."""
        return self.is_ready() or all(
            s.state in (EngineState.HEALTHY, EngineState.STARTING, EngineState.RECOVERING)
            for s in self.statuses.values())
