"""gateway.dispatch: the queue, admission and placement wired together, on fake workers
(tests.unit.dispatching) and a fake clock: the prefill tier, deadlines, TTFT admission,
stalled prefills."""

from __future__ import annotations

import asyncio

import pytest

from gateway.dispatch import Refused
from gateway.placement import Where
from pdserve import rpc
from tests.unit.dispatching import I, O, dispatcher, measured_prefill, run, ticket


def test_prefill_tier_runs_the_queue_in_policy_order():
    async def scenario():
        d, pool, clock = dispatcher()
        p0 = pool.by_address("p0")
        grants = {}

        async def go(t):
            grants[t.request_id] = await d.acquire(t)

        first = asyncio.create_task(go(ticket("o0", 2000, O)))
        await asyncio.sleep(0)
        assert grants["o0"].placement.where is Where.REMOTE and p0.queued_tokens == 2000
        tasks = [asyncio.create_task(go(ticket(n, 2000, O))) for n in ("o1", "o2")]
        tasks.append(asyncio.create_task(go(ticket("i", 600, I))))
        await asyncio.sleep(0)
        assert set(grants) == {"o0"}  # all wait: the worker holds more than its budget
        order = []
        for _ in range(3):
            running = next(n for n in ("o0", "i", "o1", "o2") if n in grants and n not in order)
            order.append(running)
            clock.now += 5
            d.prefill_done(p0, ticket(running, p0.queued_tokens), num_cached_tokens=0)
            await asyncio.sleep(0)
        await asyncio.gather(first, *tasks)
        order.append(next(n for n in ("o1", "o2") if n not in order))
        return order

    assert run(scenario()) == ["o0", "i", "o1", "o2"]

def test_a_ticket_waiting_for_the_tier_does_not_block_a_local_one_behind_it():
    async def scenario():
        d, pool, _ = dispatcher()
        d0 = pool.by_address("d0")
        d0.seats.add(d._seat(ticket("running", 10)))  # decode busy: local needs a measured rate
        d0.local_meter.start(99.0)
        d0.local_meter.finish(100, 100.0)  # 100 tok/s
        await_first = asyncio.create_task(d.acquire(ticket("long0", 3000)))
        await asyncio.sleep(0)
        waiting_long = asyncio.create_task(d.acquire(ticket("long1", 3000)))
        short = asyncio.create_task(d.acquire(ticket("short", 50)))
        await asyncio.sleep(0)
        grant = await short
        assert not waiting_long.done()
        waiting_long.cancel()
        await asyncio.gather(waiting_long, return_exceptions=True)  # a cancelled call leaves the queue
        return (await await_first).placement.where, grant.placement.where, len(d.queue)

    assert run(scenario()) == (Where.REMOTE, Where.LOCAL, 0)

def test_with_the_prefill_tier_down_every_prompt_is_prefilled_on_a_decode_worker_until_it_returns():
    async def scenario():
        d, pool, _ = dispatcher()
        p0 = pool.by_address("p0")
        pool.mark_down(p0, "3 health checks unanswered")
        served = [pool.ready()]
        grant = await d.acquire(ticket("long", 3000))
        served.append((grant.placement.where, grant.placement.worker))
        p0.healthy = True  # back (a heartbeat)
        grant = await d.acquire(ticket("long-again", 3000))
        served.append((grant.placement.where, grant.placement.worker))
        return served

    assert run(scenario()) == [True, (Where.LOCAL, "d0"), (Where.REMOTE, "p0")]


def test_a_deadline_passing_in_the_queue_ends_the_request_before_any_worker():
    async def scenario():
        d, pool, clock = dispatcher()
        busy = asyncio.create_task(d.acquire(ticket("busy", 3000)))
        await asyncio.sleep(0)
        late = asyncio.create_task(d.acquire(ticket("late", 3000, deadline=100.5)))
        await asyncio.sleep(0)
        clock.now = 100.6
        d.pump()
        with pytest.raises(rpc.DeadlineExceeded, match="deadline passed after 0.60 s"):
            await late
        await busy
        return pool.by_address("p0").queued_tokens, len(d.queue)

    assert run(scenario()) == (3000, 0)  # only "busy" reached the worker

