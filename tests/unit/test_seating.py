"""gateway.seating: the decode workers a request may join, and the line for seats; a lower
class held back while it would make a higher one late, on fake workers
(tests.unit.dispatching) and a fake clock."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from gateway.queue import Ticket
from tests.unit.dispatching import I, O, dispatcher, run


def _interactive_decoding(d, pool, clock):
    """d0 runs one interactive request with 0.46 s to spare at 30 ms a step (batch 1), which
    an offline request of 64 tokens beside it at 45 ms (batch 2) would make late."""
    from gateway.meters import StepMeter
    from gateway.workers import Seat

    d0 = pool.by_address("d0")
    d0.step_meter = StepMeter(min_samples=1)
    d0.step_meter.observe(1, 0.030, clock.now)
    d0.step_meter.observe(2, 0.045, clock.now)
    running = Seat("i", kv_tokens=100, max_tokens=51, tpot_slo_s=0.040, num_generated=3,
                   first_token_s=clock.now - 0.1, priority=int(I))
    d0.seats.add(running)
    return d0, running


def test_an_offline_request_waits_for_its_seat_while_it_would_make_an_interactive_one_late():
    async def scenario():
        d, pool, clock = dispatcher()
        d0, running = _interactive_decoding(d, pool, clock)
        waiting = asyncio.create_task(d.decode_seat(Ticket("o", O, 40, 64, clock.now, tpot_slo_s=0.1)))
        await asyncio.sleep(0.01)
        held = not waiting.done()
        other, _ = await d.decode_seat(Ticket("i2", I, 40, 64, clock.now))  # a higher class is not held
        clock.now += 0.5
        d.release(d0, running)
        worker, seat = await waiting
        return held, other.address, worker.address, seat.priority, len(d0.seats)

    before = _holds_seen()
    assert run(scenario()) == (True, "d0", "d0", int(O), 2)
    count, total_s = (a - b for a, b in zip(_holds_seen(), before))
    assert count == 1 and total_s == pytest.approx(0.5)


def _holds_seen() -> tuple[float, float]:
    """pdserve_seat_hold_seconds for the offline class: count and sum."""
    return tuple(REGISTRY.get_sample_value(f"pdserve_seat_hold_seconds_{what}", {"priority": "offline"}) or 0.0
                 for what in ("count", "sum"))


def test_an_offline_request_is_held_no_longer_than_the_hold_nor_under_fifo():
    async def scenario(policy, hold_s):
        d, pool, clock = dispatcher(policy, priority_hold_s=hold_s)
        _interactive_decoding(d, pool, clock)
        offline = Ticket("o", O, 40, 64, clock.now, tpot_slo_s=0.1)
        held = d._seating.loads_for(offline, clock.now) == []
        t = time.monotonic()
        worker, _ = await asyncio.wait_for(d.decode_seat(offline), 5.0)
        return held, worker.address, time.monotonic() - t

    held, worker, waited_s = run(scenario("slo", 0.2))
    assert (held, worker) == (True, "d0") and 0.2 <= waited_s < 2.0
    held, worker, waited_s = run(scenario("fifo", 5.0))
    assert (held, worker) == (False, "d0") and waited_s < 0.1
    held, worker, waited_s = run(scenario("slo", 0.0))
    assert (held, worker) == (False, "d0") and waited_s < 0.1


def test_an_offline_prompt_s_local_prefill_keeps_within_a_higher_class_s_slack():
    """A decode worker where an offline request may join gives its prefill no more stall
    than the interactive requests there keep with it beside them."""
    d, pool, clock = dispatcher()
    d0, running = _interactive_decoding(d, pool, clock)
    short = Ticket("o", O, 40, 4, clock.now)  # 3 steps beside at 45 ms: 0.415 s kept
    [load] = d._seating.loads_for(short, clock.now)
    assert load.slack_s == pytest.approx(2.0 - 0.1 - 45 * 0.030 - 3 * 0.045)
    [load] = d._seating.loads_for(Ticket("i2", I, 40, 4, clock.now), clock.now)
    assert load.slack_s == pytest.approx(2.0 - 0.1 - 48 * 0.030)
