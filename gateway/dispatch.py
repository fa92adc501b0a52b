"""The dispatcher: the asyncio side of the gateway's queue, admission and placement.

A request's life here:
  1. `admit`: its class's default objectives are filled in, the forecast (forecast.py) is
     made from the queue and the measured rates, and it is refused at once
     (RESOURCE_EXHAUSTED with a retry hint) if it cannot meet them or its queue is full.
  2. `acquire`: it waits in the queue (queue.py) until `pump` places it (placement.py): on
     a prefill worker with room, or on a decode worker that prefills it itself. Its hard
     deadline passing first ends it with DEADLINE_EXCEEDED; it never reaches a worker.
  3. The caller runs it, reporting progress (`prefill_done`, `first_token`, `tokens`), and
     a prefilled request takes a decode seat with `decode_seat`. A remote prefill that
     stalls past `stalled_after_s` is offered a decode worker with `move_stalled`.
  4. `release` gives the seat back. Every change of load calls `pump` again.

`pump` is synchronous and cheap: it walks the queue in policy order and hands out places
while workers have room. A ticket that waits for the prefill tier holds that tier for the
tickets behind it (so the tier runs in the chosen order), but a ticket behind it that a
decode worker may prefill itself can still go there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway import metrics
from gateway.admission import Forecast, Reason, Refusal, decide, figure
from gateway.forecast import Forecaster
from gateway.placement import (Placement, PlacementConfig, PrefixIndex, Where, local_step_tokens, move_stalled,
                               place, place_without_tier, soonest_local_ttft_s, stalled_after_s)
from gateway.queue import Priority, QueueFull, RequestQueue, Ticket
from gateway.seating import Seating
from gateway.workers import Seat, Worker, WorkerPool
from pdserve import rpc

logger = logging.getLogger(__name__)


def predicted_s(value: float | None) -> str:
    """A predicted time as the log lines write it ("nothing": none predicted)."""
    return "nothing" if value is None else f"{value:.2f} s"


# A queued call cancelled this close to its deadline was cancelled by the deadline.
DEADLINE_TOLERANCE_S = 0.05
# The longest a queued request with a TTFT objective waits between two forecasts of it.
RECHECK_S = 0.25


@dataclass(frozen=True, slots=True)
class ClassObjectives:
    """Per-class default objectives (seconds; None: none)."""

    ttft_s: dict[Priority, float | None]
    tpot_s: dict[Priority, float | None]


@dataclass(frozen=True, slots=True)
class Grant:
    """Where a ticket was placed; a local placement comes with its decode seat."""

    placement: Placement
    seat: Seat | None


class Refused(rpc.ResourceExhausted):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message, retry_after_s=refusal.retry_after_s)
        self.reason = refusal.reason


class Dispatcher:
    def __init__(self, queue: RequestQueue, workers: WorkerPool, placement: PlacementConfig,
                 objectives: ClassObjectives, admission: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self._workers = workers
        self._placement = placement
        self._objectives = objectives
        self._admission = admission
        self._clock = clock
        self._waiting: dict[Ticket, asyncio.Future[Grant]] = {}
        self._seating = Seating(workers, placement, admission, clock)
        self._forecaster = Forecaster(workers, placement)
        self._prefixes: PrefixIndex | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Prompts sent to the prefill tier and unanswered: their worker, and the event that
        # asks the call waiting for the answer to try a move to a decode worker now.
        self._remote: dict[Ticket, tuple[Worker, asyncio.Event]] = {}

    # ------------------------------------------------------------ 1. admit ---------------

    def objectives_for(self, priority: Priority, ttft_ms: int | None, tpot_ms: int | None) -> tuple[float | None, float | None]:
        """The request's own objectives where given (0: none), else its class's."""
        ttft = self._objectives.ttft_s[priority] if ttft_ms is None else (ttft_ms / 1000 or None)
        tpot = self._objectives.tpot_s[priority] if tpot_ms is None else (tpot_ms / 1000 or None)
        return ttft, tpot

    def forecast(self, ticket: Ticket) -> Forecast:
        now = self._clock()
        return self._forecaster.forecast(ticket, self.queue.tokens_ahead(ticket, now), now)

    def admit(self, ticket: Ticket) -> None:
        """Raises Refused when the ticket cannot meet its objectives or its queue is full."""
        label = ticket.priority.label
        if self._admission:
            refusal = decide(self.forecast(ticket), ticket.ttft_slo_s, ticket.tpot_slo_s)
            if refusal is not None:
                metrics.REFUSALS.labels(label, refusal.reason.value).inc()
                raise Refused(refusal)
        metrics.ADMISSIONS.labels(label).inc()

    # ------------------------------------------------------------ 2. wait ----------------

    async def acquire(self, ticket: Ticket) -> Grant:
        try:
            self.queue.push(ticket)
        except QueueFull as e:
            metrics.REFUSALS.labels(ticket.priority.label, Reason.QUEUE_FULL.value).inc()
            raise Refused(Refusal(Reason.QUEUE_FULL, f"{e}; retry with backoff", 1.0)) from e
        future = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = future
        self._observe_queue()
        self.pump()
        try:
            return await future
        finally:
            if self._waiting.pop(ticket, None) is not None and self.queue.remove(ticket):
                # Cancelled while queued: by gRPC at the call's deadline (racing our own
                # expiry timer), or by the caller.
                if ticket.expired(self._clock() + DEADLINE_TOLERANCE_S):
                    metrics.EXPIRED.labels(ticket.priority.label).inc()
                self._observe_queue()

    def pump(self) -> None:
        now = self._clock()
        for ticket in self.queue.expire(now):
            self._expire(ticket, now)
        for ticket in self._overdue(now):
            self._refuse_overdue(ticket, now)
        self._seating.serve(now)
        remote_open = True
        for ticket in self.queue.ordered(now):
            if ticket not in self._waiting:
                continue
            placement = self._place(ticket, now, remote_open)
            if placement is None:
                # It waits for the prefill tier unless a decode worker may take it later.
                if ticket.num_prompt_tokens > self._placement.local_prefill_max_tokens:
                    remote_open = False
                continue
            if self._offer_rescue_to_older(ticket, placement):
                remote_open = False  # it keeps its turn: placed again once the offer is answered
                continue
            self.queue.take(ticket)
            if self._hopeless(ticket, placement, now):
                continue
            seat = self._reserve(ticket, placement, now)
            metrics.QUEUE_WAIT.labels(ticket.priority.label).observe(now - ticket.arrival_s)
            metrics.PLACEMENTS.labels(placement.where.value).inc()
            if self._count_rescue(ticket, placement) and self._workers.routable("prefill"):
                logger.info("request %s: its %d-token prompt is prefilled on decode worker %s (predicted %s, "
                            "%.2f s after it came), the prefill tier full or too slow for its objective",
                            ticket.request_id, ticket.num_prompt_tokens, placement.worker,
                            predicted_s(placement.predicted_ttft_s),
                            now - ticket.arrival_s)
            self._waiting.pop(ticket).set_result(Grant(placement, seat))
        self._refuse_predicted_late(now)
        self._observe_queue()
        self._arm_timer()

    def _refuse_predicted_late(self, now: float) -> None:
        """Queued requests forecast again as they wait: one that the forecast now says will
        miss its TTFT objective is refused now, not when the objective passes. Seen in CI:
        of 12 prompts of 600 tokens sent at once with a 3 s objective, the first was admitted
        behind one on the prefill tier while a third was rescued on the decode worker; with
        decode prefilling at normal priority the tier crawled, and the first was refused
        only at 3.0 s. The rate of a worker that has worked on its prompts for longer than
        they take at the measured rate is bounded by that time (ServiceMeter.tokens_per_s),
        so the forecast follows the overrun."""
        if not self._admission:
            return
        ahead = 0
        for ticket in list(self.queue.ordered(now)):
            if ticket not in self._waiting:
                continue
            if ticket.ttft_slo_s is not None:
                predicted = self._forecaster.ttft_s(ticket, ahead, now)
                if predicted is not None and predicted > ticket.ttft_slo_s:
                    self.queue.remove(ticket)
                    self._refuse_late(ticket, predicted, now)
                    continue
            ahead += ticket.num_prompt_tokens

    def _offer_rescue_to_older(self, ticket: Ticket, placement: Placement) -> bool:
        """A long prompt about to be rescued on a decode worker that shares its host with a
        prefill worker holding an older unanswered prompt (one due earlier) is held back once
        while that prompt is offered the move first (`remote_started`); True: held back.

        On shared cores the decode engine prefilling at normal priority takes the cores from
        the prefill engine at idle priority, so a rescue starves the prompts already in
        flight on the tier: seen in the long benchmark, a 1,341-token prompt sent to the
        tier took 11.9 s to its first token (objective 4.6 s) while one sent 1.3 s after it
        was rescued on the decode worker and answered in 2.2 s. Deadline order says the
        older one goes first; the newer one then takes the tier (or a rescue after it)."""
        if (placement.where is not Where.LOCAL or ticket.rescue_offered
                or ticket.num_prompt_tokens <= self._placement.local_prefill_max_tokens):
            return False
        host = self._workers.by_address(placement.worker).info
        movable = max(self._placement.local_prefill_max_tokens, self._placement.rescue_prefill_max_tokens)
        older = [t for t, (w, asked) in self._remote.items()
                 if t.due_s < ticket.due_s and not asked.is_set() and t.num_prompt_tokens <= movable
                 and t.ttft_slo_s is not None and host is not None and w.info is not None
                 and w.info.host_id == host.host_id]
        if not older:
            return False
        ticket.rescue_offered = True
        self._remote[min(older, key=lambda t: t.due_s)][1].set()
        return True

    def remote_started(self, worker: Worker, ticket: Ticket) -> asyncio.Event:
        """A prompt's call to ``worker`` is under way; the event set asks it to try
        `move_stalled` at once (`_offer_rescue_to_older`)."""
        asked = asyncio.Event()
        self._remote[ticket] = (worker, asked)
        return asked

    def remote_ended(self, ticket: Ticket) -> None:
        self._remote.pop(ticket, None)

    def _count_rescue(self, ticket: Ticket, placement: Placement) -> bool:
        """Counts a prompt over the local limit placed on a decode worker; returns whether it was one."""
        if placement.where is Where.LOCAL and ticket.num_prompt_tokens > self._placement.local_prefill_max_tokens:
            metrics.RESCUED_PREFILLS.inc()
            return True
        return False

    def _hopeless(self, ticket: Ticket, placement: Placement, now: float) -> bool:
        """A queued request whose first token can no longer come within its objective is
        refused now (its wait is over either way) rather than take prefill time from the
        requests behind it that still can make theirs."""
        if not self._admission or ticket.ttft_slo_s is None or placement.predicted_ttft_s is None:
            return False
        if (placement.where is Where.LOCAL
                and self._workers.by_address(placement.worker).local_latency.fit(now) is None):
            return False  # a bound from the local rate, not a measured time: no refusal on it
        ttft_s = now - ticket.arrival_s + placement.predicted_ttft_s
        if ttft_s <= ticket.ttft_slo_s:
            return False
        self._refuse_late(ticket, ttft_s, now)
        return True

    def _refuse_late(self, ticket: Ticket, predicted_ttft_s: float, now: float) -> None:
        assert ticket.ttft_slo_s is not None
        self._refuse_queued(ticket, f"after {now - ticket.arrival_s:.2f} s in the queue, the predicted time "
                            f"to first token {figure(predicted_ttft_s, 2)} s exceeds the request's objective of "
                            f"{figure(ticket.ttft_slo_s, 2)} s", min(max(predicted_ttft_s - ticket.ttft_slo_s, 0.5), 60.0))

    def _overdue(self, now: float) -> list[Ticket]:
        """Queued tickets whose TTFT objective has passed: no placement can meet it now."""
        if not self._admission:
            return []
        return [t for t in self._waiting if t.ttft_slo_s is not None and now >= t.arrival_s + t.ttft_slo_s]

    def _refuse_overdue(self, ticket: Ticket, now: float) -> None:
        """Refused when its objective passes, not when its turn comes: seen in the long
        benchmark, a 514-token prompt refused after 14.8 s in the queue against a 12.4 s
        objective. The caller learns at the objective that it will not be met."""
        self.queue.remove(ticket)
        self._refuse_queued(ticket, f"its time-to-first-token objective of {figure(ticket.ttft_slo_s, 2)} s passed "
                            f"after {now - ticket.arrival_s:.2f} s in the gateway's {ticket.priority.label} "
                            "queue, before a worker could take it", 1.0)

    def _refuse_queued(self, ticket: Ticket, why: str, retry_after_s: float) -> None:
        metrics.REFUSALS.labels(ticket.priority.label, Reason.TTFT_QUEUED.value).inc()
        self._waiting.pop(ticket).set_exception(Refused(Refusal(
            Reason.TTFT_QUEUED, f"{why}; retry later, as a lower priority or with a looser slo.ttft_ms",
            retry_after_s)))

    def _place(self, ticket: Ticket, now: float, remote_open: bool) -> Placement | None:
        tier = self._workers.routable("prefill")
        decode = self._seating.loads_for(ticket, now)
        if not tier:  # no prefix to match, no tier load to read
            return place_without_tier(ticket.num_prompt_tokens, ticket.num_prompt_tokens + ticket.max_tokens, decode)
        matched = self._prefix_index().matched_tokens(self._prefix_keys(ticket))
        contended = self._forecaster.decode_busy()
        peer = None if contended else self._forecaster.local_rate(now)
        prefill = [w.prefill_load(now, matched.get(w.address, 0), contended, peer) for w in tier]
        budget = None if ticket.ttft_slo_s is None else ticket.arrival_s + ticket.ttft_slo_s - now
        return place(ticket.num_prompt_tokens, ticket.num_prompt_tokens + ticket.max_tokens,
                     prefill, decode, self._placement, remote_open, budget if self._admission else None,
                     self._forecaster.rescue_rate(now), tier_starved=self._tier_starved())

    def _tier_starved(self) -> bool:
        """Every prefill worker shares its host's cores with a decode worker running
        requests (CPU engines: `pdserve up` runs the prefill engine at idle priority)."""
        busy = {w.info.host_id for w in self._workers.routable("decode") if w.seats and w.info is not None}
        tier = self._workers.routable("prefill")
        return bool(tier) and all(w.info is not None and w.info.kv_device != "cuda" and w.info.host_id in busy
                                  for w in tier)

    def _reserve(self, ticket: Ticket, placement: Placement, now: float) -> Seat | None:
        worker = self._workers.by_address(placement.worker)
        if placement.where is Where.REMOTE:
            worker.queued_tokens += ticket.num_prompt_tokens
            worker.num_prefills += 1
            worker.prefill_meter.start(now, self._forecaster.decode_busy())
            self._prefix_index().record(self._prefix_keys(ticket), worker.address)
            return None
        seat = self._seat(ticket)
        seat.local_prefill_tokens = ticket.num_prompt_tokens
        seat.local_start_s = now
        seat.local_step_tokens = local_step_tokens(sum(s.local_prefill_tokens for s in worker.seats),
                                                   ticket.num_prompt_tokens, worker.info.long_prefill_tokens)
        self._join(worker, seat, now)
        worker.local_meter.start(now)
        return seat

    def _expire(self, ticket: Ticket, now: float) -> None:
        metrics.EXPIRED.labels(ticket.priority.label).inc()
        future = self._waiting.pop(ticket, None)
        if future is not None and not future.done():
            future.set_exception(rpc.DeadlineExceeded(
                f"the call's deadline passed after {now - ticket.arrival_s:.2f} s in the gateway's "
                f"{ticket.priority.label} queue, before any worker took it; allow a longer deadline "
                "or retry when the load is lower"))

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        due = [t.arrival_s + t.ttft_slo_s for t in self._waiting if t.ttft_slo_s is not None] if self._admission else []
        if due:  # forecast the waiting again soon (pump ran _refuse_predicted_late just now)
            due.append(self._clock() + RECHECK_S)
        deadline = min([d for d in (self.queue.next_deadline_s(), *due) if d is not None], default=None)
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(deadline - self._clock(), 0.0) + 0.001, self.pump)

    def _observe_queue(self) -> None:
        for p in Priority:
            metrics.QUEUE_LENGTH.labels(p.label).set(self.queue.num_queued(p))

    def _prefix_index(self) -> PrefixIndex:
        if self._prefixes is None:
            info = next((w.info for w in self._workers.workers if w.info is not None), None)
            self._prefixes = PrefixIndex(info.layout.block_size if info else 32)
        return self._prefixes

    def _prefix_keys(self, ticket: Ticket) -> list[int]:
        if ticket.prefix_keys is None:
            ticket.prefix_keys = self._prefix_index().keys(ticket.prompt_token_ids)
        return ticket.prefix_keys

    @staticmethod
    def _seat(ticket: Ticket) -> Seat:
        return Seat(ticket.request_id, ticket.num_prompt_tokens + ticket.max_tokens,
                    ticket.max_tokens, ticket.tpot_slo_s, priority=int(ticket.priority))

    # ------------------------------------------------------------ 3. run -----------------

    def prefill_done(self, worker: Worker, ticket: Ticket, num_cached_tokens: int | None) -> None:
        """A remote prefill answered (or failed: num_cached_tokens None)."""
        now = self._clock()
        worker.queued_tokens -= ticket.num_prompt_tokens
        worker.num_prefills -= 1
        if num_cached_tokens is None:
            worker.prefill_meter.cancel(now)
        else:
            worker.prefill_meter.finish(max(ticket.num_prompt_tokens - num_cached_tokens, 1), now,
                                        self._forecaster.decode_busy())
        self.pump()

    def stalled_after_s(self, ticket: Ticket, placement: Placement) -> float | None:
        """How long its remote prefill may go unanswered before `move_stalled` is tried
        (sooner for a short prompt whose objective a decode worker could still meet)."""
        now = self._clock()
        budget = local = None
        if self._admission and ticket.ttft_slo_s is not None:
            budget = ticket.arrival_s + ticket.ttft_slo_s - now
            local = soonest_local_ttft_s(ticket.num_prompt_tokens, ticket.num_prompt_tokens + ticket.max_tokens,
                                         self._workers.decode_loads(now))
        return stalled_after_s(ticket.num_prompt_tokens, placement.predicted_ttft_s, self._placement, budget, local)

    def move_stalled(self, worker: Worker, ticket: Ticket, waited_s: float, offered: bool = False) -> Grant | None:
        """A local place (with its seat) for a ticket whose prefill on ``worker`` has not
        answered after ``waited_s`` (or that was ``offered`` a rescue ahead of a newer
        prompt); None: no decode worker can take it now. On a grant the caller cancels the
        prefill call and reports nothing more for it."""
        now = self._clock()
        decode = self._seating.loads_for(ticket, now)
        budget = None if ticket.ttft_slo_s is None else ticket.arrival_s + ticket.ttft_slo_s - now
        # A prompt past its objective moves within slack only while no other prompt waits for
        # it: not when offered a rescue ahead of a newer one, nor with prompts queued here.
        placement = move_stalled(ticket.num_prompt_tokens, ticket.num_prompt_tokens + ticket.max_tokens, decode,
                                 self._placement, budget if self._admission else None, self._forecaster.rescue_rate(now),
                                 late_rescue=not offered and not self._waiting)
        if placement is None:
            if offered:
                self.pump()  # the prompt held back for this offer takes its place now
            return None
        worker.queued_tokens -= ticket.num_prompt_tokens
        worker.num_prefills -= 1
        if offered:  # taken back for its turn, not for being slow: no bound on the worker's rate
            worker.prefill_meter.cancel(now)
        else:
            worker.prefill_meter.abandon(ticket.num_prompt_tokens, waited_s, now)
        seat = self._reserve(ticket, placement, now)
        metrics.MOVED_PREFILLS.inc()
        metrics.PLACEMENTS.labels(placement.where.value).inc()
        self._count_rescue(ticket, placement)
        self.pump()  # the prefill tier has room again
        return Grant(placement, seat)

    async def decode_seat(self, ticket: Ticket) -> tuple[Worker, Seat]:
        """A decode worker with room for a prefilled request, and its seat there
        (seating.py: it waits while all are full, or while a higher class holds it back)."""
        seat = self._seat(ticket)
        worker = await self._seating.take(ticket)
        self._join(worker, seat, self._clock())
        return worker, seat

    def _join(self, worker: Worker, seat: Seat, now: float) -> None:
        seat.predicted_step_s = step = worker.join_step_s(seat.max_tokens, now)
        seat.forecast_tpot_s = None if step is None else step * worker.tpot_ratio.ratio(now)
        worker.join_meter.observe(seat.max_tokens, now)
        worker.seats.add(seat)
        for w in self._workers.routable("prefill"):
            w.prefill_meter.contend()  # prefills in progress now run beside decode

    def first_token(self, worker: Worker, seat: Seat, num_tokens: int, num_cached_tokens: int) -> None:
        """The seat's first token arrived: for a local prefill, its prompt is done."""
        now = self._clock()
        seat.first_token_s = now
        seat.num_generated = num_tokens
        if seat.local_prefill_tokens:
            worker.local_meter.finish(max(seat.local_prefill_tokens - num_cached_tokens, 1), now)
            worker.local_latency.observe(max(seat.local_step_tokens - num_cached_tokens, 1),
                                         now - seat.local_start_s, now)
            worker.last_local_prefill_s = now
            seat.local_prefill_tokens = 0
            self.pump()

    def tokens(self, worker: Worker, seat: Seat, num_tokens: int, gap_s: float) -> None:
        """Tokens streamed ``gap_s`` after the seat's previous ones. The gap measures the
        worker's decode step unless a local prefill ran in it: placement budgets those
        stalls separately (slack), and counting them here too would refuse requests on
        TPOT that the steps alone serve within their objective."""
        seat.num_generated += num_tokens
        now = self._clock()
        # local_meter is busy exactly while a seat has a local prefill before its first
        # token (_reserve starts it, first_token finishes it, release cancels it): O(1)
        # where a scan of the seats would cost microseconds per streamed message.
        stalled = worker.last_local_prefill_s >= now - gap_s or worker.local_meter.busy
        if num_tokens and not stalled:
            worker.step_meter.observe(len(worker.seats), gap_s / num_tokens, now)

    def release(self, worker: Worker, seat: Seat, finished: bool = False) -> None:
        """The seat's stream ended; ``finished``: with the engine's finish reason, so its
        TPOT is measured against the step estimate it joined on."""
        now = self._clock()
        if seat.local_prefill_tokens:  # ended before its first token
            worker.local_meter.cancel(now)
        elif finished and seat.first_token_s is not None and seat.predicted_step_s and seat.num_generated > 1:
            tpot_s = (now - seat.first_token_s) / (seat.num_generated - 1)
            worker.tpot_ratio.observe(tpot_s, seat.predicted_step_s, now, seat.tpot_slo_s)
            if seat.forecast_tpot_s:
                metrics.TPOT_FORECAST_RATIO.observe(tpot_s / seat.forecast_tpot_s)
        worker.seats.discard(seat)
        if not worker.seats:
            worker.tpot_ratio.drained(now)
        self.pump()
