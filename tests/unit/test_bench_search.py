"""The goodput search against fake systems whose attainment is a known function of rate:
the exact rates visited, the interpolated goodput, and the floor and ceiling."""

import pytest

from pdserve.bench.metrics import SweepPoint
from pdserve.bench.search import (
    RateSearch,
    SearchConfig,
    SearchStatus,
    interpolate,
    round_rate,
)


def run(cfg: SearchConfig, attainment) -> RateSearch:
    """Polls the search to its end, measuring with `attainment(rate)`."""
    search = RateSearch(cfg)
    while (rate := search.next_rate()) is not None:
        search.record(rate, attainment(rate))
    return search


def knee(at: float):
    """All requests meet below `at`, 20% above it: a cliff."""
    return lambda rate: 1.0 if rate < at else 0.2


def test_up_until_a_miss_then_two_geometric_bisections_and_interpolation():
    search = run(SearchConfig(start_rps=0.125, floor_rps=0.0625), knee(0.3))
    assert [p.rate_rps for p in search.points] == [0.125, 0.25, 0.5, 0.354, 0.297]
    outcome = search.outcome()
    assert outcome.status is SearchStatus.FOUND and outcome.bisections_done == 2
    assert outcome.bracket == (SweepPoint(0.297, 1.0), SweepPoint(0.354, 0.2))
    # 0.297 + (1.0 - 0.9) / (1.0 - 0.2) * (0.354 - 0.297)
    assert outcome.goodput_rps == pytest.approx(0.297 + 0.125 * 0.057)
    assert outcome.bound_rps is None and outcome.bound_kind is None


def test_down_from_a_missed_start_to_a_met_floor():
    search = run(SearchConfig(start_rps=0.4, floor_rps=0.1, bisections=1), knee(0.15))
    assert [p.rate_rps for p in search.points] == [0.4, 0.2, 0.1, 0.141]
    outcome = search.outcome()
    assert outcome.status is SearchStatus.FOUND
    # The midpoint of [0.1, 0.2] met (0.141 < 0.15): the bracket is its upper half.
    assert outcome.bracket == (SweepPoint(0.141, 1.0), SweepPoint(0.2, 0.2))
    assert outcome.goodput_rps == pytest.approx(0.141 + 0.125 * 0.059)


def test_a_miss_at_the_floor_is_below_the_floor_not_a_value():
    search = run(SearchConfig(start_rps=0.125, floor_rps=0.0625), knee(0.01))
    assert [p.rate_rps for p in search.points] == [0.125, 0.0625]
    outcome = search.outcome()
    assert outcome.status is SearchStatus.BELOW_FLOOR
    assert outcome.goodput_rps is None
    assert (outcome.bound_kind, outcome.bound_rps) == ("<", 0.0625)


def test_the_floor_is_measured_even_between_steps():
    # 0.3 / 2 = 0.15 > floor 0.1, then max(0.075, 0.1) = the floor itself.
    search = run(SearchConfig(start_rps=0.3, floor_rps=0.1), knee(0.01))
    assert [p.rate_rps for p in search.points] == [0.3, 0.15, 0.1]
    assert search.outcome().status is SearchStatus.BELOW_FLOOR


def test_meeting_at_the_ceiling_is_a_lower_bound():
    cfg = SearchConfig(start_rps=1.0, floor_rps=0.5, max_up_steps=2)
    search = run(cfg, knee(100.0))
    assert [p.rate_rps for p in search.points] == [1.0, 2.0, 4.0] and cfg.ceiling_rps == 4.0
    outcome = search.outcome()
    assert outcome.status is SearchStatus.ABOVE_CEILING
    assert (outcome.bound_kind, outcome.bound_rps, outcome.goodput_rps) == (">=", 4.0, None)


def test_stopped_early_with_a_bracket_still_gives_a_value():
    search = RateSearch(SearchConfig(start_rps=1.0, floor_rps=0.5))
    search.record(1.0, 0.95)
    search.record(2.0, 0.5)
    assert search.next_rate() == 1.41  # a bisection the driver had no time for
    outcome = search.outcome()
    assert outcome.status is SearchStatus.FOUND and outcome.bisections_done == 0
    assert outcome.goodput_rps == pytest.approx(1.0 + (0.05 / 0.45) * 1.0)


def test_stopped_early_without_a_bracket_is_unbracketed():
    search = RateSearch(SearchConfig(start_rps=1.0, floor_rps=0.25))
    search.record(1.0, 0.5)
    assert search.next_rate() == 0.5
    outcome = search.outcome()
    assert outcome.status is SearchStatus.UNBRACKETED
    assert (outcome.bound_kind, outcome.bound_rps, outcome.goodput_rps) == ("<", 1.0, None)
    assert RateSearch(SearchConfig(1.0, 0.5)).outcome().status is SearchStatus.NOT_MEASURED


def test_noisy_attainment_keeps_a_consistent_bracket():
    # Meets at 2, misses at 4; the midpoint 2.83 meets: the bracket moves up, not down.
    values = {1.0: 1.0, 2.0: 0.92, 4.0: 0.1, 2.83: 0.95, 3.36: 0.4}
    search = run(SearchConfig(start_rps=1.0, floor_rps=0.5), values.__getitem__)
    assert [p.rate_rps for p in search.points] == [1.0, 2.0, 4.0, 2.83, 3.36]
    assert search.outcome().bracket == (SweepPoint(2.83, 0.95), SweepPoint(3.36, 0.4))


def test_the_search_refuses_a_rate_it_did_not_ask_for_and_bad_configs():
    search = RateSearch(SearchConfig(start_rps=1.0, floor_rps=0.5))
    with pytest.raises(AssertionError):
        search.record(2.0, 1.0)
    with pytest.raises(ValueError, match="floor"):
        SearchConfig(start_rps=1.0, floor_rps=2.0)
    with pytest.raises(ValueError, match="factor"):
        SearchConfig(start_rps=1.0, floor_rps=0.5, factor=1.0)


def test_rounding_and_interpolation():
    assert [round_rate(x) for x in (0.17677, 1234.5, 0.0625)] == [0.177, 1230.0, 0.0625]
    assert interpolate(SweepPoint(1.0, 1.0), SweepPoint(2.0, 0.8), 0.9) == pytest.approx(1.5)
    with pytest.raises(AssertionError):
        interpolate(SweepPoint(1.0, 0.8), SweepPoint(2.0, 0.7), 0.9)


def test_going_down_only_while_every_rate_missed():
    from pdserve.bench.search import RateSearch, SearchConfig

    search = RateSearch(SearchConfig(start_rps=1.0, floor_rps=0.25, factor=2.0))
    assert not search.going_down  # nothing measured yet
    search.record(1.0, 0.5)
    assert search.going_down and search.next_rate() == 0.5
    search.record(0.5, 0.95)
    assert not search.going_down  # bracketed: the rest narrows it


def test_loans_in_proportion_to_what_each_lender_has_left():
    from pdserve.bench.search import loans_for

    assert loans_for(30.0, [100.0, 50.0]) == [20.0, 10.0]
    assert loans_for(30.0, [100.0, -5.0]) == [30.0, 0.0]  # an overdrawn share lends nothing
    assert loans_for(0.0, [100.0]) == [0.0]
    assert loans_for(30.0, [20.0, 9.0]) is None  # 29 s in all: not enough