def test_admission_refuses_a_predicted_ttft_miss_with_a_retry_hint():
    async def scenario():
        d, pool, _ = dispatcher(ttft=2.0, local_prefill_max_tokens=0, rescue_prefill_max_tokens=0)
        measured_prefill(pool, 1000)  # 100 tok/s
        d.admit(ticket("fits", 150, ttft=2.0))  # 1.5 s
        await d.acquire(ticket("fits", 150, ttft=2.0))  # now 150 tokens in flight
        with pytest.raises(Refused) as e:
            d.admit(ticket("late", 100, ttft=2.0))  # (150 + 100) / 100 = 2.5 s
        return e.value.retry_after_s, str(e.value)

    retry, message = run(scenario())
    assert retry == pytest.approx(0.5)
    assert "predicted time to first token 2.50 s" in message

def test_an_estimate_with_no_recent_completion_refuses_nothing():
    # The refused requests never reach the tier, so a slow old estimate would refuse forever.
    async def scenario():
        d, pool, clock = dispatcher(ttft=2.0, local_prefill_max_tokens=0, rescue_prefill_max_tokens=0)
        p0 = measured_prefill(pool, 10)  # 1 tok/s
        with pytest.raises(Refused):
            d.admit(ticket("slow", 100, ttft=2.0))
        clock.now = 100.0 + p0.prefill_meter.max_age_s + 1
        d.admit(ticket("probe", 100, arrival=clock.now, ttft=2.0))  # no refusal: admitted to measure

    run(scenario())

def test_a_prefill_rate_measured_under_decode_load_does_not_refuse_a_prompt_sent_with_decode_idle():
    async def scenario():
        d, pool, clock = dispatcher(ttft=2.0, local_prefill_max_tokens=0, rescue_prefill_max_tokens=0)
        d0, p0 = pool.by_address("d0"), pool.by_address("p0")
        d0.seats.add(d._seat(ticket("running", 10)))
        p0.prefill_meter.start(90.0, contended=True)
        p0.prefill_meter.finish(1000, 100.0, contended=True)  # 100 tok/s beside decode
        with pytest.raises(Refused, match="predicted time to first token 3.00 s"):
            d.admit(ticket("busy", 300, ttft=2.0))  # decode still runs: 3 s
        d0.seats.clear()
        d.admit(ticket("idle", 300, ttft=2.0))  # decode idle: that rate does not apply
        grant = await d.acquire(ticket("idle", 300, ttft=2.0))
        clock.now = 100.5
        d.prefill_done(p0, ticket("idle", 300), num_cached_tokens=0)  # 600 tok/s alone
        assert p0.prefill_meter.tokens_per_s(clock.now, contended=False) == pytest.approx(600.0)
        with pytest.raises(Refused, match="predicted time to first token 2.50 s"):
            d.admit(ticket("too long", 1500, arrival=clock.now, ttft=2.0))  # 1500 / 600
        return grant.placement.where

    assert run(scenario()) == Where.REMOTE

def test_a_long_prompt_the_starved_tier_would_miss_is_admitted_and_prefilled_by_a_decode_worker():
    async def scenario(rescue_max):
        d, pool, _ = dispatcher(ttft=3.0, rescue_prefill_max_tokens=rescue_max)
        d0, p0 = pool.by_address("d0"), pool.by_address("p0")
        running = d._seat(ticket("running", 10))
        running.first_token_s = 99.0
        d0.seats.add(running)  # no TPOT objective: it absorbs any stall
        d0.local_meter.start(99.0)
        d0.local_meter.finish(1000, 100.0)  # 1,000 tok/s on the decode worker
        p0.prefill_meter.start(90.0, contended=True)
        p0.prefill_meter.finish(1000, 100.0, contended=True)  # 100 tok/s beside decode
        try:
            d.admit(ticket("long", 800, ttft=3.0))  # 8 s on the tier, 0.8 s on d0
        except Refused as e:
            return str(e)
        grant = await d.acquire(ticket("long", 800, ttft=3.0))
        return grant.placement.where, grant.placement.predicted_ttft_s, p0.queued_tokens

    assert run(scenario(4096)) == (Where.LOCAL, pytest.approx(0.8), 0)
    assert "predicted time to first token 8.00 s" in run(scenario(0))


