"""gateway.admission: measured rates, forecasts and refusals with exact values."""

from __future__ import annotations

import pytest

from gateway.admission import (
    best_case_quantile,
    MAX_RETRY_S,
    MIN_RETRY_S,
    Forecast,
    Reason,
    decide,
    figure,
    predict_ttft_s,
    remaining_tokens,
)
from gateway.meters import ServiceMeter, StepMeter


def test_service_meter_counts_busy_time_only():
    m = ServiceMeter()
    assert m.tokens_per_s(0.0) is None
    m.start(0.0)
    m.finish(200, 2.0)  # 100 tok/s
    m.start(50.0)  # idle from 2 to 50 s: not counted
    m.finish(300, 51.0)  # 300 tok/s
    assert m.tokens_per_s(51.0) == pytest.approx(500 / 3.0)


def test_service_meter_shares_a_step_between_requests_batched_together():
    m = ServiceMeter()
    m.start(0.0)
    m.start(0.0)
    m.finish(100, 1.0)
    m.finish(100, 1.0)  # charged 0 s, the first completion took the step's time
    assert m.tokens_per_s(1.0) == pytest.approx(200.0)


def test_service_meter_window_forgets_old_samples():
    m = ServiceMeter(window=2)
    for tokens, t in ((1000, 1.0), (100, 2.0), (100, 3.0)):
        m.start(t - 1.0)
        m.finish(tokens, t)
    assert m.tokens_per_s(3.0) == pytest.approx(100.0)


def test_service_meter_forgets_completions_older_than_max_age():
    m = ServiceMeter(max_age_s=60.0)
    m.start(0.0)
    m.finish(100, 2.0)  # 50 tok/s, e.g. prefilled while decode held the cores
    assert m.tokens_per_s(62.0) == pytest.approx(50.0)
    assert m.tokens_per_s(62.5) is None  # unknown: the next request is admitted to measure it
    m.start(70.0)
    m.finish(1300, 75.0)
    assert m.tokens_per_s(75.0) == pytest.approx(260.0)  # the old sample no longer drags it down


def test_service_meter_reads_completions_made_under_the_same_decode_load():
    m = ServiceMeter()
    m.start(0.0, contended=False)
    m.finish(2000, 2.0, contended=False)  # 1,000 tok/s alone
    assert m.tokens_per_s(2.0, contended=True) == pytest.approx(1000.0)  # the optimistic bound
    m = ServiceMeter()
    m.start(0.0, contended=True)
    m.finish(200, 1.0, contended=True)  # 200 tok/s while decode ran
    m.start(10.0, contended=False)
    m.finish(500, 11.0, contended=True)  # decode began during it: contended, 500 tok/s
    assert m.tokens_per_s(11.0, contended=True) == pytest.approx(350.0)
    assert m.tokens_per_s(11.0, contended=False) is None  # none alone: unknown, admit
    m.start(20.0, contended=False)
    m.finish(1000, 21.0, contended=False)  # alone: 1,000 tok/s
    assert m.tokens_per_s(21.0, contended=False) == pytest.approx(1000.0)
    assert m.tokens_per_s(21.0, contended=True) == pytest.approx(350.0)
    assert m.tokens_per_s(21.0) == pytest.approx(1700 / 3.0)  # all of them
    # A busy time that continues past a completion begins then, with decode as it was then.
    m.start(30.0, contended=False)
    m.start(30.0, contended=False)
    m.finish(100, 31.0, contended=True)
    m.finish(300, 32.0, contended=False)
    assert m.tokens_per_s(32.0, contended=True) == pytest.approx((200 + 500 + 100 + 300) / 4.0)
    assert m.tokens_per_s(32.0, contended=False) == pytest.approx(1000.0)


def test_a_busy_time_that_decode_requests_joined_midway_is_contended():
    m = ServiceMeter()
    m.contend()  # nothing busy: nothing to mark
    m.start(0.0, contended=False)
    m.finish(1000, 1.0, contended=False)  # alone: 1,000 tok/s
    m.start(10.0, contended=False)
    m.contend()  # an interactive request came and went while it ran
    m.finish(300, 11.0, contended=False)
    assert m.tokens_per_s(11.0, contended=False) == pytest.approx(1000.0)
    assert m.tokens_per_s(11.0, contended=True) == pytest.approx(300.0)


