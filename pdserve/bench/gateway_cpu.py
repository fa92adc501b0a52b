"""The gateway's CPU cost per generated token, from its /metrics before and after a run.

    us per token = 1e6 * (delta process_cpu_seconds_total
                          + delta pdserve_tokenizer_pool_cpu_seconds_total) / output tokens

``process_cpu_seconds_total`` (prometheus_client's process collector) counts the gateway
process alone; its tokenizer pool runs in child processes, which the gateway exports as
the second counter. Without the first there is no measurement and the run fails; without
the second the figure is the gateway's alone and says so.
"""

from __future__ import annotations

import urllib.error
from dataclasses import dataclass

from pdserve import prom

GATEWAY_CPU = "process_cpu_seconds_total"
POOL_CPU = "pdserve_tokenizer_pool_cpu_seconds_total"


class GatewayMetricsError(RuntimeError):
    """The gateway's /metrics cannot be read or lacks its CPU counter."""


@dataclass(slots=True, frozen=True)
class CpuSample:
    gateway_s: float
    pool_s: float | None  # None: the pool's counter is not exported


@dataclass(slots=True, frozen=True)
class GatewayCpu:
    gateway_cpu_s: float
    pool_cpu_s: float | None
    output_tokens: int
    # (gateway + pool) CPU per generated token; None when the run generated nothing.
    us_per_token: float | None
    note: str


def cpu_sample(text: str, source: str = "the gateway's /metrics") -> CpuSample:
    gateway = prom.samples_sum(text, GATEWAY_CPU)
    if gateway is None:
        raise GatewayMetricsError(
            f"{source} has no {GATEWAY_CPU}: is this the gateway's metrics address (pdserve up "
            "--metrics-port P serves it on P), and does prometheus_client's process collector "
            "run there (it needs Linux /proc)?")
    return CpuSample(gateway, prom.samples_sum(text, POOL_CPU))


def gateway_cpu(before: CpuSample, after: CpuSample, output_tokens: int) -> GatewayCpu:
    gateway_s = after.gateway_s - before.gateway_s
    pool_s = (None if before.pool_s is None or after.pool_s is None
              else after.pool_s - before.pool_s)
    total_s = gateway_s + (pool_s or 0.0)
    note = ("gateway process + tokenizer pool" if pool_s is not None
            else f"gateway process only: {POOL_CPU} is missing, the pool is not counted")
    us = 1e6 * total_s / output_tokens if output_tokens > 0 else None
    return GatewayCpu(gateway_s, pool_s, output_tokens, us, note)


def scrape(address: str) -> CpuSample:
    """A `CpuSample` from ``HOST:PORT`` (the gateway's metrics port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise GatewayMetricsError(f"gateway metrics address {address!r}: want HOST:PORT")
    try:
        text = prom.scrape(int(port), host or "127.0.0.1")
    except (urllib.error.URLError, OSError) as e:
        raise GatewayMetricsError(f"cannot read http://{address}/metrics: {e}") from e
    return cpu_sample(text, f"http://{address}/metrics")
