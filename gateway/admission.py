"""Admission control: predict a request's TTFT and TPOT from measured service rates, and
refuse at once the requests whose objectives cannot be met (pure: no grpc, asyncio, torch).

Predictions come from what the gateway measures online (`gateway.meters`), never from a
fixed table:
- `ServiceMeter`: prompt tokens a worker prefills per second while it has work, over its
  last completions (busy time only, so an idle worker does not look slow);
- `StepMeter`: a decode worker's time per output token, by how many requests it runs.

A request is refused with a retry hint when its predicted TTFT exceeds its TTFT objective
(tokens queued ahead of it, plus those in flight and its own, over the tier's rate), or
when the decode tier's time per token over its life (`StepMeter.predict_life`: the running
requests leaving as they finish, others joining at the recent rate) would exceed its TPOT
objective even if it fared as well as the luckiest recent request did against its
estimate (`RatioMeter.quantile`, `BEST_CASE_QUANTILE`), or, while recent requests miss
their TPOT objectives, as well as a less lucky one (`best_case_quantile`).
With nothing measured yet the gateway admits: a cold start must not refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# TPOT admission refuses a request only when it would miss even at this quantile of recent
# requests' measured/estimated ratios: a refusal is a certain miss, an admission a likely
# hit unless the forecast is far over. Refusing on the median forecast refused requests at
# light load that would have met their objective: seen in the short benchmark, 5 of 40
# refused at 0.373 req/s on a predicted 89-91 ms against 86.1 ms while the 35 served ran at
# a TPOT p50 of 73 ms and p99 of 87 ms. The lowest quarter still refused them: in the next
# short compare, 8 refused at 0.37-0.74 req/s "at best" 86-95 ms against 85 ms while the
# requests sent within 4 s of them ran at 60-92 ms, 26 of 29 within the objective. So the
# best case is the luckiest recent request's ratio.
BEST_CASE_QUANTILE = 0.0
# ...while the requests admitted that way keep their TPOT objectives. Once more than
# TPOT_MISS_ALLOWANCE of the decode worker's recent finished requests missed theirs, the
# best case moves up the recent ratios, to their median (no lucky request assumed) at
# TPOT_MISS_AT_MEDIAN: under overload the luckiest of 16 ratios is far below the rest, and
# admitting on it let in requests that then missed. Seen in the short benchmark at 3.57 and
# 4.24 req/s: 22 and 29 refused, 56 and 118 of the served missing TPOT. Misses count only
# since the worker last ran out of requests (`RatioMeter.drained`).
TPOT_MISS_ALLOWANCE = 0.05
TPOT_MISS_AT_MEDIAN = 0.15
# A refusal's retry hint is clamped to this range (seconds).
MIN_RETRY_S = 0.5
MAX_RETRY_S = 60.0


class Reason(str, Enum):
    QUEUE_FULL = "queue_full"
    TTFT = "ttft_slo"
    TPOT = "tpot_slo"
    # Admitted, then the queue grew past what its objective allows.
    TTFT_QUEUED = "ttft_slo_queued"


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: Reason
    message: str
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Forecast:
    """What the gateway expects for one request if admitted now; None: no estimate yet.
    ``tpot_best_s``: its TPOT if it fares as well against the estimate as the luckiest
    recent request did (None: ``tpot_s``)."""

    ttft_s: float | None
    tpot_s: float | None
    tpot_best_s: float | None = None


def best_case_quantile(miss_share: float | None) -> float:
    """The quantile of recent measured/estimated TPOT ratios a TPOT forecast's best case
    takes, given the share of recent finished requests that missed their TPOT objectives
    (None: too few judged): `BEST_CASE_QUANTILE` up to `TPOT_MISS_ALLOWANCE`, rising
    linearly to the median at `TPOT_MISS_AT_MEDIAN` and above."""
    if miss_share is None or miss_share <= TPOT_MISS_ALLOWANCE:
        return BEST_CASE_QUANTILE
    rise = (miss_share - TPOT_MISS_ALLOWANCE) / (TPOT_MISS_AT_MEDIAN - TPOT_MISS_ALLOWANCE)
    return min(BEST_CASE_QUANTILE + rise * (0.5 - BEST_CASE_QUANTILE), 0.5)


def remaining_tokens(pending_tokens: int, working_s: float, tokens_per_s: float | None) -> int:
    """Of ``pending_tokens`` sent to a worker that has worked ``working_s`` on them at
    ``tokens_per_s``, those still to do (all of them with no rate). A queued request
    forecast again while it waits is not charged twice for the in-flight work done since."""
    if not tokens_per_s:
        return pending_tokens
    return max(pending_tokens - int(tokens_per_s * working_s), 0)


def predict_ttft_s(tokens_ahead: int, num_prompt_tokens: int, tokens_per_s: float | None) -> float | None:
    """Queued work ahead plus the request's own prompt, at the rate the tier serves."""
    if not tokens_per_s:
        return None
    return (tokens_ahead + num_prompt_tokens) / tokens_per_s


