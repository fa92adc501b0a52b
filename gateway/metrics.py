"""The gateway's Prometheus metrics; vLLM's names where the concept is the same."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

REQUESTS = Counter("pdserve_requests", "Finished Generate calls, by gRPC status code.", ["code"])
INFLIGHT = Gauge("pdserve_requests_inflight", "Generate calls in progress at the gateway.")
WORKERS_READY = Gauge("pdserve_workers_ready", "Routable workers, by tier.", ["role"])
TTFT = Histogram(
    "vllm:time_to_first_token_seconds",
    "Time from request arrival at the gateway to its first token leaving it.",
    buckets=LATENCY_BUCKETS,
)
E2E = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Time from request arrival at the gateway to its last token leaving it.",
    buckets=LATENCY_BUCKETS,
)
ITL = Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between streamed messages, per token.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Tokens generated for finished requests.")
KV_HANDOFF_TOKENS = Counter(
    "pdserve_kv_handoff_tokens",
    "Prompt tokens whose KV the decode tier received from the prefill tier instead of computing.",
)

# Serving policy, by class ("interactive", "batch", "offline").
QUEUE_LENGTH = Gauge("pdserve_queue_length", "Requests waiting in the gateway's queue, by class.", ["priority"])
QUEUE_WAIT = Histogram(
    "pdserve_queue_wait_seconds",
    "Time from arrival at the gateway to placement on a worker, by class.",
    ["priority"],
    buckets=LATENCY_BUCKETS,
)
ADMISSIONS = Counter("pdserve_admissions", "Requests admitted to the queue, by class.", ["priority"])
REFUSALS = Counter(
    "pdserve_refusals",
    "Requests refused with RESOURCE_EXHAUSTED, by class and reason: queue_full, ttft_slo and tpot_slo "
    "at arrival, ttft_slo_queued when a queued request can no longer meet its TTFT objective.",
    ["priority", "reason"],
)
EXPIRED = Counter(
    "pdserve_queue_expired",
    "Requests whose deadline passed while queued in the gateway (never sent to a worker), by class.",
    ["priority"],
)
SEAT_HOLDS = Histogram(
    "pdserve_seat_hold_seconds",
    "Time prefilled requests waited for a decode seat while held back for a higher class (their "
    "joining would have made its running requests miss their TPOT objectives), by class.",
    ["priority"],
    buckets=LATENCY_BUCKETS,
)
PLACEMENTS = Counter(
    "pdserve_placements",
    "Where prompts were prefilled: remote (the prefill tier) or local (the decode worker itself).",
    ["where"],
)
MOVED_PREFILLS = Counter(
    "pdserve_prefills_moved",
    "Remote prefills that did not answer within twice their predicted time and were taken "
    "back and prefilled on a decode worker instead.",
)
RESCUED_PREFILLS = Counter(
    "pdserve_prefills_rescued",
    "Prompts longer than --local-prefill-max-tokens prefilled on a decode worker because the "
    "prefill tier was full or measured too slow for their TTFT objective, or stalled there "
    "(those count as moved too): a sign the prefill tier is short of capacity.",
)
TPOT_FORECAST_RATIO = Histogram(
    "pdserve_tpot_forecast_ratio",
    "Finished requests' measured time per output token over the TPOT that admission "
    "forecast when they joined a decode worker (1: exact; above 1 the forecast read low).",
    buckets=(0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0),
)
CLASS_TTFT = Histogram(
    "pdserve_time_to_first_token_seconds",
    "Time from arrival at the gateway to the first token leaving it, by class.",
    ["priority"],
    buckets=LATENCY_BUCKETS,
)
CLASS_E2E = Histogram(
    "pdserve_e2e_request_latency_seconds",
    "Time from arrival at the gateway to the last token leaving it, by class.",
    ["priority"],
    buckets=LATENCY_BUCKETS,
)
CLASS_ITL = Histogram(
    "pdserve_inter_token_latency_seconds",
    "Time between streamed messages, per token, by class.",
    ["priority"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
SLO_REQUESTS = Counter(
    "pdserve_slo_requests",
    "Finished requests with objectives, by class and whether they met all of them "
    "(attainment = met=\"true\" / all).",
    ["priority", "met"],
)


def observe_finished(label: str, e2e_s: float, ttft_s: float | None, num_generated: int,
                     ttft_slo_s: float | None, tpot_slo_s: float | None) -> None:
    """Per-class E2E and, for a request with objectives, whether it met them (TPOT as the
    benchmarks count it: (E2E - TTFT) / (tokens - 1))."""
    CLASS_E2E.labels(label).observe(e2e_s)
    if ttft_slo_s is None and tpot_slo_s is None:
        return
    ttft = e2e_s if ttft_s is None else ttft_s
    met = ttft_slo_s is None or ttft <= ttft_slo_s
    if tpot_slo_s is not None and num_generated > 1:
        met = met and (e2e_s - ttft) / (num_generated - 1) <= tpot_slo_s
    SLO_REQUESTS.labels(label, "true" if met else "false").inc()


class CpuSecondsCollector:
    """A counter of CPU seconds read at scrape time from ``read`` (e.g. TokenizerPool.cpu_seconds).

    The gateway process's own CPU is prometheus_client's process_cpu_seconds_total; this adds
    what it spends in other processes, so the two sum to the gateway's whole cost.
    """

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name = name
        self._documentation = documentation
        self._read = read

    def describe(self) -> list[CounterMetricFamily]:
        # Without describe() the registry would call collect() at registration.
        return [CounterMetricFamily(self._name, self._documentation)]

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._documentation, value=self._read())]


def register_tokenizer_pool_cpu(
    read: Callable[[], float], registry: CollectorRegistry = REGISTRY
) -> CpuSecondsCollector:
    """Exports pdserve_tokenizer_pool_cpu_seconds_total; unregister the result to stop."""
    collector = CpuSecondsCollector(
        "pdserve_tokenizer_pool_cpu_seconds",
        "User + system CPU seconds of the gateway's tokenizer pool processes, exited ones included.",
        read,
    )
    registry.register(collector)
    return collector
