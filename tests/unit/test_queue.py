"""gateway.queue: exact service orders (EDF, weights, aging, FIFO), bounds and expiry."""

from __future__ import annotations

import pytest

from gateway.queue import ClassPolicy, Priority, QueueFull, RequestQueue, Ticket, deadline_precision_s

I, B, O = Priority.INTERACTIVE, Priority.BATCH, Priority.OFFLINE


def ticket(name: str, priority: Priority = I, tokens: int = 100, arrival: float = 0.0,
           ttft: float | None = None, deadline: float | None = None) -> Ticket:
    return Ticket(name, priority, tokens, 16, arrival, deadline_s=deadline, ttft_slo_s=ttft)


def queue(policy: str = "slo", weights=(8.0, 2.0, 1.0), limits=(10, 10, 10), aging_s: float = 30.0) -> RequestQueue:
    classes = {p: ClassPolicy(weights[p], limits[p]) for p in Priority}
    return RequestQueue(policy, classes, aging_s)


def drain(q: RequestQueue, now: float = 0.0) -> list[str]:
    """Serves everything in turn, as the dispatcher does when every worker has room."""
    served = []
    while len(q):
        t = next(q.ordered(now))
        q.take(t)
        served.append(t.request_id)
    return served


def test_earliest_deadline_first_within_a_class():
    q = queue()
    q.push(ticket("late", ttft=9.0))
    q.push(ticket("none"))  # no objective: due never, so after every due ticket
    q.push(ticket("soon", ttft=1.0))
    q.push(ticket("hard", ttft=9.0, deadline=2.0))  # the hard deadline makes it due at 2
    q.push(ticket("late2", ttft=9.0))  # same due time as "late": arrival order
    assert drain(q) == ["soon", "hard", "late", "late2", "none"]


@pytest.mark.parametrize("remaining, precision", [(300.9, 1.001), (50.1, 0.101), (5.01, 0.011), (0.5, 0.002)])
def test_deadline_precision_is_the_unit_grpc_sends_the_timeout_in(remaining, precision):
    assert deadline_precision_s(remaining) == pytest.approx(precision)


def deadlined(name: str, arrival: float, remaining: float, ttft: float | None = None) -> Ticket:
    """As the gateway makes it: the deadline from the time remaining the server saw."""
    return Ticket(name, O, 100, 16, arrival, deadline_s=arrival + remaining, ttft_slo_s=ttft,
                  deadline_precision_s=deadline_precision_s(remaining))


def test_same_timeout_calls_are_served_in_arrival_order_despite_deadline_rounding():
    # Two 300 s calls 0.2 s apart: gRPC sent the first's timeout as 301 s, the second's as
    # 300 s (seen in CI), so the second's deadline seems 0.8 s sooner. Arrival order wins.
    q = queue()
    q.push(deadlined("first", 10.0, 300.999))
    q.push(deadlined("second", 10.2, 299.999))
    assert drain(q) == ["first", "second"]


def test_a_deadline_sooner_by_more_than_its_precision_still_goes_first():
    q = queue()
    q.push(deadlined("long", 10.0, 300.999))
    q.push(deadlined("shorter", 10.2, 298.5))  # 2.3 s sooner, beyond the 1 s precision
    q.push(deadlined("tight", 10.3, 5.0))
    q.push(deadlined("objective", 10.4, 300.999, ttft=2.0))  # its TTFT objective is exact
    assert drain(q) == ["objective", "tight", "shorter", "long"]


def test_classes_share_prefill_work_by_weight_in_tokens():
    # Interactive weight 8, offline 1: equal-sized prompts, 8 interactive per offline one.
    q = queue(weights=(8.0, 2.0, 1.0), limits=(20, 20, 20))
    for i in range(3):
        q.push(ticket(f"o{i}", O, tokens=100))
    for i in range(12):
        q.push(ticket(f"i{i}", I, tokens=100))
    # Both classes start at pass 0; ties go to the more urgent class. Interactive pays 12.5
    # per ticket, offline 100: offline's second ticket comes once interactive's pass passes 100.
    assert drain(q) == (["i0", "o0"] + [f"i{k}" for k in range(1, 9)] + ["o1"]
                        + [f"i{k}" for k in range(9, 12)] + ["o2"])


