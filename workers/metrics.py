"""A worker's Prometheus metrics, in its own registry, named like vLLM's under `rlt:`.

The engine keeps cumulative counters in `EngineStats`; they are exported as they are read (a
collector over the latest snapshot) rather than mirrored into prometheus_client Counters, so the
engine stays the one source of truth. That includes the exit-depth histogram, which the engine
already counts per token leaving the core (prompt and generated tokens and verify rows; a draft
does not leave the core, its verify row resumes it; with fixed depth every token exits at
num_loops - 1), the loops behind each plainly sampled token, and speculation's per-position
acceptance and draft depth. The other histograms are observed by the worker loop:
per core call (rows, depths, tokens, step time) and per request (prefill and decode time as this
worker sees them). The router relabels the text with the worker
id and merges it into its own /metrics. Prefill/decode workers add the KV transfer families
(bytes and chunks by direction, per-write and per-request latency, failures by reason, bytes and
writes in flight, registrations, held requests); every worker exports them, zero where unused, so
dashboards see one schema.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from rlt_serve.engine.llm_engine import EngineStats

# Every family a worker exports, as it appears in the exposition text: counters with their
# `_total` suffix, histograms by base name (queries add _bucket, _sum, _count). The router and
# the dashboards import this list instead of repeating names.
GAUGES = (
    "rlt:num_requests_running",
    "rlt:num_requests_waiting",
    "rlt:kv_cache_usage_perc",
    "rlt:kv_cache_free_pages",
    "rlt:kv_cache_total_pages",
    "rlt:swap_used_bytes",
    "rlt:kv_transfer_in_flight_bytes",
    "rlt:kv_transfer_in_flight_writes",
    "rlt:kv_transfer_registrations",
    "rlt:pd_requests_held",
    "rlt:pd_free_state_slots",
)
COUNTERS = (
    "rlt:num_preemptions_total",
    "rlt:prompt_tokens_total",
    "rlt:generation_tokens_total",
    "rlt:request_success_total",  # label finished_reason: stop | length | abort | error
    "rlt:core_calls_total",
    "rlt:core_call_row_tokens_total",
    "rlt:cuda_graph_steps_total",  # label kind: decode (fused decode steps) | loop (one-loop calls)
    "rlt:cuda_graph_replays_total",  # label kind: those of them that replayed a graph
    "rlt:prefix_cache_queries_total",  # tokens looked up in the prefix cache
    "rlt:prefix_cache_hits_total",  # tokens found there
    "rlt:spec_decode_num_drafts_total",
    "rlt:spec_decode_num_draft_tokens_total",
    "rlt:spec_decode_num_accepted_tokens_total",
    "rlt:spec_decode_num_accepted_tokens_per_pos_total",  # label position: rounds whose draft i was kept
    "rlt:kv_transfer_bytes_total",  # label direction: sent | received
    "rlt:kv_transfer_chunks_total",  # label direction: sent | received
    "rlt:kv_transfer_failures_total",  # label reason: error | timeout | stale | bad_notification
)
HISTOGRAMS = (
    "rlt:core_call_rows",
    "rlt:core_call_depths",
    "rlt:core_call_tokens",
    "rlt:loops_per_token",
    "rlt:exit_depth",
    "rlt:generation_loops_per_token",
    "rlt:spec_decode_draft_depth",
    "rlt:engine_step_seconds",
    "rlt:request_prefill_time_seconds",
    "rlt:request_decode_time_seconds",
    "rlt:kv_transfer_write_seconds",
    "rlt:kv_transfer_request_seconds",
)
METRIC_NAMES: tuple[str, ...] = GAUGES + COUNTERS + HISTOGRAMS

_POW2 = tuple(float(2**i) for i in range(12))  # 1 .. 2048
_DEPTHS = tuple(float(i) for i in range(1, 17))
_EXIT = tuple(float(i) for i in range(16))
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REQUEST_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _StatsCollector(Collector):
    """Gauges and counters straight from the latest `EngineStats` snapshot."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.errors = 0  # requests the engine refused or lost: not in EngineStats.finished

    def collect(self) -> Iterator[Metric]:
        st = self.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)

        usage = 1.0 - st.num_free_pages / st.num_pages if st.num_pages else 0.0
        yield gauge("rlt:num_requests_running", "Requests with rows in the running batch.", st.num_running)
        yield gauge("rlt:num_requests_waiting", "Requests waiting to be scheduled.", st.num_waiting)
        yield gauge("rlt:kv_cache_usage_perc", "Fraction of KV pages in use (0..1, as vLLM).", usage)
        yield gauge("rlt:kv_cache_free_pages", "Free KV pages.", st.num_free_pages)
        yield gauge("rlt:kv_cache_total_pages", "KV pages in the pool.", st.num_pages)
        yield gauge("rlt:swap_used_bytes", "Host memory holding preempted requests' KV.", st.swap_used_bytes)
        yield counter("rlt:num_preemptions_total", "Preemptions (swap and recompute).", st.num_preemptions)
        yield counter("rlt:prompt_tokens_total", "Prompt tokens computed through every depth.", st.num_prompt_tokens)
        yield counter("rlt:generation_tokens_total", "Tokens sampled.", st.num_generation_tokens)
        success = CounterMetricFamily(
            "rlt:request_success", "Finished requests by finish reason.", labels=["finished_reason"]
        )
        reasons = dict(st.finished)
        reasons["error"] = reasons.get("error", 0) + self.errors
        for reason in ("stop", "length", "abort"):
            reasons.setdefault(reason, 0)
        for reason, count in sorted(reasons.items()):
            success.add_metric([reason], count)
        yield success
        yield counter("rlt:core_calls_total", "Core calls (one batched forward over rows).", st.num_core_calls)
        steps = CounterMetricFamily(
            "rlt:cuda_graph_steps", "Steps that could replay a CUDA graph, by kind: fused decode steps "
            "(every loop) and one-loop calls (prompt chunks, drafts, early-exit rows).", labels=["kind"],
        )  # fmt: skip
        replays = CounterMetricFamily("rlt:cuda_graph_replays", "Of those, steps that replayed one.", labels=["kind"])
        for kind, n, hit in (("decode", st.num_fused_decode_steps, st.num_cuda_graph_replays),
                             ("loop", st.num_loop_calls, st.num_loop_graph_replays)):  # fmt: skip
            steps.add_metric([kind], n)
            replays.add_metric([kind], hit)
        yield steps
        yield replays
        yield counter(
            "rlt:core_call_row_tokens_total",
            "Tokens over all rows of all core calls (token x depth).",
            st.num_row_tokens,
        )
        yield counter(
            "rlt:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", st.prefix_cache_queries
        )
        yield counter("rlt:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", st.prefix_cache_hits)
        yield counter("rlt:spec_decode_num_drafts_total", "Self-speculative verify rounds.", st.num_spec_drafts)
        yield counter("rlt:spec_decode_num_draft_tokens_total", "Draft tokens proposed.", st.num_spec_draft_tokens)
        yield counter(
            "rlt:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", st.num_spec_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            "rlt:spec_decode_num_accepted_tokens_per_pos", "Verify rounds whose draft at this position was accepted.",
            labels=["position"],
        )
        for i, count in enumerate(st.spec_accepted_per_pos or [0]):
            per_pos.add_metric([str(i)], count)
        yield per_pos
        counts = st.exit_depth_counts
        yield _histogram("rlt:exit_depth", "Depth (0-based) at which a token left the core.", counts, _EXIT)
        loops = {d + 1: c for d, c in counts.items()}
        yield _histogram("rlt:loops_per_token", "Loops a token ran before leaving the core.", loops, _DEPTHS)
        gen = {d + 1: c for d, c in st.sample_depth_counts.items()}
        yield _histogram(
            "rlt:generation_loops_per_token",
            "Loops of the state each plainly sampled token came from (early exit lowers it).",
            gen,
            _DEPTHS,
        )
        yield _histogram(
            "rlt:spec_decode_draft_depth", "Loops a round's drafts ran (adaptive speculation picks it).",
            st.spec_draft_depth_counts, _DEPTHS,
        )


