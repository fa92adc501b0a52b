"""The gateway's request queue: priority classes, deadlines, weights and aging (pure).

No grpc, asyncio or torch here: the queue is a data structure over `Ticket`s and the
caller's clock, so its orders are unit-tested exactly.

Order (policy ``slo``):
  1. Aging first: a class whose oldest ticket has waited ``aging_s`` or more is served
     before anything else (the longest-waiting such ticket first), so offline work is never
     starved however busy the other classes are.
  2. Otherwise classes share the service by weight, counted in prompt tokens (stride
     scheduling): each class has a pass value that grows by tokens / weight whenever one of
     its tickets is served, and the non-empty class with the lowest pass goes next. A class
     that was empty rejoins at the current virtual time, so idling banks no credit.
  3. Within a class: earliest due time first (EDF), then arrival order. A ticket is due at
     the earlier of its first-token objective (arrival + TTFT SLO) and its hard deadline.
     A deadline is only as precise as gRPC sends it (`deadline_precision_s`): of the
     tickets that may be due first within that precision, the earliest arrival goes first,
     so calls with the same timeout are served in arrival order.

Policy ``fifo`` ignores classes and objectives: arrival order, one queue.
Queues are bounded per class; a ticket whose hard deadline has passed is expired, never
served.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum

POLICIES = ("slo", "fifo")


class Priority(IntEnum):
    """Service classes, most urgent first (the proto's PRIORITY_* minus one)."""

    INTERACTIVE = 0
    BATCH = 1
    OFFLINE = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True, eq=False)
class Ticket:
    """One request waiting for (or holding) a place on a worker."""

    request_id: str
    priority: Priority
    num_prompt_tokens: int
    max_tokens: int
    arrival_s: float
    # Hard limit (the call's gRPC deadline), absolute on the caller's clock; None: none.
    deadline_s: float | None = None
    # How much earlier than deadline_s the caller's own deadline may be (gRPC rounds the
    # timeout it sends up to its encoding's unit; `deadline_precision_s`).
    deadline_precision_s: float = 0.0
    # Objectives; None: not constrained.
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    prompt_token_ids: tuple[int, ...] = ()
    # Prefix-cache keys of the prompt's leading blocks (placement's, computed once).
    prefix_keys: list[int] | None = None
    seq: int = 0  # arrival order, set by the queue
    # Held back once from a rescue on a decode worker while an older prompt was offered it
    # (gateway.dispatch: `_offer_rescue_to_older`).
    rescue_offered: bool = False

    @property
    def due_s(self) -> float:
        """When the first token is due: the earlier of the TTFT objective and the deadline."""
        due = math.inf
        if self.ttft_slo_s is not None:
            due = self.arrival_s + self.ttft_slo_s
        if self.deadline_s is not None:
            due = min(due, self.deadline_s)
        return due

    @property
    def earliest_due_s(self) -> float:
        """The earliest the caller may mean its first token to be due."""
        due = self.due_s
        if self.deadline_s is not None and due == self.deadline_s:
            due -= self.deadline_precision_s
        return due

    def expired(self, now_s: float) -> bool:
        return self.deadline_s is not None and now_s >= self.deadline_s


def deadline_precision_s(remaining_s: float) -> float:
    """How precisely a server knows a call's deadline, from the time remaining at arrival.

    gRPC sends a timeout rounded up to its encoding's unit: 1 ms under 1 s, 10 ms under
    10 s, 100 ms under 100 s, then whole seconds. Measured with grpc 1.85: a 300.0 s
    timeout arrives as 301 s and a 299.25 s one as 300 s, so of two calls with a 300 s
    timeout the later may seem due first (scripts/grpc_timeout_rounding.py prints the
    table). One unit, and a millisecond for reading it.
    """
    unit = 0.001 if remaining_s < 1 else 0.01 if remaining_s < 10 else 0.1 if remaining_s < 100 else 1.0
    return unit + 0.001


MAX_DEADLINE_PRECISION_S = deadline_precision_s(math.inf)


def first_due(tickets: list[Ticket]) -> Ticket:
    """The ticket to serve first of a class's queue, kept sorted by (due, arrival): the
    earliest arrival among those that may be due no later than the surely earliest due."""
    first_due_s = tickets[0].due_s
    best = tickets[0]
    for t in tickets[1:]:
        if t.due_s - MAX_DEADLINE_PRECISION_S > first_due_s:
            break  # sorted by due: nothing further may qualify
        if t.earliest_due_s <= first_due_s and t.seq < best.seq:
            best = t
    return best


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    weight: float
    max_queued: int

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"class weight must be > 0, got {self.weight}")
        if self.max_queued < 1:
            raise ValueError(f"class queue bound must be >= 1, got {self.max_queued}")


def default_classes() -> dict[Priority, ClassPolicy]:
    return {
        Priority.INTERACTIVE: ClassPolicy(weight=8.0, max_queued=256),
        Priority.BATCH: ClassPolicy(weight=2.0, max_queued=512),
        Priority.OFFLINE: ClassPolicy(weight=1.0, max_queued=1024),
    }


class QueueFull(Exception):
    def __init__(self, priority: Priority, bound: int) -> None:
        super().__init__(f"the {priority.label} queue holds its limit of {bound} requests")
        self.priority = priority
        self.bound = bound


