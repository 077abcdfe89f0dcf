"""Prometheus metrics with vLLM's names, on a private registry.

The prefix is ``--metrics-prefix``: ``bastion`` by default, ``vllm`` for vLLM's Grafana
dashboard and autoscalers unchanged (``vllm:num_requests_waiting``, ...). The series are
vLLM V1's, with the same types, labels (``model_name``; ``finished_reason`` on
``request_success``) and buckets, plus bastion's own fault-tolerance series.

Gauges (running, waiting, KV usage) are read from ``client.scheduler_stats()`` at scrape time.
Counters the engines report per step (prefix-cache queries and hits, preemptions, tokens per
step) arrive as deltas "since the last report"; each report is added once, either when the
engine client passes it to ``observe_scheduler_stats`` (exact) or when a scrape finds a report
it has not seen. Token counts, finish reasons and latencies come from the request path: the
engine stamps each request's first output with its queue and prefill times.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bastion.api.engine_protocol import EngineClient
from bastion.core.config import CacheConfig
from bastion.core.output_processor import SeqDelta
from bastion.ipc.messages import (
    EngineState,
    EngineStatus,
    FailureKind,
    SamplingParams,
    SchedulerStats,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's request_latency_buckets: end-to-end, queue, prefill, decode and inference times.
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching",
                      "gpu_memory_utilization", "num_gpu_blocks_override", "num_gpu_blocks")


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > limit:
                return buckets
            buckets.append(value)
        scale *= 10


_RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ApiMetrics:
    """All series of one server; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, client: EngineClient, model_name: str, prefix: str = "bastion") -> None:
        self.client = client
        self.prefix = prefix
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def series(kind: type, name: str, doc: str, extra: tuple[str, ...] = (), **kw: Any):
            return kind(f"{prefix}:{name}", doc, labels + list(extra), registry=self.registry,
                        **kw)

        token_buckets = buckets_1_2_5(client.max_model_len)
        self.num_requests_running = series(Gauge, "num_requests_running",
                                           "Requests in model execution batches.")
        self.num_requests_waiting = series(Gauge, "num_requests_waiting",
                                           "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = series(Gauge, "kv_cache_usage_perc",
                                          "KV-cache usage, 1 is 100 percent (mean over engines).")
        # vLLM's older name of the same gauge; its dashboards and autoscalers still use it.
        self.gpu_cache_usage_perc = series(Gauge, "gpu_cache_usage_perc",
                                           "KV-cache usage, 1 is 100 percent (the older name of "
                                           "kv_cache_usage_perc).")
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
        self.iteration_tokens = series(Histogram, "iteration_tokens_total",
                                       "Tokens per engine step.", buckets=_ITERATION_BUCKETS)
        self.time_to_first_token = series(Histogram, "time_to_first_token_seconds",
                                          "Time to first token.", buckets=_TTFT_BUCKETS)
        self.inter_token_latency = series(Histogram, "inter_token_latency_seconds",
                                          "Time between token deliveries.", buckets=_ITL_BUCKETS)
        self.time_per_output_token = series(
            Histogram, "time_per_output_token_seconds",
            "Time between token deliveries (the older name of inter_token_latency_seconds).",
            buckets=_ITL_BUCKETS)
        self.request_time_per_output_token = series(
            Histogram, "request_time_per_output_token_seconds",
            "Per request: decode time over the tokens after the first.", buckets=_ITL_BUCKETS)
        self.e2e_request_latency = series(Histogram, "e2e_request_latency_seconds",
                                          "End-to-end request latency.", buckets=_E2E_BUCKETS)
        self.request_queue_time = series(Histogram, "request_queue_time_seconds",
                                         "Time in the engine's waiting queue.",
                                         buckets=_E2E_BUCKETS)
        self.request_prefill_time = series(Histogram, "request_prefill_time_seconds",
                                           "From first scheduled to the first token.",
                                           buckets=_E2E_BUCKETS)
        self.request_decode_time = series(Histogram, "request_decode_time_seconds",
                                          "From the first token to the last.",
                                          buckets=_E2E_BUCKETS)
        self.request_inference_time = series(Histogram, "request_inference_time_seconds",
                                             "Prefill plus decode time.", buckets=_E2E_BUCKETS)
        self.request_prompt_tokens = series(Histogram, "request_prompt_tokens",
                                            "Prompt tokens per request.", buckets=token_buckets)
        self.request_generation_tokens = series(Histogram, "request_generation_tokens",
                                                "Generated tokens per choice.",
                                                buckets=token_buckets)
        self.request_max_num_generation_tokens = series(
            Histogram, "request_max_num_generation_tokens",
            "The most tokens any choice of a request generated.", buckets=token_buckets)
        self.request_params_n = series(Histogram, "request_params_n", "The n of each request.",
                                       buckets=_N_BUCKETS)
        self.request_params_max_tokens = series(Histogram, "request_params_max_tokens",
                                                "The max_tokens of each request.",
                                                buckets=token_buckets)
        self.cache_config_info = Gauge(f"{prefix}:cache_config_info",
                                       "Information of the KV cache config (value 1).",
                                       _CACHE_INFO_LABELS, registry=self.registry)
        self._cache_info: dict[str, str] | None = None
        # vLLM's: which adapters run and wait (comma-joined names), valued at the scrape time.
        self.lora_requests_info = Gauge(f"{prefix}:lora_requests_info",
                                        "Running stats on LoRA requests.",
                                        ("max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"), registry=self.registry)
        self._max_loras: int | None = None
        self.engine_state = series(Gauge, "engine_state",
                                   "Engine state: 0 starting, 1 healthy, 2 unhealthy, "
                                   "3 recovering, 4 dead.", ("engine",))
        # NOTE: counted per engine, not per group fault: which engine's report reaches the
        # coordinator first is a race (a killed engine's peer may see its broken collective
        # before the killed engine's sentinel sees the exit), and each report names a cause.
        self.faults = series(Counter, "engine_faults",
                             "Faults reported by the engines, by kind: one per engine and fault "
                             "(a peer that failed with the faulted engine counts its own).",
                             ("kind",))
        self.recoveries = series(Counter, "engine_recoveries",
                                 "Recoveries of the engine group, by action.", ("action",))
        self.recovery_seconds = series(Histogram, "engine_recovery_seconds",
                                       "From the fault being seen to the group healthy again.",
                                       buckets=_RECOVERY_BUCKETS)
        self.api_table_entries = series(Gauge, "api_request_table_entries",
                                        "Entries of the API process's per-request tables; 0 "
                                        "when idle (anything else is a leak).", ("table",))
        self.model_name = model_name
        self._last_stats: dict[int, SchedulerStats] = {}
        self._fault_seen_at: float | None = None
        self._counted_kind: dict[int, FailureKind] = {}  # engine -> the kind last counted
        self._epoch = 0

    def observe_statuses(self, statuses: list[EngineStatus]) -> None:
        """Feed the fault-tolerance series from a status report of the engine group."""
        m = self.model_name
        for status in statuses:
            self.engine_state.labels(m, str(status.engine_id)).set(int(status.state))
            kind = status.fault_kind
            if kind != self._counted_kind.get(status.engine_id, FailureKind.NONE):
                self._counted_kind[status.engine_id] = kind
                if kind != FailureKind.NONE:
                    self.faults.labels(m, kind.label).inc()
        healthy = all(s.state == EngineState.HEALTHY for s in statuses)
        if not healthy and self._fault_seen_at is None:
            self._fault_seen_at = time.monotonic()
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
        for num_tokens in stats.iteration_tokens:
            self.iteration_tokens.labels(m).observe(num_tokens)
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
        self.gpu_cache_usage_perc.labels(m).set(usage)
        if self._cache_info is not None:
            # Per engine, as vLLM's: every engine of the group sizes the same pool.
            num_blocks = max((s.num_gpu_blocks for s in all_stats), default=0)
            self.cache_config_info.clear()
            self.cache_config_info.labels(**self._cache_info,
                                          num_gpu_blocks=str(num_blocks)).set(1)
        if self._max_loras is not None:
            self.lora_requests_info.clear()
            self.lora_requests_info.labels(
                str(self._max_loras),
                ",".join(sorted({n for s in all_stats for n in s.running_lora_adapters})),
                ",".join(sorted({n for s in all_stats for n in s.waiting_lora_adapters})),
            ).set(time.time())
        table_sizes = getattr(self.client, "table_sizes", None)  # optional in EngineClient
        if table_sizes is not None:
            for table, size in table_sizes().items():
                self.api_table_entries.labels(m, table).set(size)

    def set_cache_config(self, cache: CacheConfig) -> None:
        """Publish ``cache_config_info`` (the pool size comes from the engines' reports)."""
        self._cache_info = {
            "block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "num_gpu_blocks_override": str(cache.num_gpu_blocks_override)}

    def set_lora_config(self, max_loras: int) -> None:
        """Publish ``lora_requests_info`` (LoRA is enabled)."""
        self._max_loras = max_loras

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)

    def track_request(self, params: list[SamplingParams] | None = None) -> RequestTracker:
        """A tracker for one client request; ``params``: its prompts' sampling parameters."""
        tracker = RequestTracker(self)
        if params:
            m = self.model_name
            self.request_params_n.labels(m).observe(params[0].n)
            max_tokens = params[0].max_tokens
            if max_tokens is not None:
                self.request_params_max_tokens.labels(m).observe(max_tokens)
        return tracker