def test_with_no_local_prefill_timed_a_long_prompt_is_rescued_at_the_tiers_rate_alone():
    async def scenario():
        d, pool, _ = dispatcher(ttft=3.0)
        d0, p0 = pool.by_address("d0"), pool.by_address("p0")
        running = d._seat(ticket("running", 1000))
        running.first_token_s = 99.0
        d0.seats.add(running)
        p0.prefill_meter.start(80.0, contended=False)
        p0.prefill_meter.finish(2000, 82.0, contended=False)  # 1,000 tok/s with decode idle
        p0.prefill_meter.start(90.0, contended=True)
        p0.prefill_meter.finish(1000, 100.0, contended=True)  # 100 tok/s beside decode
        d.admit(ticket("long", 800, ttft=3.0))  # 8 s on the tier; 0.8 s on d0 at 1,000 tok/s
        grant = await d.acquire(ticket("long", 800, ttft=3.0))
        return grant.placement.where, grant.placement.predicted_ttft_s

    assert run(scenario()) == (Where.LOCAL, pytest.approx(0.8))


def test_a_prefill_that_a_decode_request_ran_beside_is_measured_as_contended():
    async def scenario():
        d, pool, clock = dispatcher(ttft=5.0)
        p0 = pool.by_address("p0")
        await d.acquire(ticket("long", 1000))  # decode idle: remote, alone
        short = await d.acquire(ticket("short", 50))  # the idle decode worker takes it
        assert short.placement.where is Where.LOCAL
        clock.now = 100.2
        d.release(pool.by_address("d0"), short.seat, finished=True)  # gone before the prefill ends
        clock.now = 102.0
        d.prefill_done(p0, ticket("long", 1000), num_cached_tokens=0)
        return (p0.prefill_meter.tokens_per_s(clock.now, contended=True),
                p0.prefill_meter.tokens_per_s(clock.now, contended=False))

    assert run(scenario()) == (pytest.approx(500.0), None)


def test_fifo_policy_admits_everything_and_keeps_arrival_order():
    async def scenario():
        d, pool, clock = dispatcher("fifo", ttft=0.001, local_prefill_max_tokens=0, rescue_prefill_max_tokens=0)
        p0 = measured_prefill(pool, 10)  # 1 tok/s: every TTFT objective would be missed
        got = []

        async def go(t):
            await d.acquire(t)
            got.append(t.request_id)

        tasks = [asyncio.create_task(go(t)) for t in (ticket("o", 2000, O), ticket("o2", 2000, O), ticket("i", 10, I))]
        for t in (ticket("o", 2000, O), ticket("o2", 2000, O), ticket("i", 10, I)):
            d.admit(t)
        await asyncio.sleep(0)
        for _ in range(2):
            d.prefill_done(p0, ticket("x", p0.queued_tokens), 0)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return got

    assert run(scenario()) == ["o", "o2", "i"]