def _histogram(name: str, doc: str, counts: dict[int, int], bounds: tuple[float, ...]) -> HistogramMetricFamily:
    """A histogram family from exact per-value counts."""
    buckets = [(str(b), sum(c for v, c in counts.items() if v <= b)) for b in bounds]
    buckets.append(("+Inf", sum(counts.values())))
    total = float(sum(v * c for v, c in counts.items()))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class WorkerMetrics:
    """The worker's registry; the loop feeds it and `render()` gives the exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._stats = _StatsCollector()
        self.registry.register(self._stats)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.core_call_rows = hist("rlt:core_call_rows", "Rows (request spans at one depth) per core call.", _POW2)
        self.core_call_depths = hist("rlt:core_call_depths", "Distinct depths per core call.", _DEPTHS)
        self.core_call_tokens = hist("rlt:core_call_tokens", "Tokens per core call.", _POW2)
        self.step_seconds = hist("rlt:engine_step_seconds", "Wall time of one engine step with a core call.", _SECONDS)
        self.prefill_seconds = hist(
            "rlt:request_prefill_time_seconds", "Submit to first token, on the worker.", _REQUEST_SECONDS
        )
        self.decode_seconds = hist(
            "rlt:request_decode_time_seconds", "First token to finish, on the worker.", _REQUEST_SECONDS
        )
        r = self.registry
        self.transfer_bytes = Counter("rlt:kv_transfer_bytes", "KV and final-state bytes moved (PD).",
                                      ["direction"], registry=r)  # fmt: skip
        self.transfer_chunks = Counter("rlt:kv_transfer_chunks", "KV writes (one per chunk, plus the final state).",
                                       ["direction"], registry=r)  # fmt: skip
        for d in ("sent", "received"):
            self.transfer_bytes.labels(d)
            self.transfer_chunks.labels(d)
        self.transfer_failures = Counter("rlt:kv_transfer_failures", "KV writes or notifications that failed.",
                                         ["reason"], registry=r)  # fmt: skip
        for reason in ("error", "timeout", "stale", "bad_notification"):
            self.transfer_failures.labels(reason)
        self.write_seconds = hist("rlt:kv_transfer_write_seconds", "One KV write, posted to complete.", _SECONDS)
        self.request_transfer_seconds = Histogram(
            "rlt:kv_transfer_request_seconds", "Per request: prefill accepted to every write complete (prefill), "
            "reserved to activated (decode).", ["role"], buckets=_REQUEST_SECONDS, registry=r,
        )  # fmt: skip
        for role in ("prefill", "decode"):
            self.request_transfer_seconds.labels(role)
        self.in_flight_bytes = Gauge("rlt:kv_transfer_in_flight_bytes", "KV bytes posted, not yet complete.",
                                     registry=r)  # fmt: skip
        self.in_flight_writes = Gauge("rlt:kv_transfer_in_flight_writes", "KV writes posted, not yet complete.",
                                      registry=r)  # fmt: skip
        self.registrations = Gauge("rlt:kv_transfer_registrations", "Memory regions registered with the transport.",
                                   registry=r)  # fmt: skip
        self.held = Gauge("rlt:pd_requests_held", "PD requests held: prefills awaiting release, reservations "
                          "awaiting activation.", registry=r)  # fmt: skip
        self.free_state_slots = Gauge("rlt:pd_free_state_slots", "Free final-state slots of the handoff buffer.",
                                      registry=r)  # fmt: skip

    def update_stats(self, stats: EngineStats) -> None:
        self._stats.stats = stats

    def count_error(self) -> None:
        self._stats.errors += 1

    def observe_core_call(self, stats: EngineStats, seconds: float) -> None:
        self.core_call_rows.observe(stats.last_num_rows)
        self.core_call_depths.observe(stats.last_num_depths)
        self.core_call_tokens.observe(stats.last_num_tokens)
        self.step_seconds.observe(seconds)

    # -- PD transfers ------------------------------------------------------------------------
    def observe_write(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels("sent").inc(nbytes)
        self.transfer_chunks.labels("sent").inc()
        self.write_seconds.observe(seconds)

    def count_received(self, nbytes: int) -> None:
        self.transfer_bytes.labels("received").inc(nbytes)
        self.transfer_chunks.labels("received").inc()

    def count_transfer_failure(self, reason: str) -> None:
        self.transfer_failures.labels(reason).inc()

    def observe_prefill_transfer(self, seconds: float) -> None:
        self.request_transfer_seconds.labels("prefill").observe(seconds)

    def observe_receive(self, seconds: float) -> None:
        self.request_transfer_seconds.labels("decode").observe(seconds)

    def set_in_flight(self, nbytes: int, writes: int) -> None:
        self.in_flight_bytes.set(nbytes)
        self.in_flight_writes.set(writes)

    def set_pd_counts(self, held: int, registrations: int, free_state_slots: int) -> None:
        self.held.set(held)
        self.registrations.set(registrations)
        self.free_state_slots.set(free_state_slots)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