def decide(forecast: Forecast, ttft_slo_s: float | None, tpot_slo_s: float | None) -> Refusal | None:
    """None to admit; else why not and when to retry."""
    if ttft_slo_s is not None and forecast.ttft_s is not None and forecast.ttft_s > ttft_slo_s:
        excess = forecast.ttft_s - ttft_slo_s
        predicted, objective = _distinct(forecast.ttft_s, ttft_slo_s, 2)
        return Refusal(
            Reason.TTFT,
            f"predicted time to first token {predicted} s exceeds the request's "
            f"objective of {objective} s at the current load; retry later, send it as "
            f"a lower priority or with a looser slo.ttft_ms",
            _clamp(excess),
        )
    best = forecast.tpot_s if forecast.tpot_best_s is None else forecast.tpot_best_s
    if tpot_slo_s is not None and forecast.tpot_s is not None and best > tpot_slo_s:
        best_ms, objective_ms = _distinct(best * 1000, tpot_slo_s * 1000, 0)
        at_best = (f" (at best {best_ms} ms)"
                   if round(best * 1000) != round(forecast.tpot_s * 1000) else "")
        predicted_ms = f"{forecast.tpot_s * 1000:.0f}" if at_best else best_ms
        return Refusal(
            Reason.TPOT,
            f"predicted time per output token {predicted_ms} ms{at_best} exceeds "
            f"the request's objective of {objective_ms} ms with the decode tier's "
            f"current batch; retry later or with a looser slo.tpot_ms",
            # Running requests finish and leave within a few seconds at these rates.
            _clamp(2.0),
        )
    return None


def figure(value: float, digits: int) -> str:
    """``value`` to ``digits`` decimals, or up to 3 more where a non-zero value would read
    as zero: from `pdserve generate --slo-ttft-ms 1`, "the request's objective of 0.00 s"."""
    return f"{value:.{_decimals(value, digits)}f}"


def _decimals(value: float, digits: int) -> int:
    """``digits``, or up to 3 more where a non-zero ``value`` would read as zero."""
    extra = 0
    while extra < 3 and value > 0 and float(f"{value:.{digits + extra}f}") == 0:
        extra += 1
    return digits + extra


def _distinct(value: float, objective: float, digits: int) -> tuple[str, str]:
    """Both numbers as `figure`s, with as many more decimals (up to 3) as tell them apart:
    seen in the short benchmark, "at best 49 ms exceeds the request's objective of 49 ms"."""
    digits = _decimals(objective, digits)
    extra = 0
    while extra < 3 and f"{value:.{digits + extra}f}" == f"{objective:.{digits + extra}f}":
        extra += 1
    return f"{value:.{digits + extra}f}", f"{objective:.{digits + extra}f}"


def _clamp(seconds: float) -> float:
    return min(max(seconds, MIN_RETRY_S), MAX_RETRY_S)