def test_a_queued_request_that_can_no_longer_meet_its_ttft_objective_is_refused_at_dispatch():
    async def scenario():
        d, pool, clock = dispatcher(local_prefill_max_tokens=0, rescue_prefill_max_tokens=0, prefill_queue_tokens=600)
        p0 = measured_prefill(pool, 1000)  # 100 tok/s
        busy = await d.acquire(ticket("busy", 500))
        late = asyncio.create_task(d.acquire(ticket("late", 300, ttft=8.5)))  # waits: the budget holds "busy"
        fine = asyncio.create_task(d.acquire(ticket("fine", 300, ttft=20.0)))
        await asyncio.sleep(0)  # queued: "late" forecast at (500 + 300) / 100 = 8 s
        clock.now = 106.0  # "busy" done after 6 s (rate now 1500 tok / 16 s): "late" would finish at 9.2 s > 8.5 s
        d.prefill_done(p0, ticket("busy", 500), 0)
        with pytest.raises(Refused, match="after 6.00 s in the queue, the predicted time to first token 9.20 s"):
            await late
        return busy.placement.where, (await fine).placement.where

    assert run(scenario()) == (Where.REMOTE, Where.REMOTE)

def test_a_queued_request_is_refused_once_the_overrun_of_the_prefill_ahead_says_it_will_miss():
    async def scenario():
        d, pool, clock = dispatcher(local_prefill_max_tokens=0, rescue_prefill_max_tokens=0, prefill_queue_tokens=600)
        measured_prefill(pool, 1000)  # 100 tok/s
        await d.acquire(ticket("busy", 500))  # due at 105
        waiting = asyncio.create_task(d.acquire(ticket("waiting", 300, ttft=8.5)))  # (500 + 300) / 100 = 8 s
        seen = []
        for clock.now in (103.0, 105.0):
            d.pump()
            await asyncio.sleep(0)
            seen.append(waiting.done())  # on time so far: 200 tokens left of "busy" at 103, none at 105
        clock.now = 106.0  # "busy" unanswered: at most 500 tok / 6 s, so 6 + 300 / 83.3 = 9.6 s
        with pytest.raises(Refused, match="after 6.00 s in the queue, the predicted time to first token 9.60 s") as e:
            await asyncio.wait_for(waiting, 1.0)  # the recheck timer, with no event to pump
        return seen, e.value.retry_after_s, list(d.queue.ordered(clock.now))

    seen, retry, queued = run(scenario())
    assert seen == [False, False]
    assert retry == pytest.approx(1.1) and queued == []


def test_a_queued_request_is_refused_when_its_ttft_objective_passes():
    async def scenario():
        d, pool, clock = dispatcher(local_prefill_max_tokens=0, rescue_prefill_max_tokens=0, prefill_queue_tokens=600)
        busy = await d.acquire(ticket("busy", 500))  # holds the tier: no rate measured yet
        waiting = asyncio.create_task(d.acquire(ticket("waiting", 300, ttft=2.0)))
        patient = asyncio.create_task(d.acquire(ticket("patient", 300)))  # no objective
        await asyncio.sleep(0)
        clock.now = 101.9
        d.pump()
        assert not waiting.done()
        clock.now = 102.0
        d.pump()
        with pytest.raises(Refused, match="objective of 2.00 s passed after 2.00 s in the gateway's interactive queue"):
            await asyncio.wait_for(waiting, 1.0)
        queued = [t.request_id for t in d.queue.ordered(clock.now)]
        patient.cancel()
        return busy.placement.where, queued

    assert run(scenario()) == (Where.REMOTE, ["patient"])

def test_fifo_never_refuses_a_queued_request_on_its_objective():
    async def scenario():
        d, pool, clock = dispatcher(policy="fifo", local_prefill_max_tokens=0, rescue_prefill_max_tokens=0,
                                    prefill_queue_tokens=600)
        await d.acquire(ticket("busy", 500))
        waiting = asyncio.create_task(d.acquire(ticket("waiting", 300, ttft=2.0)))
        await asyncio.sleep(0)
        clock.now = 110.0
        d.pump()
        await asyncio.sleep(0)
        done, queued = waiting.done(), len(d.queue)
        waiting.cancel()
        return done, queued

    assert run(scenario()) == (False, 1)