class _ChoiceTimes:
    __slots__ = ("first", "last", "num_tokens", "prefill_s")

    def __init__(self, now: float) -> None:
        self.first = self.last = now
        self.num_tokens = 0
        self.prefill_s = 0.0


class RequestTracker:
    """Latency and token accounting for one client request (all its choices)."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self._choices: dict[int, _ChoiceTimes] = {}

    def on_delta(self, choice_index: int, delta: SeqDelta) -> None:
        m = self.metrics
        name = m.model_name
        now = time.monotonic()
        times = self._choices.get(choice_index)
        if delta.token_ids:
            m.generation_tokens.labels(name).inc(len(delta.token_ids))
            if times is None:
                times = self._choices[choice_index] = _ChoiceTimes(now)
                m.time_to_first_token.labels(name).observe(now - self.arrival)
            else:
                m.inter_token_latency.labels(name).observe(now - times.last)
                m.time_per_output_token.labels(name).observe(now - times.last)
                times.last = now
            times.num_tokens += len(delta.token_ids)
        # NOTE: only the engine's first output of a request carries these (a request resumed
        # after a fault restarts with tokens and so carries none again).
        if delta.prefill_time_s and times is not None and not times.prefill_s:
            times.prefill_s = delta.prefill_time_s
            m.request_queue_time.labels(name).observe(delta.queue_time_s)
            m.request_prefill_time.labels(name).observe(delta.prefill_time_s)
        if delta.finish_reason is not None:
            m.request_success.labels(name, delta.finish_reason).inc()
            num_tokens = times.num_tokens if times is not None else 0
            m.request_generation_tokens.labels(name).observe(num_tokens)
            if times is not None:
                decode_s = times.last - times.first
                m.request_decode_time.labels(name).observe(decode_s)
                m.request_inference_time.labels(name).observe(times.prefill_s + decode_s)
                if num_tokens > 1:
                    m.request_time_per_output_token.labels(name).observe(
                        decode_s / (num_tokens - 1))

    def on_finish(self, num_prompt_tokens: int) -> None:
        m = self.metrics
        name = m.model_name
        m.prompt_tokens.labels(name).inc(num_prompt_tokens)
        m.request_prompt_tokens.labels(name).observe(num_prompt_tokens)
        m.e2e_request_latency.labels(name).observe(time.monotonic() - self.arrival)
        m.request_max_num_generation_tokens.labels(name).observe(
            max((t.num_tokens for t in self._choices.values()), default=0))
