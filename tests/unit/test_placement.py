"""gateway.placement: conditional disaggregation, prefill routing, decode seats, slack."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gateway.placement import (
    DecodeLoad,
    PlacementConfig,
    PrefillLoad,
    PrefixIndex,
    RunningRequest,
    Where,
    decode_slack_s,
    join_slack_s,
    local_step_tokens,
    move_stalled,
    pick_decode,
    place,
    place_without_tier,
    rescue_long,
    soonest_local_ttft_s,
    stalled_after_s,
)

CFG = PlacementConfig(prefill_queue_tokens=1024, local_prefill_max_tokens=256)


def prefill(name="p0", queued=0, tps=200.0, matched=0) -> PrefillLoad:
    return PrefillLoad(name, queued, tps, matched)


def decode(name="d0", running=0, local_tokens=0, tps=200.0, slack=math.inf, kv_used=0,
           kv_capacity=10_000, max_seqs=64) -> DecodeLoad:
    return DecodeLoad(name, running, max_seqs, kv_used, kv_capacity, local_tokens, tps, slack)


def test_short_prompt_on_an_idle_decode_worker_is_prefilled_there():
    p = place(64, 128, [prefill()], [decode()], CFG)
    assert (p.where, p.worker) == (Where.LOCAL, "d0")
    assert p.predicted_ttft_s == pytest.approx(64 / 200)


def test_long_prompt_goes_to_the_prefill_tier():
    p = place(2000, 2100, [prefill(queued=0)], [decode()], CFG)
    assert (p.where, p.worker) == (Where.REMOTE, "p0")
    # An objective the tier meets changes nothing, idle decode worker or not.
    p = place(2000, 2100, [prefill(queued=0)], [decode()], CFG, ttft_budget_s=10.5)
    assert (p.where, p.worker) == (Where.REMOTE, "p0")


def test_a_decode_worker_takes_a_long_prompt_within_its_slack_when_the_tier_would_miss_its_ttft():
    # The prefill tier crawls beside a busy decode engine: 800 tokens at 200 tok/s is 4 s.
    starved = [prefill(tps=200.0)]
    busy = [decode(running=1, tps=1000.0, slack=3.0)]  # 0.8 s stall within 3 s of slack
    assert place(800, 900, starved, busy, CFG).where is Where.REMOTE  # no objective
    assert place(800, 900, starved, busy, CFG, ttft_budget_s=4.5).where is Where.REMOTE
    rescued = place(800, 900, starved, busy, CFG, ttft_budget_s=3.0)
    assert (rescued.where, rescued.worker, rescued.predicted_ttft_s) == (Where.LOCAL, "d0", pytest.approx(0.8))
    # Not beyond the running requests' slack (a short prompt would be), nor past its budget.
    tight = [decode(running=1, tps=1000.0, slack=0.5)]
    assert place(800, 900, starved, tight, CFG, ttft_budget_s=3.0).where is Where.REMOTE
    assert place(800, 900, starved, busy, CFG, ttft_budget_s=0.7).where is Where.REMOTE
    # Nor over the rescue limit, nor when the tier's rate is unknown (nothing says it misses).
    capped = PlacementConfig(prefill_queue_tokens=1024, local_prefill_max_tokens=256, rescue_prefill_max_tokens=512)
    assert place(800, 900, starved, busy, capped, ttft_budget_s=3.0).where is Where.REMOTE
    assert place(800, 900, [prefill(tps=None)], busy, CFG, ttft_budget_s=3.0).where is Where.REMOTE


def test_a_starved_tier_without_a_rate_beside_decode_is_taken_to_miss():
    busy = [decode(running=1, tps=1000.0, slack=3.0)]
    unknown = [prefill(tps=None)]
    rescued = place(800, 900, unknown, busy, CFG, ttft_budget_s=3.0, tier_starved=True)
    assert (rescued.where, rescued.predicted_ttft_s) == (Where.LOCAL, pytest.approx(0.8))
    # The rescue's own rules hold: within the slack, in time, and only with an objective.
    tight = [decode(running=1, tps=1000.0, slack=0.5)]
    assert place(800, 900, unknown, tight, CFG, ttft_budget_s=3.0, tier_starved=True).where is Where.REMOTE
    assert place(800, 900, unknown, busy, CFG, ttft_budget_s=0.7, tier_starved=True).where is Where.REMOTE
    assert place(800, 900, unknown, busy, CFG, tier_starved=True).where is Where.REMOTE
    # A rate measured beside decode speaks for the tier: it meets the budget, it goes there.
    assert place(800, 900, [prefill(tps=400.0)], busy, CFG, ttft_budget_s=3.0, tier_starved=True).where is Where.REMOTE


def test_a_long_prompt_the_full_prefill_tier_cannot_take_goes_to_a_decode_worker_in_time():
    full = [prefill(queued=900)]  # 800 more would pass the 1,024-token budget: no room
    busy = [decode(running=2, tps=1000.0, slack=2.0)]
    assert place(800, 900, full, busy, CFG) is None  # it waits for the tier
    assert place(800, 900, full, busy, CFG, ttft_budget_s=3.0).where is Where.LOCAL
    assert place(800, 900, full, busy, CFG, remote_open=False, ttft_budget_s=3.0).where is Where.LOCAL
    assert place(800, 900, full, busy, CFG, ttft_budget_s=0.5) is None


def test_a_decode_worker_that_has_timed_no_prefill_is_judged_at_the_rescue_rate():
    # Long prompts only: the decode worker never prefilled one itself, so it has no rate.
    starved = [prefill(tps=200.0)]
    unmeasured = [decode(running=1, tps=None, slack=3.0)]
    assert place(800, 900, starved, unmeasured, CFG, ttft_budget_s=3.0).where is Where.REMOTE
    rescued = place(800, 900, starved, unmeasured, CFG, ttft_budget_s=3.0, rescue_rate=1000.0)
    assert (rescued.where, rescued.predicted_ttft_s) == (Where.LOCAL, pytest.approx(0.8))
    # A measured rate of its own wins over the stand-in.
    measured = [decode(running=1, tps=500.0, slack=3.0)]
    assert rescue_long(800, 900, measured, CFG, rescue_rate=1000.0).predicted_ttft_s == pytest.approx(1.6)
    # Short prompts keep their own rules: no stand-in rate for them (it waits for the tier).
    assert place(200, 300, [prefill(queued=900)], unmeasured, CFG, ttft_budget_s=3.0, rescue_rate=1000.0) is None


def test_rescue_long_is_for_prompts_between_the_local_and_the_rescue_limits():
    busy = [decode(running=1, tps=1000.0, slack=3.0)]
    assert rescue_long(200, 300, busy, CFG) is None  # a short prompt has its own rules
    assert rescue_long(800, 900, busy, CFG).predicted_ttft_s == pytest.approx(0.8)
    assert rescue_long(5000, 5100, busy, CFG) is None
    assert rescue_long(800, 900, [decode(running=1, tps=1000.0, slack=0.5)], CFG) is None


def test_short_prompt_goes_remote_when_that_finishes_sooner():
    # Decode prefills at 50 tok/s with 100 tokens of its own pending; the prefill tier is free.
    p = place(100, 200, [prefill(tps=400.0)], [decode(running=2, local_tokens=100, tps=50.0)], CFG)
    assert p.where is Where.REMOTE
    assert p.predicted_ttft_s == pytest.approx(0.25)


def test_short_prompt_goes_local_when_the_prefill_tier_is_backed_up():
    # The prefill worker holds a 900-token prompt: 100 more fit the budget but finish at 5 s.
    p = place(100, 200, [prefill(queued=900)], [decode(running=3, tps=100.0, slack=2.0)], CFG)
    assert p.where is Where.LOCAL
    assert p.predicted_ttft_s == pytest.approx(1.0)


def test_no_local_prefill_when_the_stall_exceeds_running_requests_slack():
    p = place(200, 300, [prefill(queued=800)], [decode(running=3, tps=100.0, slack=1.5)], CFG)
    assert p.where is Where.REMOTE  # a 2 s stall would break their TPOT objectives


def test_an_idle_decode_worker_prefills_a_short_prompt_even_if_the_tier_is_faster():
    p = place(64, 128, [prefill(tps=1000.0)], [decode(tps=100.0)], CFG)
    assert p.where is Where.LOCAL


def test_a_decode_worker_takes_a_short_prompt_beyond_its_slack_when_the_tier_would_miss_its_ttft():
    workers = [prefill(tps=20.0)]  # 100 tokens: 5 s on the starved prefill tier
    busy = [decode(running=3, tps=200.0, slack=0.1)]  # 0.5 s stall > 0.1 s slack
    assert place(100, 200, workers, busy, CFG).where is Where.REMOTE
    assert place(100, 200, workers, busy, CFG, ttft_budget_s=10.0).where is Where.REMOTE
    rescued = place(100, 200, workers, busy, CFG, ttft_budget_s=1.0)
    assert (rescued.where, rescued.predicted_ttft_s) == (Where.LOCAL, pytest.approx(0.5))
    # Neither makes it: the tier, which disturbs no one.
    assert place(100, 200, workers, busy, CFG, ttft_budget_s=0.2).where is Where.REMOTE


def test_unmeasured_local_rate_prefills_locally_only_on_an_idle_decode_worker():
    assert place(64, 80, [prefill()], [decode(tps=None)], CFG).where is Where.LOCAL
    assert place(64, 80, [prefill()], [decode(running=1, tps=None)], CFG).where is Where.REMOTE


def test_prefill_worker_budget_bounds_work_sent_ahead_of_the_engine():
    # An idle worker always takes one prompt, even beyond the budget ...
    assert place(3000, 3100, [prefill(queued=0)], [decode()], CFG).where is Where.REMOTE
    # ... a busy one only what fits it: nowhere to go, wait.
    assert place(500, 600, [prefill(queued=600)], [decode(running=1)], CFG) is None


def test_remote_closed_keeps_the_prefill_tier_for_a_ticket_ahead():
    assert place(500, 600, [prefill()], [decode()], CFG, remote_open=False) is None
    assert place(64, 80, [prefill()], [decode()], CFG, remote_open=False).where is Where.LOCAL


def test_prefill_routing_soonest_finish_and_prefix_affinity():
    workers = [prefill("p0", queued=400), prefill("p1", queued=0, tps=100.0)]
    # p0: (400 + 600) / 200 = 5 s; p1: 600 / 100 = 6 s.
    assert place(600, 700, workers, [], CFG).worker == "p0"
    # p1 holds 512 of the prompt's tokens in its prefix cache: 88 / 100 s.
    workers[1] = prefill("p1", queued=0, tps=100.0, matched=512)
    assert place(600, 700, workers, [], CFG).worker == "p1"


def test_decode_seat_by_running_requests_then_kv_use():
    ds = [decode("d0", running=2, kv_used=100), decode("d1", running=1, kv_used=9000),
          decode("d2", running=1, kv_used=50)]
    assert pick_decode(500, ds) == "d2"
    assert pick_decode(9_960, ds) is None  # no worker has the KV room
    assert pick_decode(100, [decode(running=64)]) is None  # no seat


def test_decode_slack_is_the_tightest_running_request_margin():
    running = [
        # 100 tokens at 50 ms allowed: 4.95 s in all; 1 s spent, 80 left at 40 ms: 0.75 s.
        RunningRequest(0.050, 100, 20, first_token_s=9.0),
        # no objective: no limit
        RunningRequest(None, 100, 20, first_token_s=9.0),
        # not started yet: no limit
        RunningRequest(0.010, 100, 0, first_token_s=None),
    ]
    assert decode_slack_s(running, 0.040, now_s=10.0) == pytest.approx(0.75)
    assert decode_slack_s(running[1:], 0.040, now_s=10.0) == math.inf
    # Past its margin (0.09 s allowed, 10 s spent): a sure miss, not protected.
    late = RunningRequest(0.01, 10, 5, 0.0)
    assert decode_slack_s([late], 0.04, now_s=10.0) == math.inf
    assert decode_slack_s([late, running[0]], 0.040, now_s=10.0) == pytest.approx(0.75)
    # Exactly at its margin: still met, nothing to spare.
    assert decode_slack_s([RunningRequest(0.050, 3, 1, first_token_s=9.9)], 0.0, now_s=10.0) == pytest.approx(0.0)


def test_join_slack_is_what_a_lower_class_joining_leaves_a_higher_one():
    # 51 tokens at 40 ms allowed: 2.0 s; 1 s spent, 40 left: at 20 ms a step 0.2 s to spare.
    interactive = RunningRequest(0.040, 51, 11, first_token_s=9.0, priority=0)
    # An offline request of 21 tokens runs beside it for 20 of its 40 steps, at 25 ms.
    assert join_slack_s([interactive], 2, 21, 0.020, 0.025, now_s=10.0) == pytest.approx(0.1)
    # One of 101 tokens for all 40 of them: nothing to spare; at 30 ms, a miss by 0.2 s.
    assert join_slack_s([interactive], 2, 101, 0.020, 0.025, now_s=10.0) == pytest.approx(0.0)
    assert join_slack_s([interactive], 2, 101, 0.020, 0.030, now_s=10.0) == pytest.approx(-0.2)
    # The same class, a higher one, no step measured: nothing to protect.
    assert join_slack_s([interactive], 0, 101, 0.020, 0.030, now_s=10.0) == math.inf
    offline = replace(interactive, priority=2)
    assert join_slack_s([offline], 0, 101, 0.020, 0.030, now_s=10.0) == math.inf
    assert join_slack_s([interactive], 2, 101, None, 0.030, now_s=10.0) == math.inf
    # Already late at 30 ms without it (1.2 s of steps left in 1.0 s): not the join's doing.
    assert join_slack_s([interactive], 2, 101, 0.030, 0.040, now_s=10.0) == math.inf
    # The tightest of those it protects; one without an objective or a first token has none.
    tight = RunningRequest(0.040, 51, 11, first_token_s=8.9, priority=1)
    others = [RunningRequest(None, 51, 11, 9.0), RunningRequest(0.040, 51, 0, None)]
    assert join_slack_s([interactive, tight, *others], 2, 21, 0.020, 0.025, now_s=10.0) == pytest.approx(0.0)


def test_a_short_prompt_behind_a_chunked_long_one_waits_for_one_chunk_of_it():
    # No cap: behind all 1,900 pending tokens; a cap of 256: beside the next chunk.
    assert local_step_tokens(1900, 100, 0) == 2000
    assert local_step_tokens(1900, 100, 256) == 356
    assert local_step_tokens(200, 100, 256) == 300  # less pending than a chunk
    assert local_step_tokens(1900, 300, 256) == 2200  # itself chunked: behind all of it
    fitted = replace(decode(running=1, local_tokens=1900), local_ttft_fit=(0.05, 0.001))
    assert fitted.local_ttft_s(100) == pytest.approx(0.05 + 2.0)
    assert replace(fitted, chunk_tokens=256).local_ttft_s(100) == pytest.approx(0.05 + 0.356)
    # Without a fit, the local rate: 200 tokens/s.
    assert replace(decode(local_tokens=1900), chunk_tokens=256).local_ttft_s(100) == pytest.approx(356 / 200)


def test_prefix_index_matches_whole_leading_blocks():
    index = PrefixIndex(block_size=4)
    keys = index.keys
    a = tuple(range(10))  # blocks [0-3], [4-7]; 8, 9 are a partial block
    assert len(keys(a)) == 2
    index.record(keys(a), "p0")
    assert index.matched_tokens(keys(a)) == {"p0": 8}
    assert index.matched_tokens(keys(tuple(range(4)) + (99, 98, 97, 96))) == {"p0": 4}
    assert index.matched_tokens(keys((99,) + a[1:])) == {}
    index.record(keys(tuple(range(4)) + (50, 51, 52, 53)), "p1")
    assert index.matched_tokens(keys(a)) == {"p1": 4, "p0": 8}
    index.forget("p0")
    assert index.matched_tokens(keys(a)) == {"p1": 4}


def test_prefix_index_is_bounded():
    index = PrefixIndex(block_size=2, max_entries=3)
    index.record(index.keys((1, 2, 3, 4)), "p0")
    index.record(index.keys((5, 6, 7, 8)), "p1")  # 4 keys: the oldest, (1, 2), is forgotten
    assert index.matched_tokens(index.keys((1, 2, 3, 4))) == {}
    assert index.matched_tokens(index.keys((5, 6, 7, 8))) == {"p1": 4}


def test_short_prompt_goes_local_when_the_tier_rate_is_unknown_and_the_decode_rate_known():
    p = place(40, 80, [prefill(tps=None)], [decode(running=2, tps=100.0, slack=1.0)], CFG)
    assert (p.where, p.predicted_ttft_s) == (Where.LOCAL, pytest.approx(0.4))
    # Unknown locally too: the tier measures it.
    assert place(40, 80, [prefill(tps=None)], [decode(running=2, tps=None)], CFG).where is Where.REMOTE


def test_a_remote_prefill_is_stalled_after_twice_its_prediction_and_never_past_the_rescue_limit():
    assert stalled_after_s(100, 0.5, CFG) == pytest.approx(1.0)
    assert stalled_after_s(100, 0.05, CFG) == pytest.approx(0.25)  # never before stall_min_s
    assert stalled_after_s(100, None, CFG) == pytest.approx(1.0)  # nothing predicted it
    assert stalled_after_s(1000, 3.0, CFG) == pytest.approx(6.0)  # a rescue may move it
    assert stalled_after_s(4097, 3.0, CFG) is None  # too long for a decode worker: it stays
    no_rescue = PlacementConfig(prefill_queue_tokens=1024, local_prefill_max_tokens=256, rescue_prefill_max_tokens=0)
    assert stalled_after_s(257, 0.5, no_rescue) is None


def test_a_short_prompt_moves_while_a_decode_worker_can_still_meet_its_objective():
    # 0.49 s to its objective, 0.2 s to a first token on a decode worker: moved at 0.29 s,
    # not at twice the predicted 0.3 s.
    assert stalled_after_s(236, 0.3, CFG, ttft_budget_s=0.49, local_ttft_s=0.2) == pytest.approx(0.29)
    # Twice the prediction comes first: unchanged.
    assert stalled_after_s(236, 0.1, CFG, ttft_budget_s=2.0, local_ttft_s=0.2) == pytest.approx(0.25)
    assert stalled_after_s(236, 0.2, CFG, ttft_budget_s=2.0, local_ttft_s=0.2) == pytest.approx(0.4)
    # Never before stall_min_s, even when the objective is already out of reach.
    assert stalled_after_s(236, 0.3, CFG, ttft_budget_s=0.3, local_ttft_s=0.2) == pytest.approx(0.25)
    # No objective, or no measured local time: twice the prediction.
    assert stalled_after_s(236, 0.3, CFG, ttft_budget_s=None, local_ttft_s=0.2) == pytest.approx(0.6)
    assert stalled_after_s(236, 0.3, CFG, ttft_budget_s=0.49, local_ttft_s=None) == pytest.approx(0.6)
    # A prompt over the local limit moves only as a rescue: its budget does not hurry it.
    assert stalled_after_s(1000, 3.0, CFG, ttft_budget_s=4.0, local_ttft_s=1.0) == pytest.approx(6.0)


def test_a_stalled_prompt_moves_to_the_decode_worker_that_takes_it_soonest():
    busy = decode("d0", running=3, local_tokens=100, tps=100.0, slack=5.0)
    free = decode("d1", running=1, tps=100.0, slack=5.0)
    p = move_stalled(40, 80, [busy, free], CFG)
    assert (p.where, p.worker) == (Where.LOCAL, "d1")
    assert p.predicted_ttft_s == pytest.approx(0.4)


def test_a_stalled_prompt_stays_when_no_decode_worker_can_take_it():
    no_slack = decode(running=3, tps=100.0, slack=0.1)  # a 0.4 s stall breaks their objectives
    assert move_stalled(40, 80, [no_slack], CFG) is None
    assert move_stalled(40, 80, [decode(running=64, max_seqs=64)], CFG) is None  # no seat
    assert move_stalled(300, 400, [decode()], CFG) is None  # too long, with no objective to rescue
    # A long prompt moves within the running requests' slack when that meets its objective.
    slack = decode(running=2, tps=1000.0, slack=1.0)
    assert move_stalled(800, 900, [slack], CFG, ttft_budget_s=2.0).predicted_ttft_s == pytest.approx(0.8)
    assert move_stalled(800, 900, [slack], CFG, ttft_budget_s=0.5) is None
    assert move_stalled(1200, 1300, [slack], CFG, ttft_budget_s=2.0) is None  # a 1.2 s stall
    unmeasured = decode(running=2, tps=None, slack=1.0)
    assert move_stalled(800, 900, [unmeasured], CFG, ttft_budget_s=2.0) is None
    assert move_stalled(800, 900, [unmeasured], CFG, ttft_budget_s=2.0, rescue_rate=1000.0).where is Where.LOCAL
    # Its TTFT objective is missed where it is, and met on a decode worker: moved beyond slack.
    p = move_stalled(40, 80, [no_slack], CFG, ttft_budget_s=0.5)
    assert (p.where, p.worker) == (Where.LOCAL, "d0")


def test_a_short_prompt_already_past_its_objective_moves_beyond_slack_whoever_waits():
    """On the tier beside a decode engine with no slack it would wait for the batch to
    drain (seen: 13 s); on a decode worker it costs one step a short prompt."""
    no_slack = decode(running=3, tps=100.0, slack=0.0)
    for late_rescue in (True, False):
        p = move_stalled(40, 80, [no_slack], CFG, ttft_budget_s=-0.1, late_rescue=late_rescue)
        assert (p.where, p.worker, p.predicted_ttft_s) == (Where.LOCAL, "d0", pytest.approx(0.4))
    assert move_stalled(40, 80, [no_slack], CFG, ttft_budget_s=0.0).where is Where.LOCAL
    assert move_stalled(40, 80, [no_slack], CFG, ttft_budget_s=0.1) is None  # a budget it would miss
    assert move_stalled(40, 80, [no_slack], CFG) is None  # no objective: nothing says it is late
    assert move_stalled(40, 80, [decode(running=64, max_seqs=64, slack=0.0)], CFG, ttft_budget_s=-0.1) is None
    # The decode worker that would give the first token soonest.
    p = move_stalled(40, 80, [no_slack, decode("d1", running=5, local_tokens=200, tps=100.0, slack=0.0)], CFG,
                     ttft_budget_s=-1.0)
    assert p.worker == "d0"


def test_a_long_prompt_already_past_its_objective_moves_within_slack_never_beyond():
    """No budget is left to meet, so the rescue's budget test cannot pass; within the running
    requests' slack it moves all the same (the tier and the caller wait no longer), and
    never beyond it, nor past the rescue limit."""
    slack = decode(running=2, tps=1000.0, slack=1.0)
    assert move_stalled(800, 900, [slack], CFG, ttft_budget_s=0.5) is None  # still has a budget: missed there
    late = move_stalled(800, 900, [slack], CFG, ttft_budget_s=-3.0)
    assert (late.where, late.worker, late.predicted_ttft_s) == (Where.LOCAL, "d0", pytest.approx(0.8))
    assert move_stalled(800, 900, [slack], CFG, ttft_budget_s=0.0).where is Where.LOCAL
    assert move_stalled(1200, 1300, [slack], CFG, ttft_budget_s=-3.0) is None  # a 1.2 s stall: beyond slack
    assert move_stalled(5000, 5100, [decode(running=2, tps=1000.0, slack=99.0)], CFG, ttft_budget_s=-3.0) is None
    assert move_stalled(800, 900, [slack], CFG) is None  # no objective: nothing says it is late
    assert move_stalled(800, 900, [slack], CFG, ttft_budget_s=-3.0, late_rescue=False) is None  # others wait


def test_a_measured_local_latency_counts_the_fixed_part_once_for_prompts_batched_together():
    # 0.16 s + 1 ms per token of the step's prompts: 40 pending + 60 new = 0.26 s, where a
    # rate of 200 tok/s (40 tokens in 0.2 s alone) would say 0.5 s.
    d = DecodeLoad("d0", 2, 64, 0, 10_000, 40, 200.0, math.inf, local_ttft_fit=(0.16, 0.001))
    assert d.local_ttft_s(60) == pytest.approx(0.26)
    p = place(60, 100, [prefill(tps=200.0)], [d], CFG)
    assert (p.where, p.predicted_ttft_s) == (Where.LOCAL, pytest.approx(0.26))


def test_with_no_prefill_tier_a_decode_worker_prefills_any_prompt_even_beyond_its_slack():
    """Colocated serving until a prefill worker is back: the least busy decode worker with a
    seat takes a prompt of any length, its running requests' slack notwithstanding."""
    busy = decode("d0", running=3, slack=0.0, tps=1000.0)
    idle = decode("d1", running=1, slack=0.0, tps=1000.0)
    p = place_without_tier(3000, 3100, [busy, idle])
    assert (p.where, p.worker, p.predicted_ttft_s) == (Where.LOCAL, "d1", pytest.approx(3.0))
    full = decode("d1", running=1, kv_used=9_000)
    assert place_without_tier(3000, 3100, [full]) is None  # no KV room anywhere: it waits
    assert place_without_tier(3000, 3100, [decode("d2", running=1, tps=None)]).predicted_ttft_s is None


def test_the_soonest_local_first_token_comes_from_measured_fits_of_workers_with_a_seat():
    fitted = replace(decode("d0", local_tokens=100), local_ttft_fit=(0.1, 0.001))  # 0.1 + 0.001 * (100 + 50)
    faster_full = replace(decode("d1", running=64), local_ttft_fit=(0.01, 0.0))  # no seat
    rate_only = decode("d2", tps=1000.0)  # a rate bound, not a measured time
    assert soonest_local_ttft_s(50, 100, [fitted, faster_full, rate_only]) == pytest.approx(0.25)
    assert soonest_local_ttft_s(50, 100, [faster_full, rate_only]) is None