def test_a_short_prompt_on_the_tier_is_moved_while_a_decode_worker_can_still_meet_its_objective():
    async def scenario():
        d, pool, clock = dispatcher(ttft=0.49)
        measured_prefill(pool, 4000, contended=True)  # 400 tok/s beside decode
        d0 = pool.by_address("d0")
        d0.seats.add(d._seat(ticket("running", 10)))  # decode busy, no slack known: remote
        for tokens, seconds in ((100, 0.13), (200, 0.16), (300, 0.19)):  # 0.1 s + 0.3 ms/token
            d0.local_latency.observe(tokens, seconds, clock.now)
        t = ticket("interactive", 100, ttft=0.49, arrival=clock.now)
        grant = await d.acquire(t)
        assert grant.placement.where is Where.REMOTE and grant.placement.predicted_ttft_s == pytest.approx(0.25)
        # 0.49 s to its objective, a first token 0.13 s after reaching d0: moved at 0.36 s,
        # before twice its prediction (0.5 s).
        return d.stalled_after_s(t, grant.placement)

    assert run(scenario()) == pytest.approx(0.36)


def test_a_stalled_remote_prefill_is_moved_to_a_decode_worker_and_the_tier_sees_the_slowdown():
    async def scenario():
        d, pool, clock = dispatcher()
        p0, d0 = measured_prefill(pool, 4000, contended=True), pool.by_address("d0")  # 400 tok/s
        d0.seats.add(d._seat(ticket("running", 10)))  # decode busy, prefilling at 200 tok/s
        d0.local_meter.start(99.0)
        d0.local_meter.finish(200, 100.0)
        t = ticket("short", 40)
        grant = await d.acquire(t)
        assert grant.placement.where is Where.REMOTE and grant.placement.predicted_ttft_s == pytest.approx(0.1)
        assert d.stalled_after_s(t, grant.placement) == pytest.approx(0.25)
        clock.now += 0.25
        moved = d.move_stalled(p0, t, waited_s=0.25)
        assert (moved.placement.where, moved.placement.worker) == (Where.LOCAL, "d0")
        assert moved.seat in d0.seats and moved.seat.local_prefill_tokens == 40
        assert (p0.queued_tokens, p0.num_prefills) == (0, 0)
        # At most 40 tokens in 0.25 s, and no start to promise: the next short prompt is
        # prefilled where it is sure to start (0.4 s behind the moved one at 200 tok/s).
        assert p0.prefill_meter.tokens_per_s(clock.now) == pytest.approx(160.0)
        assert p0.prefill_load(clock.now).tokens_per_s is None
        nxt = await d.acquire(ticket("next", 40, arrival=clock.now))
        return nxt.placement.where

    assert run(scenario()) is Where.LOCAL

def test_with_decode_idle_a_long_prompt_is_given_the_tiers_time_alone_after_a_move_or_a_quiet_minute():
    """The long benchmark's loop: a move left the tier with no rate, so the next long prompt
    was moved after 1 s (stall_unknown_s), again and again."""
    async def scenario():
        d, pool, clock = dispatcher()
        p0, d0 = measured_prefill(pool, 8000), pool.by_address("d0")  # 800 tok/s alone
        clock.now += 120.0  # a quiet two minutes: nothing recent
        t = ticket("after-quiet", 1600, O, arrival=clock.now, ttft=3.0)
        grant = await d.acquire(t)
        out = [(grant.placement.where, grant.placement.predicted_ttft_s, d.stalled_after_s(t, grant.placement))]
        clock.now += 4.0
        moved = d.move_stalled(p0, t, waited_s=4.0)  # the cold engine was slow: taken back
        out.append(moved.placement.where)
        d0.seats.clear()  # it finished there; decode idle again
        t2 = ticket("after-move", 1200, O, arrival=clock.now)
        grant = await d.acquire(t2)
        out.append((grant.placement.where, grant.placement.predicted_ttft_s))
        d.prefill_done(p0, t2, None)
        d0.seats.add(d._seat(ticket("running", 10)))  # beside a decode the move still counts
        out.append(p0.prefill_load(clock.now, contended=True).tokens_per_s)
        return out

    assert run(scenario()) == [(Where.REMOTE, pytest.approx(2.0), pytest.approx(4.0)), Where.LOCAL,
                               (Where.REMOTE, pytest.approx(1.5)), None]


