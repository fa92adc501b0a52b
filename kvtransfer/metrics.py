"""Prometheus metrics of KV transfers.

Recorded inside vLLM's engine process; the worker's server process sets
PROMETHEUS_MULTIPROC_DIR before starting the engine and exports them with its own.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes",
    "Bytes of paged KV moved, by transport and direction (send on the producer, recv on the consumer).",
    ["transport", "direction"],
)
TRANSFER_TOKENS = Counter(
    "pdserve_kv_transfer_tokens",
    "Prompt tokens whose KV was moved, by transport and direction.",
    ["transport", "direction"],
)
TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_duration_seconds",
    "Time to move one request's KV, by transport and direction.",
    ["transport", "direction"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures",
    "KV loads that failed, by transport and reason (missing, size, layout, peer, timeout).",
    ["transport", "reason"],
)

LEASES_OUTSTANDING = Gauge(
    "pdserve_kv_leases_outstanding",
    "Prompts whose KV a producer holds staged for a consumer, by transport.",
    ["transport"],
    multiprocess_mode="livesum",
)

DECODE_YIELD_SECONDS = Counter(
    "pdserve_decode_yield_seconds",
    "Seconds a decode engine slept at the start of its steps so that a prefill engine on the "
    "same cores could run (pdserve up --decode-yield-ms).",
)


def record_transfer(transport: str, direction: str, num_tokens: int, nbytes: int, seconds: float) -> None:
    TRANSFER_BYTES.labels(transport, direction).inc(nbytes)
    TRANSFER_TOKENS.labels(transport, direction).inc(num_tokens)
    TRANSFER_SECONDS.labels(transport, direction).observe(seconds)


def record_failure(transport: str, reason: str) -> None:
    TRANSFER_FAILURES.labels(transport, reason).inc()


def set_leases(transport: str, count: int) -> None:
    LEASES_OUTSTANDING.labels(transport).set(count)
