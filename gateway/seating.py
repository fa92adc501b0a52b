"""Seating: the decode workers a request may join, and the line of prefilled requests
waiting for a seat (the asyncio side of `placement.pick_decode` and `placement.join_slack_s`).

A prefilled request takes a seat on the decode worker with room that runs the fewest
requests; while every one is full it waits in line, in arrival order. Under the slo policy
a request of a lower class is also held back from a decode worker where running requests
of a higher class that meet their TPOT objectives would miss them with it in the batch
(and its prefill there may stall them only by what they keep with it beside them), for at
most `PlacementConfig.priority_hold_s`; then it takes any seat. The same view of the
decode workers serves the dispatcher's local placements (`loads_for`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway import metrics
from gateway.placement import DecodeLoad, PlacementConfig, pick_decode
from gateway.queue import Ticket
from gateway.workers import Worker, WorkerPool


@dataclass(slots=True)
class SeatWaiter:
    """A prefilled request waiting for a decode seat."""

    ticket: Ticket
    since_s: float  # when it began to wait (-inf: its hold is over)
    future: asyncio.Future[Worker]


class Seating:
    def __init__(self, workers: WorkerPool, placement: PlacementConfig, by_class: bool,
                 clock: Callable[[], float]) -> None:
        self._workers = workers
        self._hold_s = placement.priority_hold_s if by_class else 0.0
        self._clock = clock
        self._line: list[SeatWaiter] = []  # in arrival order

    def holds(self, ticket: Ticket, since_s: float, now: float) -> bool:
        """Whether a higher class's objectives may still hold ``ticket`` back (a class below
        the first, waiting since ``since_s`` for less than the hold)."""
        return ticket.priority > 0 and now - since_s < self._hold_s

    def loads_for(self, ticket: Ticket, now: float, since_s: float | None = None) -> list[DecodeLoad]:
        """The decode workers as ``ticket`` may use them, the higher classes' objectives
        kept while they hold it back (waiting since ``since_s``, default its arrival;
        `WorkerPool.decode_loads`)."""
        hold = self.holds(ticket, ticket.arrival_s if since_s is None else since_s, now)
        return self._workers.decode_loads(now, (int(ticket.priority), ticket.max_tokens) if hold else None)

    async def take(self, ticket: Ticket) -> Worker:
        """The decode worker a prefilled request joins; waits in line while none has room
        for it (or, held back, none keeps a higher class's objectives with it)."""
        now = self._clock()
        chosen = pick_decode(ticket.num_prompt_tokens + ticket.max_tokens, self.loads_for(ticket, now, now))
        if chosen is not None:
            return self._workers.by_address(chosen)
        waiter = SeatWaiter(ticket, now, asyncio.get_running_loop().create_future())
        self._line.append(waiter)
        if not self.holds(ticket, now, now):
            return await waiter.future
        try:
            worker = await asyncio.wait_for(asyncio.shield(waiter.future), self._hold_s)
        except TimeoutError:
            waiter.since_s = -math.inf  # held long enough: any seat now
            self.serve(self._clock())
            worker = await waiter.future
        except asyncio.CancelledError:
            waiter.future.cancel()
            raise
        metrics.SEAT_HOLDS.labels(ticket.priority.label).observe(self._clock() - now)
        return worker

    def serve(self, now: float) -> None:
        """Seats for the line in arrival order: one that finds every worker full keeps the
        first place; one held back for a higher class lets those behind it go."""
        if not self._line:
            return
        # Seats are taken when the waiters run, after this loop: one view serves all of them.
        everyone = self._workers.decode_loads(now)
        for waiter in list(self._line):
            if waiter.future.done():
                self._line.remove(waiter)
                continue
            kv_tokens = waiter.ticket.num_prompt_tokens + waiter.ticket.max_tokens
            if pick_decode(kv_tokens, everyone) is None:
                return
            held = self.holds(waiter.ticket, waiter.since_s, now)
            chosen = pick_decode(kv_tokens, self.loads_for(waiter.ticket, now, waiter.since_s) if held else everyone)
            if chosen is None:
                continue
            self._line.remove(waiter)
            waiter.future.set_result(self._workers.by_address(chosen))
