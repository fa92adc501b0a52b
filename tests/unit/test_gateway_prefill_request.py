"""What the gateway tells a prefill worker of a request's TTFT (PrefillRequest.ttft_left_ms)."""

from gateway.queue import Priority, Ticket
from gateway.server import _ttft_left_ms


def ticket(**kw) -> Ticket:
    return Ticket("r1", Priority.INTERACTIVE, num_prompt_tokens=100, max_tokens=8, arrival_s=10.0, **kw)


def test_ttft_left_is_the_objective_or_deadline_less_the_time_already_spent():
    assert _ttft_left_ms(ticket(ttft_slo_s=4.0), now_s=11.5) == 2500
    assert _ttft_left_ms(ticket(ttft_slo_s=4.0, deadline_s=12.0), now_s=11.5) == 500  # the deadline is sooner
    assert _ttft_left_ms(ticket(deadline_s=30.0), now_s=11.5) == 18500
    assert _ttft_left_ms(ticket(ttft_slo_s=4.0), now_s=20.0) == 1  # overdue: urgent, not "no objective"
    assert _ttft_left_ms(ticket(), now_s=11.5) == 0  # nothing bounds it
