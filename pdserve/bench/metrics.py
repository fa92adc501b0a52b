"""Pure computations over request records: latency statistics, throughput and goodput.

Definitions (the same as ``vllm bench serve`` unless noted):

- TTFT: send to the first chunk that carried a token.
- TPOT: (E2E - TTFT) / (output_tokens - 1); undefined for one output token.
- ITL: gaps between streamed chunks, spread over each chunk's tokens (`RequestRecord.itls_s`).
- E2E: send to the end of the stream.
- Duration: start of the measured phase to the last request's end.
- Request goodput: requests/s that succeeded and met every given SLO (``--goodput``).
- SLO attainment: the fraction of all measured requests, failures included, that did so.
- DistServe goodput: the highest request rate whose attainment is still >= 90%,
  interpolated linearly between the swept rates.

No grpc, asyncio or I/O here: everything is a function of records and numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.record import RequestRecord

PERCENTILES = (50, 90, 99)
DISTSERVE_TARGET = 0.9


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


@dataclass(slots=True, frozen=True)
class LatencyStats:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats | None:
        """None for no values: "no measurement" must not read as zero latency."""
        if not values:
            return None
        return cls(len(values), sum(values) / len(values), *(percentile(values, q)
                                                               for q in PERCENTILES))


@dataclass(slots=True, frozen=True)
class SLO:
    """Per-request service-level objectives; None means not constrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        ttft, tpot = record.ttft_s, record.tpot_s
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            return False
        # A one-token answer has no decode phase, so it cannot miss a TPOT objective.
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s

    def of(self, class_name: str) -> SLO:
        """The SLO of a class: the same for every class (see `SLOTable`)."""
        return self


@dataclass(slots=True, frozen=True)
class SLOTable:
    """SLOs per request class (``mixed``: interactive and offline have their own).

    A record is judged by its class's SLO; a class not in the table by `default`.
    """

    default: SLO = field(default_factory=SLO)
    by_class: dict[str, SLO] = field(default_factory=dict)

    def of(self, class_name: str) -> SLO:
        return self.by_class.get(class_name, self.default)

    def met_by(self, record: RequestRecord) -> bool:
        return self.of(record.class_name).met_by(record)


Objective = SLO | SLOTable


@dataclass(slots=True)
class Summary:
    num_requests: int
    num_ok: int
    errors: dict[str, int]  # error code name -> count
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput_rps: float
    output_tok_s: float
    request_goodput_rps: float
    slo_attainment: float
    ttft_s: LatencyStats | None
    tpot_s: LatencyStats | None
    itl_s: LatencyStats | None
    e2e_s: LatencyStats | None
    by_class: dict[str, Summary] = field(default_factory=dict)


def run_duration_s(records: Iterable[RequestRecord]) -> float:
    """From the start of the measured phase (time 0) to the last request's end."""
    return max((r.done_s for r in records if r.done_s is not None), default=0.0)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Objective) -> Summary:
    """Statistics of one set of records over a run of `duration_s` seconds."""
    ok = [r for r in records if r.ok]
    num_good = sum(slo.met_by(r) for r in records)
    output_tokens = sum(r.output_tokens for r in ok)
    per_second = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        errors=dict(sorted(Counter(r.error for r in records if r.error).items())),
        duration_s=duration_s,
        prompt_tokens=sum(r.prompt_len for r in ok),
        output_tokens=output_tokens,
        request_throughput_rps=per_second(len(ok)),
        output_tok_s=per_second(output_tokens),
        request_goodput_rps=per_second(num_good),
        slo_attainment=num_good / len(records) if records else 0.0,
        ttft_s=LatencyStats.of([t for r in ok if (t := r.ttft_s) is not None]),
        tpot_s=LatencyStats.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl_s=LatencyStats.of([x for r in ok for x in r.itls_s()]),
        e2e_s=LatencyStats.of([t for r in ok if (t := r.e2e_s) is not None]),
    )


def summarize_run(records: Sequence[RequestRecord], slo: Objective) -> Summary:
    """Overall summary plus one per request class, all over the whole run's duration."""
    duration_s = run_duration_s(records)
    overall = summarize(records, duration_s, slo)
    classes = sorted({r.class_name for r in records})
    if len(classes) > 1:
        overall.by_class = {c: summarize([r for r in records if r.class_name == c],
                                         duration_s, slo) for c in classes}
    return overall


@dataclass(slots=True, frozen=True)
class SweepPoint:
    rate_rps: float
    slo_attainment: float


def distserve_goodput(points: Sequence[SweepPoint], target: float = DISTSERVE_TARGET) -> float:
    """The highest rate at which >= `target` of requests meet the SLOs (DistServe).

    Walks the rates upward to the first one below target and interpolates linearly
    between it and the rate before it. If even the lowest rate misses, 0.0; if no rate
    misses, the highest rate swept (a lower bound: the sweep did not reach the knee).
    """
    if not points:
        raise ValueError("goodput of an empty sweep")
    ordered = sorted(points, key=lambda p: p.rate_rps)
    if ordered[0].slo_attainment < target:
        return 0.0
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.slo_attainment < target:
            fraction = (prev.slo_attainment - target) / (prev.slo_attainment - cur.slo_attainment)
            return prev.rate_rps + fraction * (cur.rate_rps - prev.rate_rps)
    return ordered[-1].rate_rps