@dataclass(slots=True)
class _ClassQueue:
    policy: ClassPolicy
    tickets: list[Ticket] = field(default_factory=list)  # kept sorted by (due, seq)
    pass_value: float = 0.0


class RequestQueue:
    def __init__(self, policy: str = "slo", classes: dict[Priority, ClassPolicy] | None = None,
                 aging_s: float = 30.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if aging_s <= 0:
            raise ValueError(f"aging must be > 0 s, got {aging_s}")
        self.policy = policy
        self.aging_s = aging_s
        self._classes = {p: _ClassQueue(c) for p, c in (classes or default_classes()).items()}
        assert set(self._classes) == set(Priority), "every priority needs a class policy"
        self._seq = itertools.count()
        self._virtual_time = 0.0

    # ------------------------------------------------------------ contents --------------

    def __len__(self) -> int:
        return sum(len(q.tickets) for q in self._classes.values())

    def num_queued(self, priority: Priority) -> int:
        return len(self._classes[priority].tickets)

    def queued_tokens(self) -> int:
        return sum(t.num_prompt_tokens for q in self._classes.values() for t in q.tickets)

    def push(self, ticket: Ticket) -> None:
        """Adds a ticket; raises QueueFull when its class is at its bound."""
        q = self._classes[ticket.priority]
        if len(q.tickets) >= q.policy.max_queued:
            raise QueueFull(ticket.priority, q.policy.max_queued)
        if not q.tickets:  # rejoining: no credit for the time it was empty
            q.pass_value = max(q.pass_value, self._virtual_time)
        ticket.seq = next(self._seq)
        q.tickets.append(ticket)
        q.tickets.sort(key=self._key)

    def remove(self, ticket: Ticket) -> bool:
        """Drops a ticket that leaves without being served (cancelled); False if absent."""
        q = self._classes[ticket.priority]
        if ticket in q.tickets:
            q.tickets.remove(ticket)
            return True
        return False

    def expire(self, now_s: float) -> list[Ticket]:
        """Removes and returns the tickets whose hard deadline has passed."""
        gone = []
        for q in self._classes.values():
            keep = []
            for t in q.tickets:
                (gone if t.expired(now_s) else keep).append(t)
            q.tickets = keep
        return sorted(gone, key=lambda t: t.seq)

    def next_deadline_s(self) -> float | None:
        deadlines = [t.deadline_s for q in self._classes.values() for t in q.tickets
                     if t.deadline_s is not None]
        return min(deadlines, default=None)

    # ------------------------------------------------------------ order -----------------

    def ordered(self, now_s: float) -> Iterator[Ticket]:
        """Queued tickets in the order they would be served from now on, if each were
        taken in turn. Lazy: the caller stops as soon as it has what it needs."""
        if self.policy == "fifo":
            yield from sorted((t for q in self._classes.values() for t in q.tickets),
                              key=lambda t: t.seq)
            return
        heads = {p: list(q.tickets) for p, q in self._classes.items()}
        passes = {p: q.pass_value for p, q in self._classes.items()}
        while any(heads.values()):
            priority, ticket = self._choose(heads, passes, now_s)
            heads[priority].remove(ticket)
            passes[priority] += ticket.num_prompt_tokens / self._classes[priority].policy.weight
            yield ticket

    def take(self, ticket: Ticket) -> None:
        """Serves a ticket (one that `ordered` yielded): removes it and charges its class."""
        q = self._classes[ticket.priority]
        q.tickets.remove(ticket)
        self._virtual_time = max(self._virtual_time, q.pass_value)
        q.pass_value += ticket.num_prompt_tokens / q.policy.weight

    def tokens_ahead(self, ticket: Ticket, now_s: float) -> int:
        """Prompt tokens served before ``ticket`` if it were queued now (it need not be)."""
        probe = self._probe(ticket)
        ahead = 0
        for t in self.ordered(now_s):
            if t is ticket:
                break
            ahead += t.num_prompt_tokens
        probe()
        return ahead

    def _probe(self, ticket: Ticket) -> Callable[[], None]:
        """Temporarily queues ``ticket`` (bounds ignored); returns the undo."""
        q = self._classes[ticket.priority]
        if ticket in q.tickets:
            return lambda: None
        saved_pass, saved_seq = q.pass_value, ticket.seq
        if not q.tickets:
            q.pass_value = max(q.pass_value, self._virtual_time)
        ticket.seq = math.inf  # type: ignore[assignment]  # after everyone queued now
        q.tickets.append(ticket)
        q.tickets.sort(key=self._key)

        def undo() -> None:
            q.tickets.remove(ticket)
            q.pass_value, ticket.seq = saved_pass, saved_seq

        return undo

    def _choose(self, heads: dict[Priority, list[Ticket]], passes: dict[Priority, float],
                now_s: float) -> tuple[Priority, Ticket]:
        aged = [(t.seq, p, t) for p, ts in heads.items() for t in ts
                if now_s - t.arrival_s >= self.aging_s]
        if aged:
            _, p, t = min(aged, key=lambda x: x[0])
            return p, t
        p = min((p for p, ts in heads.items() if ts), key=lambda p: (passes[p], p))
        return p, first_due(heads[p])

    @staticmethod
    def _key(t: Ticket) -> tuple[float, float]:
        return (t.due_s, t.seq)