def test_beside_decode_a_tier_measured_only_alone_promises_nothing_and_a_prompt_moves_after_a_second():
    async def scenario():
        d, pool, _ = dispatcher()
        p0, d0 = measured_prefill(pool, 8000), pool.by_address("d0")  # 800 tok/s, alone only
        p0.info.host_id = "other"  # on a host of its own: the rescue at once is not for it
        d0.seats.add(d._seat(ticket("running", 10)))  # decode busy
        t = ticket("long", 1600, O, ttft=6.0)
        grant = await d.acquire(t)
        rate_admission = p0.prefill_meter.tokens_per_s(100.0, contended=True)  # errs towards admitting
        return grant.placement.where, grant.placement.predicted_ttft_s, d.stalled_after_s(t, grant.placement), \
            rate_admission

    assert run(scenario()) == (Where.REMOTE, None, pytest.approx(1.0), pytest.approx(800.0))


def test_beside_decode_on_the_tiers_host_a_long_prompt_is_rescued_at_once_when_the_tier_has_no_rate_there():
    async def scenario():
        d, pool, clock = dispatcher()
        p0, d0 = measured_prefill(pool, 8000), pool.by_address("d0")  # 800 tok/s, alone only
        d0.seats.add(d._seat(ticket("running", 10)))  # decode busy, no objective: all slack
        d0.local_meter.start(98.0)
        d0.local_meter.finish(1000, 100.0)  # 500 tok/s of its own
        grant = await d.acquire(ticket("long", 1600, O, ttft=6.0))
        out = [(grant.placement.where, grant.placement.predicted_ttft_s)]
        d0.seats.clear()
        p0.info.host_id = "other"  # the tier on a host of its own: not starved by d0
        d0.seats.add(d._seat(ticket("running", 10)))
        grant = await d.acquire(ticket("long2", 1600, O, arrival=clock.now, ttft=6.0))
        out.append((grant.placement.where, grant.placement.predicted_ttft_s))
        return out

    assert run(scenario()) == [(Where.LOCAL, pytest.approx(3.2)), (Where.REMOTE, None)]


def test_a_prefill_worker_that_never_answered_is_given_a_decode_workers_own_prefill_rate():
    async def scenario():
        d, pool, _ = dispatcher()
        d0 = pool.by_address("d0")
        d0.local_meter.start(98.0)
        d0.local_meter.finish(1000, 100.0)  # a prompt it prefilled itself: 500 tok/s
        t = ticket("long", 1500, O)
        grant = await d.acquire(t)
        return grant.placement.where, grant.placement.predicted_ttft_s, d.stalled_after_s(t, grant.placement)

    assert run(scenario()) == (Where.REMOTE, pytest.approx(3.0), pytest.approx(6.0))


def test_a_stalled_remote_prefill_stays_while_no_decode_worker_has_a_seat():
    async def scenario():
        d, pool, clock = dispatcher()
        p0, d0 = measured_prefill(pool, 4000), pool.by_address("d0")
        for i in range(8):  # max_num_seqs 8: full
            d0.seats.add(d._seat(ticket(f"running{i}", 10)))
        t = ticket("short", 40)
        grant = await d.acquire(t)
        assert grant.placement.where is Where.REMOTE
        clock.now += 1.0
        assert d.move_stalled(p0, t, waited_s=1.0) is None
        assert (p0.queued_tokens, p0.num_prefills) == (40, 1)  # still the tier's to answer
        d.prefill_done(p0, t, num_cached_tokens=0)
        return p0.queued_tokens

    assert run(scenario()) == 0


