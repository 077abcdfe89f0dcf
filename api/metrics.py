"""Prometheus metrics with vLLM's names under a ``bastion:`` prefix, on a private registry.

Gauges (running, waiting, KV usage) are read from ``client.scheduler_stats()`` at scrape time.
Counters the engines report per step (prefix-cache queries and hits, preemptions) arrive as
deltas "since the last report"; each report is added once, either when the engine client passes
it to ``observe_scheduler_stats`` (exact) or when a scrape finds a report it has not seen.
Token counts, finish reasons and latencies come from the request path.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bastion.api.engine_protocol import EngineClient
from bastion.core.output_processor import SeqDelta
from bastion.ipc.messages import EngineState, EngineStatus, SchedulerStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


_RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def fault_kind(info: str) -> str:
    """A coarse label for a fault message (bounded label values for Prometheus)."""
    text = info.lower()
    for needle, kind in (("injected", "injected"), ("hang", "hang"),
                         ("exited", "process_exit"), ("workerfailure", "worker_failure"),
                         ("distributed", "collective"), ("timeout", "collective")):
        if needle in text:
            return kind
    return "exception"


class ApiMetrics:
    """All series of one server; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def series(kind: type, name: str, doc: str, extra: tuple[str, ...] = (), **kw: Any):
            return kind(f"bastion:{name}", doc, labels + list(extra), registry=self.registry,
                        **kw)

        self.num_requests_running = series(Gauge, "num_requests_running",
                                           "Requests in model execution batches.")
        self.num_requests_waiting = series(Gauge, "num_requests_waiting",
                                           "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = series(Gauge, "kv_cache_usage_perc",
                                          "KV-cache usage, 1 is 100 percent (mean over engines).")
        self.prefix_cache_queries = series(Counter, "prefix_cache_queries",
                                           "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = series(Counter, "prefix_cache_hits",
                                        "Prompt tokens found in the prefix cache.")
        self.num_preemptions = series(Counter, "num_preemptions",
                                      "Preemptions (requests sent back to waiting).")
        self.spec_decode_num_drafts = series(Counter, "spec_decode_num_drafts",
                                             "Verify rows that carried draft tokens.")
        self.spec_decode_num_draft_tokens = series(Counter, "spec_decode_num_draft_tokens",
                                                   "Draft tokens proposed and verified.")
        self.spec_decode_num_accepted_tokens = series(Counter, "spec_decode_num_accepted_tokens",
                                                      "Draft tokens accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = series(
            Counter, "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.", ("position",))
        self.prompt_tokens = series(Counter, "prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = series(Counter, "generation_tokens",
                                        "Generated tokens sent to clients.")
        self.request_success = series(Counter, "request_success", "Finished choices.",
                                      ("finished_reason",))
        self.time_to_first_token = series(Histogram, "time_to_first_token_seconds",
                                          "Time to first token.", buckets=_TTFT_BUCKETS)
        self.inter_token_latency = series(Histogram, "inter_token_latency_seconds",
                                          "Time between token deliveries.", buckets=_ITL_BUCKETS)
        self.e2e_request_latency = series(Histogram, "e2e_request_latency_seconds",
                                          "End-to-end request latency.", buckets=_E2E_BUCKETS)
        self.engine_state = series(Gauge, "engine_state",
                                   "Engine state: 0 starting, 1 healthy, 2 unhealthy, "
                                   "3 recovering, 4 dead.", ("engine",))
        self.faults = series(Counter, "engine_faults", "Faults of the engine group, by kind.",
                             ("kind",))
        self.recoveries = series(Counter, "engine_recoveries",
                                 "Recoveries of the engine group, by action.", ("action",))
        self.recovery_seconds = series(Histogram, "engine_recovery_seconds",
                                       "From the fault being seen to the group healthy again.",
                                       buckets=_RECOVERY_BUCKETS)
        self.model_name = model_name
        self._last_stats: dict[int, SchedulerStats] = {}
        self._fault_seen_at: float | None = None
        self._epoch = 0

    def observe_statuses(self, statuses: list[EngineStatus]) -> None:
        """Feed the fault-tolerance series from a status report of the engine group."""
        m = self.model_name
        for status in statuses:
            self.engine_state.labels(m, str(status.engine_id)).set(int(status.state))
        healthy = all(s.state == EngineState.HEALTHY for s in statuses)
        if not healthy and self._fault_seen_at is None:
            self._fault_seen_at = time.monotonic()
            info = " ".join(s.fault_info or "" for s in statuses)
            self.faults.labels(m, fault_kind(info)).inc()
        epoch = max((s.epoch for s in statuses), default=0)
        if healthy and self._fault_seen_at is not None and epoch != self._epoch:
            action = statuses[0].last_action or "unknown"
            self.recoveries.labels(m, action).inc()
            self.recovery_seconds.labels(m).observe(time.monotonic() - self._fault_seen_at)
            self._fault_seen_at = None
        if healthy:
            self._epoch = epoch

    def observe_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        """Add one engine report's per-step counters; a report already seen is skipped.

        NOTE: reports are told apart by identity: the engine client keeps the latest report
        object per engine and replaces it with a new object on each report."""
        if self._last_stats.get(engine_index) is stats:
            return
        self._last_stats[engine_index] = stats
        m = self.model_name
        self.prefix_cache_queries.labels(m).inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.labels(m).inc(stats.prefix_cache_hits)
        self.num_preemptions.labels(m).inc(stats.num_preemptions)
        if stats.spec_num_drafts:
            self.spec_decode_num_drafts.labels(m).inc(stats.spec_num_drafts)
            self.spec_decode_num_draft_tokens.labels(m).inc(stats.spec_num_draft_tokens)
            self.spec_decode_num_accepted_tokens.labels(m).inc(stats.spec_num_accepted_tokens)
            for pos, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
                self.spec_decode_num_accepted_tokens_per_pos.labels(m, str(pos)).inc(n)

    def refresh(self) -> None:
        """Read the engines' latest reports into the gauges (called at scrape time)."""
        all_stats = self.client.scheduler_stats()
        for index, stats in enumerate(all_stats):
            self.observe_scheduler_stats(index, stats)
        m = self.model_name
        self.num_requests_running.labels(m).set(sum(s.num_running_reqs for s in all_stats))
        self.num_requests_waiting.labels(m).set(sum(s.num_waiting_reqs for s in all_stats))
        usage = sum(s.kv_cache_usage for s in all_stats) / len(all_stats) if all_stats else 0.0
        self.kv_cache_usage_perc.labels(m).set(usage)

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)

    def track_request(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Latency and token accounting for one client request (all its choices)."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self._last_token_time: dict[int, float] = {}

    def on_delta(self, choice_index: int, delta: SeqDelta) -> None:
        m = self.metrics
        now = time.monotonic()
        if delta.token_ids:
            m.generation_tokens.labels(m.model_name).inc(len(delta.token_ids))
            last = self._last_token_time.get(choice_index)
            if last is None:
                m.time_to_first_token.labels(m.model_name).observe(now - self.arrival)
            else:
                m.inter_token_latency.labels(m.model_name).observe(now - last)
            self._last_token_time[choice_index] = now
        if delta.finish_reason is not None:
            m.request_success.labels(m.model_name, delta.finish_reason).inc()

    def on_finish(self, num_prompt_tokens: int) -> None:
        m = self.metrics
        m.prompt_tokens.labels(m.model_name).inc(num_prompt_tokens)
        m.e2e_request_latency.labels(m.model_name).observe(time.monotonic() - self.arrival)