def test_weights_count_tokens_not_requests():
    # One 800-token interactive prompt costs its class as much as eight 100-token ones.
    q = queue(weights=(8.0, 2.0, 1.0))
    q.push(ticket("big", I, tokens=800))
    q.push(ticket("i1", I, tokens=100))
    q.push(ticket("b1", B, tokens=100))
    q.push(ticket("b2", B, tokens=100))
    # big: I pass 0 -> 100. b1: B 0 -> 50. b2: B 50 -> 100. i1 (100, I wins the tie).
    assert drain(q) == ["big", "b1", "b2", "i1"]


def test_an_idle_class_banks_no_credit():
    q = queue()
    for i in range(4):
        q.push(ticket(f"i{i}", I, tokens=800))  # each costs interactive 100
    for expected in ("i0", "i1"):  # interactive pass 200, virtual time 100
        t = next(q.ordered(0.0))
        assert t.request_id == expected
        q.take(t)
    q.push(ticket("o", O, tokens=100))  # rejoins at virtual time 100, not 0
    q.push(ticket("i9", I, tokens=800))
    assert drain(q) == ["o", "i2", "i3", "i9"]


def test_aging_serves_a_starved_ticket_first():
    q = queue(aging_s=30.0)
    q.push(ticket("old-offline", O, tokens=10_000, arrival=0.0))
    for i in range(3):
        q.push(ticket(f"i{i}", I, tokens=10, arrival=25.0))
    assert [t.request_id for t in q.ordered(29.0)][0] == "i0"
    assert [t.request_id for t in q.ordered(30.0)][0] == "old-offline"


def test_fifo_ignores_classes_and_objectives():
    q = queue("fifo")
    q.push(ticket("o", O))
    q.push(ticket("i-late", I, ttft=9.0))
    q.push(ticket("i-soon", I, ttft=1.0))
    assert drain(q) == ["o", "i-late", "i-soon"]


def test_each_class_is_bounded():
    q = queue(limits=(2, 1, 1))
    q.push(ticket("a", I))
    q.push(ticket("b", I))
    with pytest.raises(QueueFull, match="interactive queue holds its limit of 2"):
        q.push(ticket("c", I))
    q.push(ticket("o", O))  # other classes unaffected
    assert len(q) == 3


def test_expiry_removes_tickets_past_their_hard_deadline():
    q = queue()
    q.push(ticket("a", deadline=5.0))
    q.push(ticket("b", deadline=2.0))
    q.push(ticket("c"))
    assert q.next_deadline_s() == 2.0
    assert [t.request_id for t in q.expire(1.9)] == []
    assert [t.request_id for t in q.expire(5.0)] == ["a", "b"]
    assert drain(q) == ["c"]
    assert q.next_deadline_s() is None


def test_tokens_ahead_counts_what_would_be_served_first():
    q = queue()
    q.push(ticket("i", I, tokens=300, ttft=1.0))
    q.push(ticket("o", O, tokens=500))
    probe_i = ticket("new-i", I, tokens=50, ttft=5.0)
    # new-i: after "i" (earlier due), then interactive's pass is 37.5 + ... vs offline 0:
    # order i (I 0->37.5), o (O 0->500), new-i -- offline's tie at 0 loses to interactive
    # only on equal pass, and interactive is at 37.5 after "i".
    assert q.tokens_ahead(probe_i, 0.0) == 800
    assert len(q) == 2  # the probe left nothing behind
    assert q.tokens_ahead(ticket("new-o", O, tokens=10), 0.0) == 800


def test_remove_drops_a_cancelled_ticket():
    q = queue()
    a, b = ticket("a"), ticket("b")
    q.push(a)
    q.push(b)
    assert q.remove(a) is True
    assert q.remove(a) is False
    assert drain(q) == ["b"]
