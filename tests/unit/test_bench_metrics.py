"""Latency, throughput and goodput definitions on synthetic timelines with known answers."""

import pytest

from pdserve.bench.metrics import (
    SLO,
    LatencyStats,
    SweepPoint,
    distserve_goodput,
    percentile,
    run_duration_s,
    summarize,
    summarize_run,
)
from pdserve.bench.record import Chunk, RequestRecord


def make_record(send_s=0.0, chunks=(), done_s=None, output_tokens=None, error=None,
                class_name="default", prompt_len=10) -> RequestRecord:
    """chunks: (time_s, num_tokens) pairs; output_tokens defaults to their sum."""
    chunk_list = [Chunk(t, n) for t, n in chunks]
    if done_s is None and chunk_list:
        done_s = chunk_list[-1].time_s
    return RequestRecord(
        request_id="r", class_name=class_name, priority=0, prompt_len=prompt_len,
        expected_output_len=0, send_s=send_s, chunks=chunk_list, done_s=done_s,
        output_tokens=sum(n for _, n in chunks) if output_tokens is None else output_tokens,
        error=error)


def test_ttft_e2e_tpot_of_one_request():
    # Sent at 1.0, first token at 1.5, 4 more tokens one per 0.25 s, done at 2.5.
    r = make_record(1.0, [(1.5, 1), (1.75, 1), (2.0, 1), (2.25, 1), (2.5, 1)])
    assert r.ttft_s == 0.5
    assert r.e2e_s == 1.5
    assert r.tpot_s == 0.25  # (1.5 - 0.5) / (5 - 1)
    assert r.itls_s() == [0.25, 0.25, 0.25, 0.25]


def test_itl_spreads_a_multi_token_chunk_over_its_tokens():
    r = make_record(0.0, [(1.0, 1), (2.0, 4), (2.5, 1)])
    assert r.itls_s() == [0.25, 0.25, 0.25, 0.25, 0.5]
    assert r.tpot_s == 0.3  # (2.5 - 1.0) / (6 - 1)


def test_tpot_undefined_for_one_token_and_ttft_undefined_without_chunks():
    assert make_record(0.0, [(0.5, 1)]).tpot_s is None
    failed = make_record(0.0, [], done_s=0.1, error="UNAVAILABLE")
    assert failed.ttft_s is None and failed.tpot_s is None and not failed.ok


def test_percentile_interpolates_linearly_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(list(range(101)), 99) == 99.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_stats_of_values_and_of_nothing():
    stats = LatencyStats.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats == LatencyStats(count=5, mean=3.0, p50=3.0, p90=4.6, p99=pytest.approx(4.96))
    assert LatencyStats.of([]) is None


def test_slo_requires_success_and_each_given_bound():
    fast = make_record(0.0, [(0.5, 1), (0.7, 1), (0.9, 1)])  # ttft 0.5, tpot 0.2
    assert SLO().met_by(fast)
    assert SLO(ttft_s=0.5, tpot_s=0.2).met_by(fast)  # bounds are inclusive
    assert not SLO(ttft_s=0.4).met_by(fast)
    assert not SLO(tpot_s=0.19).met_by(fast)
    assert SLO(tpot_s=0.01).met_by(make_record(0.0, [(0.5, 1)]))  # no decode phase
    assert not SLO().met_by(make_record(0.0, [(0.5, 1)], error="CANCELLED"))


def test_summarize_throughput_goodput_attainment_and_errors():
    records = [
        make_record(0.0, [(1.0, 1), (2.0, 1), (3.0, 1)]),  # ttft 1, tpot 1
        make_record(1.0, [(1.5, 1), (2.0, 1), (2.5, 1), (3.0, 1)]),  # ttft 0.5, tpot 0.5
        make_record(2.0, [], done_s=2.5, error="RESOURCE_EXHAUSTED"),
        make_record(3.0, [], done_s=4.0, error="UNAVAILABLE"),
        make_record(3.5, [], done_s=3.6, error="UNAVAILABLE"),
    ]
    assert run_duration_s(records) == 4.0
    s = summarize(records, 4.0, SLO(ttft_s=0.8, tpot_s=0.6))
    assert (s.num_requests, s.num_ok) == (5, 2)
    assert s.errors == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert s.output_tokens == 7 and s.prompt_tokens == 20
    assert s.request_throughput_rps == 0.5
    assert s.output_tok_s == 1.75
    assert s.request_goodput_rps == 0.25  # only the second request meets both SLOs
    assert s.slo_attainment == 0.2  # failures count as misses
    assert s.ttft_s == LatencyStats(2, 0.75, 0.75, 0.95, pytest.approx(0.995))
    assert s.tpot_s.mean == 0.75
    assert s.e2e_s.mean == 2.5  # (3 + 2) / 2
    assert s.itl_s.count == 5  # 2 + 3 gaps


def test_summarize_run_splits_classes_over_the_whole_duration():
    records = [make_record(0.0, [(1.0, 2)], class_name="interactive"),
               make_record(0.0, [(4.0, 2)], class_name="batch")]
    s = summarize_run(records, SLO(ttft_s=2.0))
    assert s.duration_s == 4.0
    assert sorted(s.by_class) == ["batch", "interactive"]
    assert s.by_class["interactive"].request_goodput_rps == 0.25
    assert s.by_class["batch"].request_goodput_rps == 0.0
    assert s.by_class["batch"].output_tok_s == 0.5
    assert summarize_run(records[:1], SLO()).by_class == {}


def test_distserve_goodput_interpolates_at_the_first_miss():
    points = [SweepPoint(1.0, 1.0), SweepPoint(2.0, 0.95), SweepPoint(3.0, 0.75),
              SweepPoint(4.0, 0.92)]
    # Between 2.0 (0.95) and 3.0 (0.75): 2 + (0.95 - 0.9) / 0.2 = 2.25; the late
    # recovery at 4.0 does not count.
    assert distserve_goodput(points) == pytest.approx(2.25)
    assert distserve_goodput(list(reversed(points))) == pytest.approx(2.25)


def test_distserve_goodput_edges():
    assert distserve_goodput([SweepPoint(0.5, 0.8), SweepPoint(1.0, 0.5)]) == 0.0
    assert distserve_goodput([SweepPoint(0.5, 1.0), SweepPoint(1.5, 0.95)]) == 1.5
    assert distserve_goodput([SweepPoint(1.0, 0.9), SweepPoint(2.0, 0.5)]) == 1.0
    assert distserve_goodput([SweepPoint(1.0, 1.0), SweepPoint(2.0, 0.0)], 0.5) == 1.5
    with pytest.raises(ValueError):
        distserve_goodput([])