def _old_on_the_tier_and_a_new_one_held_back(d, pool, clock):
    """"old" (800 tokens) on the tier at 1,000 tok/s; "new" (800), sent at 101 with the tier
    full (1,000 tokens of room), would be rescued on the idle decode worker."""
    async def scenario():
        p0 = measured_prefill(pool, 10_000)  # 1,000 tok/s alone
        old = ticket("old", 800, ttft=3.0)
        grant = await d.acquire(old)
        asked = d.remote_started(p0, old)
        clock.now = 101.0
        new = asyncio.create_task(d.acquire(ticket("new", 800, arrival=101.0, ttft=3.0)))
        await asyncio.sleep(0)
        return p0, old, grant, asked, new
    return scenario()


def test_a_rescue_is_offered_first_to_an_older_prompt_waiting_on_the_tier_of_the_same_host():
    async def scenario():
        d, pool, clock = dispatcher(prefill_queue_tokens=1000)
        p0, old, grant, asked, new = await _old_on_the_tier_and_a_new_one_held_back(d, pool, clock)
        held = (grant.placement.where, asked.is_set(), new.done())
        moved = d.move_stalled(p0, old, waited_s=1.0, offered=True)  # what the waiting call does when asked
        d.remote_ended(old)
        placed = await asyncio.wait_for(new, 1.0)
        return (held, moved.placement.where, placed.placement.where, p0.queued_tokens,
                p0.prefill_load(clock.now).tokens_per_s)

    held, moved, placed, queued, rate = run(scenario())
    assert held == (Where.REMOTE, True, False)
    # The newer one after it: d0 now prefills the older one, so the tier on its host has no
    # rate beside it and is taken to miss (`place(..., tier_starved=True)`); d0 rescues it.
    assert (moved, placed, queued) == (Where.LOCAL, Where.LOCAL, 0)
    assert rate == pytest.approx(1000.0)  # taken back for its turn: no bound on the tier's rate


def test_a_rescue_the_older_prompt_cannot_take_in_time_goes_to_the_newer_one():
    async def scenario():
        d, pool, clock = dispatcher(prefill_queue_tokens=1000)
        p0, old, _, asked, new = await _old_on_the_tier_and_a_new_one_held_back(d, pool, clock)
        clock.now = 103.1  # past the old one's objective: a move cannot meet it
        assert d.move_stalled(p0, old, waited_s=3.1, offered=True) is None
        placed = await asyncio.wait_for(new, 0.1)  # at once, not at the next recheck (0.25 s)
        return asked.is_set(), placed.placement.where, placed.placement.predicted_ttft_s, p0.queued_tokens

    assert run(scenario()) == (True, Where.LOCAL, pytest.approx(0.8), 800)


def test_a_prompt_past_its_objective_on_the_tier_moves_within_slack_only_while_nothing_waits():
    async def scenario():
        d, pool, clock = dispatcher(prefill_queue_tokens=800)
        p0 = measured_prefill(pool, 10_000)  # 1,000 tok/s alone
        old = ticket("old", 800, ttft=3.0)
        assert (await d.acquire(old)).placement.where is Where.REMOTE
        clock.now = 103.5  # past its objective: no rescue can meet it
        # A prompt queued behind the full tier (too long for a rescue) waits: the decode
        # worker's slack is kept for the prompts that can still meet their objectives.
        waiting = asyncio.create_task(d.acquire(ticket("waiting", 5000, arrival=103.5, ttft=30.0)))
        await asyncio.sleep(0)
        assert not waiting.done()
        kept = d.move_stalled(p0, old, waited_s=3.5)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        moved = d.move_stalled(p0, old, waited_s=3.5)  # nothing waits now
        return kept, moved.placement.where, (p0.queued_tokens, p0.num_prefills)

    assert run(scenario()) == (None, Where.LOCAL, (0, 0))
