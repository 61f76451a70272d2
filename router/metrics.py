"""The router's /metrics: its own serving metrics plus every worker's, labelled by worker.

Router metrics use vLLM's names under `rlt:` and live in their own registry. Credits, queue
length and worker liveness are read from the admission book and the pool at scrape time, so they
can never drift from the state they describe. Each worker's latest exposition text (sent every
second) is parsed, given a `worker="id"` label, and merged family by family, so one scrape shows
every process and a family that several workers export appears once.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from router.admission import Admission
from router.pd import PHASES, PDRouter
from router.worker_pool import WorkerPool

_LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_TOKENS = tuple(float(x) for x in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000))

ROUTER_METRIC_NAMES = (
    "rlt:time_to_first_token_seconds",
    "rlt:inter_token_latency_seconds",
    "rlt:e2e_request_latency_seconds",
    "rlt:request_queue_time_seconds",
    "rlt:request_prompt_tokens",
    "rlt:request_generation_tokens",
    "rlt:router_requests_total",
    "rlt:worker_up",
    "rlt:credits_reserved_pages",
    "rlt:credits_free_pages",
    "rlt:credits_reserved_slots",
    "rlt:credits_free_slots",
    "rlt:router_queue_length",
    "rlt:router_streams",
    "rlt:router_tickets",
    "rlt:role_credits_reserved_pages",
    "rlt:role_credits_free_pages",
    "rlt:role_credits_reserved_slots",
    "rlt:role_credits_free_slots",
    "rlt:pd_requests",
    "rlt:pd_failures_total",
    "rlt:pd_handoff_seconds",
)


class _StateCollector(Collector):
    """Gauges over the pool and the admission book, computed per scrape."""

    def __init__(self, pool: WorkerPool, admission: Admission, pd: PDRouter | None) -> None:
        self.pool, self.admission, self.pd = pool, admission, pd

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("rlt:worker_up", "1 while the worker is alive and ready.", labels=["worker"])
        names = (
            ("rlt:credits_reserved_pages", "KV pages reserved by admitted requests."),
            ("rlt:credits_free_pages", "KV pages the router may still promise."),
            ("rlt:credits_reserved_slots", "Request slots reserved by admitted requests."),
            ("rlt:credits_free_slots", "Request slots the router may still promise."),
        )
        fams = {n: GaugeMetricFamily(n, doc, labels=["worker"]) for n, doc in names}
        for wid, st in self.pool.workers.items():
            up.add_metric([wid], 1.0 if st.serving else 0.0)
            c = self.admission.workers.get(wid)
            alive = c is not None and c.accepting
            fams["rlt:credits_reserved_pages"].add_metric([wid], c.reserved_pages if c else 0)
            fams["rlt:credits_free_pages"].add_metric([wid], c.free_pages if alive else 0)
            fams["rlt:credits_reserved_slots"].add_metric([wid], c.reserved_slots if c else 0)
            fams["rlt:credits_free_slots"].add_metric([wid], c.free_slots if alive else 0)
        yield up
        yield from fams.values()
        yield GaugeMetricFamily(
            "rlt:router_queue_length", "Requests waiting for credits.", value=self.admission.queue_length
        )
        yield GaugeMetricFamily(
            "rlt:router_streams", "Worker requests the router is reading.", value=self.pool.num_streams
        )
        yield GaugeMetricFamily(
            "rlt:router_tickets", "Credit tickets not yet returned.", value=len(self.admission.outstanding())
        )
        yield from self._roles()
        # PD families exist without PD too (all zero), so dashboards and scrapes see one schema.
        counts = self.pd.phase_counts() if self.pd is not None else dict.fromkeys(PHASES, 0)
        phases = GaugeMetricFamily("rlt:pd_requests", "PD handoffs in flight by phase.", labels=["phase"])
        for phase, n in counts.items():
            phases.add_metric([phase], n)
        yield phases
        failures = CounterMetricFamily("rlt:pd_failures", "PD handoffs that failed, by phase.", labels=["phase"])
        for phase in PHASES:
            failures.add_metric([phase], self.pd.failures.get(phase, 0) if self.pd is not None else 0)
        yield failures

    def _roles(self) -> Iterator[Metric]:
        """Credits summed per role (both | prefill | decode) over live workers."""
        names = ("reserved_pages", "free_pages", "reserved_slots", "free_slots")
        sums: dict[str, dict[str, int]] = {n: {} for n in names}
        for c in self.admission.workers.values():
            alive = c.accepting
            vals = (c.reserved_pages, c.free_pages if alive else 0, c.reserved_slots, c.free_slots if alive else 0)
            for n, v in zip(names, vals):
                sums[n][c.role] = sums[n].get(c.role, 0) + v
        for n in names:
            fam = GaugeMetricFamily(f"rlt:role_credits_{n}", f"Credits ({n.replace('_', ' ')}) per worker role.",
                                    labels=["role"])  # fmt: skip
            for role, v in sorted(sums[n].items()):
                fam.add_metric([role], v)
            yield fam


class _WorkerCollector(Collector):
    """Every worker's latest families, relabelled with its id and merged by family name."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._parsed: dict[str, tuple[str, list[Metric]]] = {}  # worker -> (text, families)

    def _families(self, wid: str, text: str) -> list[Metric]:
        cached = self._parsed.get(wid)
        if cached is not None and cached[0] is text:
            return cached[1]
        try:
            fams = list(text_string_to_metric_families(text))
        except ValueError:
            fams = []
        self._parsed[wid] = (text, fams)
        return fams

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for wid, st in self.pool.workers.items():
            if not st.metrics_text:
                continue
            for fam in self._families(wid, st.metrics_text):
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "worker": wid}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()


class RouterMetrics:
    def __init__(self, pool: WorkerPool, admission: Admission, pd: PDRouter | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram(
            "rlt:time_to_first_token_seconds", "Arrival at the router to the first token.", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "rlt:inter_token_latency_seconds", "Time between streamed tokens.", buckets=_ITL, registry=r
        )
        self.e2e = Histogram("rlt:e2e_request_latency_seconds", "Arrival to the last token.", buckets=_E2E, registry=r)
        self.queue_time = Histogram(
            "rlt:request_queue_time_seconds",
            "Arrival to credits reserved (admission wait).",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "rlt:request_prompt_tokens", "Prompt tokens per request.", buckets=_TOKENS, registry=r
        )
        self.generation_tokens = Histogram(
            "rlt:request_generation_tokens", "Generated tokens per request.", buckets=_TOKENS, registry=r
        )
        self.requests = Counter(
            "rlt:router_requests", "HTTP generation requests by status code.", ["status"], registry=r
        )
        self.handoff = Histogram(
            "rlt:pd_handoff_seconds", "PD: router admission to the decode worker's commit.", buckets=_LATENCY, registry=r
        )
        if pd is not None:
            pd.on_handoff = self.handoff.observe
        r.register(_StateCollector(pool, admission, pd))
        r.register(_WorkerCollector(pool))

    def count(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