def test_service_meter_cancel_leaves_no_sample():
    m = ServiceMeter()
    m.start(0.0)
    m.cancel(5.0)
    assert m.tokens_per_s(5.0) is None
    m.start(10.0)
    m.finish(50, 11.0)
    assert m.tokens_per_s(11.0) == pytest.approx(50.0)


def test_step_meter_predicts_from_the_nearest_smaller_bucket():
    s = StepMeter(min_samples=1)
    assert s.predict(1, 0.0) is None
    s.observe(1, 0.040, 0.0)
    s.observe(3, 0.060, 0.0)  # bucket 4
    s.observe(4, 0.080, 0.0)  # bucket 4: median 0.070
    assert s.predict(1, 0.0) == pytest.approx(0.040)
    assert s.predict(2, 0.0) == pytest.approx(0.040)  # bucket 2 unmeasured: bucket 1's
    assert s.predict(4, 0.0) == pytest.approx(0.070)
    assert s.predict(16, 0.0) == pytest.approx(0.070)


def test_step_meter_is_not_moved_by_one_slow_gap():
    s = StepMeter(min_samples=3)
    for t, v in enumerate((0.070, 0.072, 0.300, 0.071)):
        s.observe(2, v, float(t))
    assert s.predict(2, 4.0) == pytest.approx(0.0715)
    s.observe(4, 0.200, 5.0)  # one slow gap at batch 4: too few to count
    assert s.predict(4, 5.0) == pytest.approx(0.0715)


def test_step_meter_forgets_a_bucket_not_measured_lately():
    s = StepMeter(min_samples=1, max_age_s=20.0)
    s.observe(1, 0.040, 0.0)
    s.observe(2, 0.300, 5.0)  # one slow stretch at batch 2
    s.observe(1, 0.045, 24.0)
    assert s.predict(2, 25.0) == pytest.approx(0.300)  # still recent
    # Refusals kept the batch at 1 since: batch 2's old value no longer counts.
    assert s.predict(2, 25.1) == pytest.approx(0.045)
    assert s.predict(1, 50.0) is None


def test_predicted_ttft_is_work_ahead_plus_own_prompt_over_rate():
    assert predict_ttft_s(900, 100, 200.0) == pytest.approx(5.0)
    assert predict_ttft_s(900, 100, None) is None


def test_admits_when_the_forecast_meets_the_objectives_or_is_unknown():
    assert decide(Forecast(1.9, 0.09), ttft_slo_s=2.0, tpot_slo_s=0.1) is None
    assert decide(Forecast(None, None), ttft_slo_s=0.001, tpot_slo_s=0.001) is None
    assert decide(Forecast(50.0, 5.0), ttft_slo_s=None, tpot_slo_s=None) is None


