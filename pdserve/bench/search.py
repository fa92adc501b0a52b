"""Finding a system's goodput: the highest request rate at which >= 90% of requests meet
their SLOs, measured rather than read off a fixed list of rates.

`RateSearch` is a state machine the driver polls: `next_rate()` names the rate to measure
(None when the search is over), `record(rate, attainment)` feeds the measurement back, and
`outcome()` says what is known at any point (the driver may stop early for its time budget).

1. Start: measure `start_rps`.
2. Expand: after a rate that met the target, measure `factor` times it (at most
   `max_up_steps` times; meeting the target at the last one ends the search "above the
   ceiling"); after a rate that missed with nothing met yet, measure it / `factor`, never
   below `floor_rps`. Missing at the floor ends the search: goodput "below the floor".
3. Narrow: with a bracket (lo met, hi missed, nothing measured between them) measure its
   geometric midpoint `bisections` times, keeping the half where attainment crosses the
   target. Geometric because rates are explored by factors: 0.125 and 0.25 give 0.177.
4. Interpolate: goodput = lo + (att_lo - target) / (att_lo - att_hi) * (hi - lo), DistServe's
   linear rule on the final bracket.

Rates are rounded to 3 significant digits, so the JSON and the progress lines show rates a
person can type back with `bench run --rate`. Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pdserve.bench.metrics import DISTSERVE_TARGET, SweepPoint


class SearchStatus(enum.Enum):
    FOUND = "found"  # a bracket: goodput_rps is a value
    BELOW_FLOOR = "below_floor"  # missed at the floor: goodput < floor_rps
    ABOVE_CEILING = "above_ceiling"  # met at the highest rate allowed: goodput >= it
    UNBRACKETED = "unbracketed"  # stopped (time budget) before a bracket or a limit
    NOT_MEASURED = "not_measured"


def round_rate(rate: float) -> float:
    return float(f"{rate:.3g}")


@dataclass(slots=True, frozen=True)
class SearchConfig:
    start_rps: float
    floor_rps: float
    factor: float = 2.0
    bisections: int = 2
    max_up_steps: int = 5
    target: float = DISTSERVE_TARGET

    def __post_init__(self) -> None:
        if not 0 < self.floor_rps <= self.start_rps:
            raise ValueError(f"need 0 < floor rate <= start rate, got floor {self.floor_rps} "
                             f"and start {self.start_rps}")
        if self.factor <= 1:
            raise ValueError(f"the rate step factor must be > 1, got {self.factor}")
        if self.bisections < 0 or self.max_up_steps < 0:
            raise ValueError("bisections and max up steps must be >= 0")

    @property
    def ceiling_rps(self) -> float:
        rate = round_rate(self.start_rps)
        for _ in range(self.max_up_steps):
            rate = round_rate(rate * self.factor)
        return rate


@dataclass(slots=True, frozen=True)
class SearchOutcome:
    status: SearchStatus
    # FOUND: the interpolated goodput; otherwise None: no value was measured.
    goodput_rps: float | None
    # BELOW_FLOOR / UNBRACKETED after misses only: goodput < bound_rps; ABOVE_CEILING /
    # UNBRACKETED after meets only: goodput >= bound_rps. None for FOUND.
    bound_rps: float | None
    # "<" (only misses measured) or ">=" (only meets): which side of bound_rps goodput is on.
    bound_kind: str | None
    bracket: tuple[SweepPoint, SweepPoint] | None  # (lo met, hi missed)
    points: tuple[SweepPoint, ...]  # in the order measured
    bisections_done: int


def interpolate(lo: SweepPoint, hi: SweepPoint, target: float) -> float:
    """The rate where attainment crosses `target` on the line through lo and hi."""
    assert lo.slo_attainment >= target > hi.slo_attainment, (lo, hi)
    fraction = (lo.slo_attainment - target) / (lo.slo_attainment - hi.slo_attainment)
    return lo.rate_rps + fraction * (hi.rate_rps - lo.rate_rps)


class RateSearch:
    def __init__(self, cfg: SearchConfig) -> None:
        self.cfg = cfg
        self._points: list[SweepPoint] = []
        self._lo: SweepPoint | None = None  # highest rate that met the target
        self._hi: SweepPoint | None = None  # lowest rate that missed it
        self._up_steps = 0
        self._bisections = 0
        self._next: float | None = round_rate(cfg.start_rps)
        self._next_is_bisection = False

    @property
    def points(self) -> tuple[SweepPoint, ...]:
        return tuple(self._points)

    def next_rate(self) -> float | None:
        return self._next

    @property
    def going_down(self) -> bool:
        """Every rate so far missed: the next one steps toward the floor, and without it the
        search ends with no value and no floor bound ("unbracketed")."""
        return self._lo is None and self._hi is not None

    def record(self, rate_rps: float, attainment: float) -> None:
        assert rate_rps == self._next, f"measured {rate_rps}, the search asked for {self._next}"
        point = SweepPoint(rate_rps, attainment)
        self._points.append(point)
        self._bisections += self._next_is_bisection
        if attainment >= self.cfg.target:
            self._lo = point
        else:
            self._hi = point
        self._next, self._next_is_bisection = self._choose_next(), False
        if self._lo is not None and self._hi is not None and self._next is not None:
            self._next_is_bisection = True

    def _choose_next(self) -> float | None:
        lo, hi, cfg = self._lo, self._hi, self.cfg
        if hi is None:  # everything met so far: go up
            assert lo is not None
            if self._up_steps >= cfg.max_up_steps:
                return None
            self._up_steps += 1
            return round_rate(lo.rate_rps * cfg.factor)
        if lo is None:  # everything missed so far: go down to the floor
            floor = round_rate(cfg.floor_rps)
            return None if hi.rate_rps <= floor else max(round_rate(hi.rate_rps / cfg.factor),
                                                          floor)
        if self._bisections >= cfg.bisections:
            return None
        mid = round_rate(math.sqrt(lo.rate_rps * hi.rate_rps))
        # Rounding can land on an end of a narrow bracket: nothing new to learn there.
        return mid if lo.rate_rps < mid < hi.rate_rps else None

    def outcome(self) -> SearchOutcome:
        lo, hi, cfg = self._lo, self._hi, self.cfg
        points = tuple(self._points)
        if lo is not None and hi is not None:
            return SearchOutcome(SearchStatus.FOUND, interpolate(lo, hi, cfg.target), None,
                                 None, (lo, hi), points, self._bisections)
        if hi is not None:
            status = (SearchStatus.BELOW_FLOOR if hi.rate_rps <= round_rate(cfg.floor_rps)
                      else SearchStatus.UNBRACKETED)
            return SearchOutcome(status, None, hi.rate_rps, "<", None, points, 0)
        if lo is not None:
            status = (SearchStatus.ABOVE_CEILING if self._next is None
                      else SearchStatus.UNBRACKETED)
            return SearchOutcome(status, None, lo.rate_rps, ">=", None, points, 0)
        return SearchOutcome(SearchStatus.NOT_MEASURED, None, None, None, None, points, 0)


def loans_for(needed_s: float, lenders_left_s: list[float]) -> list[float] | None:
    """What each lender gives so that a search going down can measure its next rate (or
    pdserve its policy rate, `interleave.borrow`).

    In an interleaved compare each system has an equal share of the time. A system that
    missed at its first rate needs a lower one to report anything at all, while a system
    that met goes on refining upward; the downward step comes first: the others' unspent
    shares lend ``needed_s`` (the measurement's cost beyond the borrower's own time left),
    each in proportion to what it has left. None when all they have left would not cover it
    (the search then stops, as before).
    """
    available = [max(left, 0.0) for left in lenders_left_s]
    total = sum(available)
    if needed_s <= 0:
        return [0.0] * len(available)
    if total < needed_s:
        return None
    return [needed_s * left / total for left in available]
