"""The forecaster: what the workers' measured rates say a request will see.

Admission refuses a request whose forecast misses its objectives (admission.py decides); the
dispatcher forecasts a queued request again as it waits and reads the same rates to place it.
Every figure comes from the meters each worker keeps (meters.py), read at ``now``:

- a request's TTFT, counted from its arrival: through the prefill tier behind the prompt
  tokens queued and in flight there, or on a decode worker where that is sooner (a short
  prompt prefilled where it decodes, a long one a decode worker would rescue);
- its TPOT: the step of the decode worker it would join, median and best case;
- the rates placement reads: the tier's alone rate (`rescue_rate`), a decode worker's own
  prefill rate (`local_rate`), and whether decode runs beside the tier (`decode_busy`).
"""

from __future__ import annotations

from gateway.admission import Forecast, predict_ttft_s, remaining_tokens
from gateway.placement import PlacementConfig, rescue_long
from gateway.queue import Ticket
from gateway.workers import WorkerPool


class Forecaster:
    def __init__(self, workers: WorkerPool, placement: PlacementConfig) -> None:
        self._workers = workers
        self._placement = placement

    def forecast(self, ticket: Ticket, queued_ahead: int, now: float) -> Forecast:
        """Its TTFT (from arrival) with ``queued_ahead`` prompt tokens queued before it, and
        the TPOT of the decode worker it would join."""
        ttft = self.ttft_s(ticket, queued_ahead, now)
        tpots = [t for w in self._workers.routable("decode")
                 if (t := w.predict_join_tpot_s(ticket.max_tokens, now)) is not None]
        return Forecast(ttft, min(t for t, _ in tpots) if tpots else None,
                        min(best for _, best in tpots) if tpots else None)

    def ttft_s(self, ticket: Ticket, queued_ahead: int, now: float) -> float | None:
        """Its time to first token counted from its arrival, with ``queued_ahead`` prompt
        tokens queued before it: through the prefill tier, or on a decode worker where that
        is sooner (a short prompt, or a long one a decode worker would rescue); None: no
        estimate (no recent rate, or a local prefill not yet timed)."""
        # The rate measured under the decode load there is now (meters.ServiceMeter: a
        # prompt sent with decode idle is not judged by rates measured beside decode).
        contended = self.decode_busy()
        rates, in_flight = [], 0
        for w in self._workers.routable("prefill"):
            rate = w.prefill_meter.tokens_per_s(now, w.queued_tokens, contended)
            if rate:
                rates.append(rate)
            in_flight += remaining_tokens(w.queued_tokens, w.prefill_meter.working_s(now), rate)
        ttft = predict_ttft_s(queued_ahead + in_flight, ticket.num_prompt_tokens, sum(rates) if rates else None)
        decode = self._workers.decode_loads(now)
        kv_tokens = ticket.num_prompt_tokens + ticket.max_tokens
        if ttft is not None and (rescue := rescue_long(ticket.num_prompt_tokens, kv_tokens, decode,
                                                       self._placement, self.rescue_rate(now))) is not None:
            # A decode worker would take it within its slack if the tier cannot start it in time.
            if rescue.predicted_ttft_s is not None:
                ttft = min(ttft, rescue.predicted_ttft_s)
        if ticket.num_prompt_tokens <= self._placement.local_prefill_max_tokens:
            local = [d.local_ttft_s(ticket.num_prompt_tokens, fitted_only=True)
                     for d in decode if d.has_seat(kv_tokens)]
            known = [t for t in local if t is not None]
            if known:
                ttft = min(known) if ttft is None else min(ttft, min(known))
            elif local:  # it may run here, at a time not measured yet: no refusal on TTFT
                ttft = None
        return None if ttft is None else ttft + now - ticket.arrival_s

    def decode_busy(self) -> bool:
        """The decode tier has requests running (a prefill beside it on shared cores runs
        slower: `meters.ServiceMeter`)."""
        return any(w.seats for w in self._workers.routable("decode"))

    def rescue_rate(self, now: float) -> float | None:
        """The prefill tier's fastest recent rate with decode idle: what a decode worker that
        has timed no prefill of its own is taken to prefill a rescued long prompt at."""
        return max((r for w in self._workers.routable("prefill")
                    if (r := w.prefill_meter.tokens_per_s(now, contended=False))), default=None)

    def local_rate(self, now: float) -> float | None:
        """The fastest rate a decode worker has prefilled its own prompts at, however long
        ago: what a prefill worker that has none of its own is taken to run at alone."""
        return max((r for w in self._workers.routable("decode")
                    if (r := w.local_meter.alone_tokens_per_s(now))), default=None)