def test_refuses_a_known_ttft_miss_with_the_excess_as_retry_hint():
    refusal = decide(Forecast(5.0, 0.05), ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert refusal is not None
    assert refusal.reason is Reason.TTFT
    assert refusal.retry_after_s == pytest.approx(3.0)
    assert "predicted time to first token 5.00 s exceeds the request's objective of 2.00 s" in refusal.message


def test_refuses_a_known_tpot_miss():
    refusal = decide(Forecast(1.0, 0.150), ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert refusal is not None and refusal.reason is Reason.TPOT
    assert "150 ms exceeds the request's objective of 100 ms" in refusal.message


def test_tpot_refusal_needs_the_best_case_forecast_to_miss():
    """A median forecast over the objective is admitted while the best case meets it; a
    best case over it is refused, the message giving both."""
    assert decide(Forecast(1.0, 0.095, tpot_best_s=0.085), ttft_slo_s=2.0, tpot_slo_s=0.090) is None
    refusal = decide(Forecast(1.0, 0.110, tpot_best_s=0.092), ttft_slo_s=2.0, tpot_slo_s=0.090)
    assert refusal is not None and refusal.reason is Reason.TPOT
    assert "110 ms (at best 92 ms) exceeds the request's objective of 90 ms" in refusal.message
    alike = decide(Forecast(1.0, 0.110, tpot_best_s=0.110), ttft_slo_s=2.0, tpot_slo_s=0.090)
    assert "token 110 ms exceeds the request's objective of 90 ms" in alike.message


def test_a_refusal_never_prints_the_forecast_equal_to_the_objective():
    # Seen in the short benchmark: "at best 49 ms exceeds the request's objective of 49 ms".
    tpot = decide(Forecast(None, 0.0560, tpot_best_s=0.04921), ttft_slo_s=None, tpot_slo_s=0.04910)
    assert "token 56 ms (at best 49.2 ms) exceeds the request's objective of 49.1 ms" in tpot.message
    alike = decide(Forecast(None, 0.04921), ttft_slo_s=None, tpot_slo_s=0.04910)
    assert "token 49.2 ms exceeds the request's objective of 49.1 ms" in alike.message
    ttft = decide(Forecast(0.2112, None), ttft_slo_s=0.2061, tpot_slo_s=None)
    assert "first token 0.211 s exceeds the request's objective of 0.206 s" in ttft.message
    apart = decide(Forecast(0.2512, None), ttft_slo_s=0.2061, tpot_slo_s=None)
    assert "first token 0.25 s exceeds the request's objective of 0.21 s" in apart.message
    # `pdserve generate --slo-ttft-ms 1` read "0.06 s exceeds the request's objective of 0.00 s".
    assert [figure(v, 2) for v in (2.0, 0.0, 0.001, 0.0042, 0.0001, 0.000001)] == [
        "2.00", "0.00", "0.001", "0.004", "0.0001", "0.00000"]
    tiny = decide(Forecast(0.0612, None), ttft_slo_s=0.001, tpot_slo_s=None)
    assert "first token 0.061 s exceeds the request's objective of 0.001 s" in tiny.message


def test_ratio_quantile_is_the_lower_neighbour_of_recent_ratios():
    from gateway.meters import RatioMeter

    m = RatioMeter(max_age_s=10.0)
    m.observe(0.090, 0.100, 0.0)  # 0.9
    m.observe(0.130, 0.100, 0.0)  # 1.3
    assert m.quantile(0.25, 1.0) == 1.0  # two: not enough
    for measured in (0.080, 0.100, 0.110):
        m.observe(measured, 0.100, 5.0)
    # 0.8, 0.9, 1.0, 1.1, 1.3: index floor(0.25 * 4) = 1.
    assert m.quantile(0.25, 6.0) == pytest.approx(0.9)
    assert m.quantile(0.0, 6.0) == pytest.approx(0.8)
    assert m.ratio(6.0) == pytest.approx(1.0)
    # The first two aged out: 0.8, 1.0, 1.1.
    assert m.quantile(0.25, 12.0) == pytest.approx(0.8)


def test_retry_hint_is_clamped():
    assert decide(Forecast(2.01, None), 2.0, None).retry_after_s == MIN_RETRY_S
    assert decide(Forecast(1000.0, None), 2.0, None).retry_after_s == MAX_RETRY_S


def test_service_meter_rate_is_bounded_by_pending_work_left_unanswered():
    m = ServiceMeter()
    m.start(0.0)
    m.finish(400, 1.0)  # 400 tok/s, measured while the worker had the cores
    m.start(10.0)  # 40 tokens sent: due at 10.1 s at that rate
    assert m.tokens_per_s(10.05, pending_tokens=40) == pytest.approx(400.0)
    # Still unanswered 4 s later: the worker runs at most 40 tokens / 4 s now.
    assert m.tokens_per_s(14.0, pending_tokens=40) == pytest.approx(10.0)
    assert m.tokens_per_s(14.0) == pytest.approx(400.0)  # without pending work: the measured rate
    m.finish(40, 14.0)
    assert m.tokens_per_s(14.0, pending_tokens=0) == pytest.approx(440 / 5.0)


def test_service_meter_reads_at_most_an_abandoned_requests_rate_until_its_next_completion():
    m = ServiceMeter()
    m.start(0.0)
    m.finish(400, 1.0)  # 400 tok/s, with the cores
    m.start(10.0)
    m.abandon(40, 2.0, 12.0)  # taken back unanswered after 2 s: at most 20 tok/s now
    assert m.tokens_per_s(12.0) == pytest.approx(20.0) and m.stalled(12.0)
    assert m.tokens_per_s(12.0 + m.max_age_s + 1) is None  # both aged out
    assert not m.stalled(12.0 + m.max_age_s + 1)
    m.start(20.0)
    m.finish(100, 21.0)  # it answers again: its completions speak for it
    assert m.tokens_per_s(21.0) == pytest.approx(500 / 2.0) and not m.stalled(21.0)


def test_service_meter_remembers_its_rate_alone_past_the_recent_window():
    m = ServiceMeter()
    assert m.alone_tokens_per_s(0.0) is None
    assert m.alone_tokens_per_s(0.0, fallback=300.0) == pytest.approx(300.0)  # none of its own
    m.start(0.0)
    m.finish(800, 1.0)  # 800 tok/s with decode idle
    m.start(5.0, contended=True)
    m.finish(100, 6.0, contended=True)  # 100 tok/s beside decode: not a rate alone
    late = 6.0 + m.max_age_s + 1
    assert m.tokens_per_s(late, contended=False) is None  # aged out
    assert m.alone_tokens_per_s(late, fallback=300.0) == pytest.approx(800.0)
    m.start(late)
    m.abandon(1300, 1.0, late + 1.0)  # taken back after 1 s
    assert m.stalled(late + 1.0) and m.alone_tokens_per_s(late + 1.0) == pytest.approx(800.0)
    m.start(late + 2.0)  # 400 tokens unanswered for 2 s: at most 200 tok/s now
    assert m.alone_tokens_per_s(late + 4.0, pending_tokens=400) == pytest.approx(200.0)


def test_latency_meter_fits_a_fixed_part_and_a_part_per_token():
    from gateway.meters import LatencyMeter

    m = LatencyMeter()
    assert m.fit(0.0) is None
    for tokens, seconds in ((40, 0.20), (80, 0.24), (60, 0.22)):
        m.observe(tokens, seconds, 1.0)
    base, per_token = m.fit(1.0)
    assert (base, per_token) == (pytest.approx(0.16), pytest.approx(0.001))
    assert m.fit(1.0 + m.max_age_s + 1) is None  # aged out


def test_latency_meter_without_a_slope_to_fit_predicts_the_median():
    from gateway.meters import LatencyMeter

    alike, sloping_down, steep = LatencyMeter(), LatencyMeter(), LatencyMeter()
    for seconds in (0.2, 0.3, 0.22):
        alike.observe(40, seconds, 0.0)
    for tokens, seconds in ((40, 0.3), (80, 0.2), (60, 0.26)):
        sloping_down.observe(tokens, seconds, 0.0)
    # A fit through these crosses zero (slope 7.5 ms, intercept -0.2 s): a rate instead,
    # the median of 2.5, 5 and 4.17 ms per token.
    for tokens, seconds in ((40, 0.1), (80, 0.4), (60, 0.25)):
        steep.observe(tokens, seconds, 0.0)
    assert alike.fit(0.0) == (pytest.approx(0.22), 0.0)
    assert sloping_down.fit(0.0) == (pytest.approx(0.26), 0.0)
    assert steep.fit(0.0) == (0.0, pytest.approx(0.25 / 60))


def test_latency_meter_is_not_set_by_one_slow_prefill():
    """The interleaved short compare's first request after 75 s idle: 1.03 s. Alone it is
    no fit (admission would refuse every short prompt on it); among warm ones, the median
    keeps it out."""
    from gateway.meters import LatencyMeter

    m = LatencyMeter()
    m.observe(40, 1.03, 0.0)
    m.observe(30, 0.20, 1.0)
    assert m.fit(1.0) is None
    m.observe(50, 0.22, 2.0)
    m.observe(40, 0.21, 3.0)
    base, per_token = m.fit(3.0)
    assert base + 40 * per_token == pytest.approx(0.21)


def test_the_best_case_quantile_rises_to_the_median_as_recent_requests_miss_tpot():
    assert best_case_quantile(None) == 0.0  # too few judged: the luckiest
    assert best_case_quantile(0.0) == 0.0
    assert best_case_quantile(0.05) == 0.0  # one miss in 20: still the luckiest
    assert best_case_quantile(0.10) == pytest.approx(0.25)
    assert best_case_quantile(0.15) == pytest.approx(0.5)
    assert best_case_quantile(0.60) == 0.5  # never past the median


def test_ratio_meter_counts_recent_misses_among_requests_with_a_tpot_objective():
    from gateway.meters import RatioMeter

    m = RatioMeter(max_age_s=10.0)
    m.observe(0.070, 0.060, 0.0, objective=0.065)  # missed
    m.observe(0.050, 0.060, 0.0)  # no objective: not judged
    m.observe(0.060, 0.060, 1.0, objective=0.065)
    assert m.miss_share(1.0) is None  # two judged: too few
    m.observe(0.064, 0.060, 2.0, objective=0.065)
    m.observe(0.080, 0.060, 3.0, objective=0.065)  # missed
    assert m.miss_share(3.0) == pytest.approx(2 / 4)
    assert m.ratio(3.0) == pytest.approx(0.064 / 0.060)  # the median of all five, judged or not
    assert m.miss_share(10.5) == pytest.approx(1 / 3)  # the first aged out


def test_ratio_meter_forgets_the_misses_from_before_the_worker_drained():
    from gateway.meters import RatioMeter

    m = RatioMeter(max_age_s=60.0)
    for t in (1.0, 2.0, 3.0):
        m.observe(0.090, 0.060, t, objective=0.065)  # an overload's last requests: missed
    assert m.miss_share(3.0) == 1.0
    m.drained(3.0)  # the last of them left the worker
    assert m.miss_share(3.0) is None  # nothing judged since: the luckiest ratio again
    m.observe(0.050, 0.060, 4.0, objective=0.065)
    m.observe(0.060, 0.060, 5.0, objective=0.065)
    m.observe(0.070, 0.060, 6.0, objective=0.065)  # missed
    assert m.miss_share(6.0) == pytest.approx(1 / 3)
    # The ratios themselves are kept: only whether requests missed is forgotten.
    assert m.ratio(6.0) == pytest.approx((0.070 + 0.090) / 2 / 0.060)  # the median of all six
    assert m.quantile(0.0, 6.0) == pytest.approx(0.050 / 0.060)


def test_ratio_meter_is_the_median_of_recent_requests_measured_over_predicted():
    from gateway.meters import RatioMeter

    m = RatioMeter()
    m.observe(0.110, 0.100, 1.0)
    m.observe(0.120, 0.100, 2.0)
    assert m.ratio(2.0) == 1.0  # two samples: not enough to scale anything
    m.observe(0.300, 0.100, 3.0)  # one slow request does not set it
    assert m.ratio(3.0) == pytest.approx(1.2)
    m.observe(0.0, 0.100, 3.0)  # nothing measured: ignored
    assert m.ratio(3.0) == pytest.approx(1.2)
    assert m.ratio(3.0 + m.max_age_s + 2) == 1.0


def test_step_meter_by_default_forgets_a_batch_size_not_run_for_5_s():
    s = StepMeter()
    for t in (0.0, 0.1, 0.2):
        s.observe(2, 0.087, t)  # the first steps after start, slow
        s.observe(1, 0.063, t + 5.5)
    assert s.predict(2, 4.9) == pytest.approx(0.087)
    assert s.predict(2, 5.8) == pytest.approx(0.063)  # refusals kept the batch at 1 since


def test_step_meter_predicts_a_joining_requests_life_as_the_running_ones_leave():
    s = StepMeter(min_samples=1)
    s.observe(1, 0.040, 0.0)
    s.observe(2, 0.060, 0.0)
    s.observe(4, 0.100, 0.0)
    # Alone for 10 steps: 40 ms.
    assert s.predict_life([], 10, 0.0) == pytest.approx(0.040)
    # Two running with 2 and 5 to go, 10 steps: batch 3 (bucket 4, 100 ms) for 2 steps,
    # batch 2 for 3, alone for 5: (0.2 + 0.18 + 0.2) / 10.
    assert s.predict_life([5, 2], 10, 0.0) == pytest.approx(0.058)
    # Running ones that outlive it: batch 3 throughout.
    assert s.predict_life([50, 20], 10, 0.0) == pytest.approx(0.100)
    # Equal remainders leave together: batch 3 for 4 steps, then alone for 4.
    assert s.predict_life([4, 4], 8, 0.0) == pytest.approx((0.4 + 0.16) / 8)
    assert StepMeter().predict_life([3], 10, 0.0) is None


def test_step_meter_life_uses_a_larger_bucket_when_no_smaller_one_is_recent():
    s = StepMeter(min_samples=1)
    s.observe(4, 0.100, 0.0)  # only batches of 3-4 measured (the load kept it there)
    # Alone after 1 step: no bucket 1 or 2 measured, so bucket 4's 100 ms bounds it.
    assert s.predict_life([1, 1], 4, 0.0) == pytest.approx(0.100)
    assert s.predict(1, 0.0) is None


def test_step_meter_life_counts_the_requests_expected_to_join():
    from gateway.meters import Arrivals

    s = StepMeter(min_samples=1)
    for batch, step in ((1, 0.040), (2, 0.060), (4, 0.100), (8, 0.200)):
        s.observe(batch, step, 0.0)
    # Idle worker, 0.09 joins per step, each staying 20 steps: by step j, round(0.09 j)
    # have joined (at most 0.09 * 20 = 1.8 -> 2): batch 1 for steps 0-5, 2 for 6-16, 3
    # (bucket 4) for 17-63.
    life = s.predict_life([], 64, 0.0, Arrivals(per_step=0.09, mean_steps=20))
    assert life == pytest.approx((6 * 0.040 + 11 * 0.060 + 47 * 0.100) / 64)
    assert s.predict_life([], 64, 0.0, Arrivals(0.0, 20)) == pytest.approx(0.040)
    # Sampled at 64 points: 640 steps in strides of 10, the same shape ten times longer.
    assert s.predict_life([], 640, 0.0, Arrivals(0.009, 200)) == pytest.approx(
        (60 * 0.040 + 110 * 0.060 + 470 * 0.100) / 640)


def test_join_meter_gives_joins_per_step_and_their_mean_length_over_its_window():
    from gateway.meters import Arrivals, JoinMeter

    m = JoinMeter(window_s=10.0, min_span_s=2.0)
    assert m.arrivals(0.1, 0.0) is None
    m.observe(16, 0.0)
    assert m.arrivals(0.1, 0.5) == Arrivals(pytest.approx(0.05), 16)  # 1 in (at least) 2 s
    for t, n in ((4.0, 64), (9.0, 40)):
        m.observe(n, t)
    assert m.arrivals(None, 9.0) is None  # no step time to count in
    # 3 joins in the 10 s since the first, at 0.1 s a step: 0.03 per step; mean 40 tokens.
    assert m.arrivals(0.1, 10.0) == Arrivals(pytest.approx(0.03), pytest.approx(40.0))
    # The first has left the window: 2 joins in the 8 s since the next.
    assert m.arrivals(0.1, 12.0) == Arrivals(pytest.approx(0.025), pytest.approx(52.0))
    assert m.arrivals(0.1, 19.5) is None
    # A burst: 6 joins in its first 1.5 s count at 6 / 2 s, not 6 / 10 s.
    burst = JoinMeter(window_s=10.0, min_span_s=2.0)
    for i in range(6):
        burst.observe(40, 100.0 + 0.3 * i)
    assert burst.arrivals(0.1, 101.5).per_step == pytest.approx(0.3)


def test_in_flight_work_is_counted_less_what_the_worker_did_since_it_turned_busy():
    m = ServiceMeter()
    assert m.working_s(5.0) == 0.0  # idle
    m.start(10.0)
    m.start(11.0)  # a second prompt joins the busy time begun at 10
    assert m.working_s(13.0) == 3.0
    m.finish(100, 14.0)
    assert m.working_s(15.5) == 1.5  # the one left has had the cores since the completion
    assert [remaining_tokens(500, 3.0, 100.0), remaining_tokens(500, 6.0, 100.0),
            remaining_tokens(500, 3.0, None)] == [200, 0, 500]
