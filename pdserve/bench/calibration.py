"""SLOs that fit the machine: derived in the same run from a system's unloaded latencies.

Before any load, `compare` sends each request class of the workload a handful of requests
one at a time (closed loop, concurrency 1) to the reference system, colocated vLLM. Its
medians are what a request costs when nothing else runs; the SLOs are multiples of them:

    TTFT SLO = 3 x unloaded TTFT p50        TPOT SLO = 1.5 x unloaded TPOT p50

per class, so on a fast machine and on a slow one both systems face the same relative bar.
TTFT gets the looser factor because it is one event that a short wait in a queue may
delay; TPOT is a mean over the whole decode and only interference inflates it. The
unloaded mean E2E also gives the search its start: 1 / E2E is the rate at which a server
doing one request at a time would be just saturated.

Pure: records in, numbers out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.bench.metrics import SLO, SLOTable, percentile
from pdserve.bench.record import RequestRecord

TTFT_FACTOR = 3.0
TPOT_FACTOR = 1.5


class CalibrationError(RuntimeError):
    """The unloaded run cannot give SLOs (failed requests, no decode phase)."""


@dataclass(slots=True, frozen=True)
class Unloaded:
    """One class's latencies with nothing else running."""

    num_requests: int
    ttft_p50_s: float
    tpot_p50_s: float
    e2e_p50_s: float


@dataclass(slots=True, frozen=True)
class Calibration:
    source: str  # the system measured unloaded
    unloaded: dict[str, Unloaded]  # by class
    ttft_factor: float = TTFT_FACTOR
    tpot_factor: float = TPOT_FACTOR
    # SLO fields given on the command line, which replace the calibrated ones.
    given: SLO = field(default_factory=SLO)

    def slo_of(self, class_name: str) -> SLO:
        u = self.unloaded[class_name]
        return SLO(self.given.ttft_s if self.given.ttft_s is not None
                   else self.ttft_factor * u.ttft_p50_s,
                   self.given.tpot_s if self.given.tpot_s is not None
                   else self.tpot_factor * u.tpot_p50_s)

    def slos(self) -> SLOTable:
        """One class: its SLO for every record; several: one per class (every class of
        the workload was calibrated, so `default` constrains nothing)."""
        if len(self.unloaded) == 1:
            return SLOTable(default=self.slo_of(next(iter(self.unloaded))))
        return SLOTable(by_class={name: self.slo_of(name) for name in self.unloaded})

    def mean_e2e_s(self, weights: Mapping[str, float]) -> float:
        """Unloaded E2E averaged over the classes by their share of the requests."""
        return sum(w * self.unloaded[name].e2e_p50_s for name, w in weights.items())

    def source_note(self) -> str:
        derived = [name for name, value in (("ttft", self.given.ttft_s),
                                            ("tpot", self.given.tpot_s)) if value is None]
        if not derived:
            return "given on the command line (--slo-ttft-s, --slo-tpot-s)"
        return (f"{' and '.join(derived)} from {self.source}'s unloaded p50 x "
                f"{self.ttft_factor:g} (TTFT) / {self.tpot_factor:g} (TPOT)"
                + ("" if len(derived) == 2 else "; the other given on the command line"))


def unloaded(records: Sequence[RequestRecord]) -> Unloaded:
    """Medians of one class's unloaded records; every one of them must have succeeded."""
    failed = [r for r in records if not r.ok]
    if not records or failed:
        detail = f"{failed[0].error}: {failed[0].error_message}" if failed else "no requests"
        raise CalibrationError(f"unloaded run: {len(failed)} of {len(records)} requests "
                               f"failed ({detail}); the SLOs cannot be derived")
    ttft = [t for r in records if (t := r.ttft_s) is not None]
    tpot = [t for r in records if (t := r.tpot_s) is not None]
    e2e = [t for r in records if (t := r.e2e_s) is not None]
    if not ttft or not tpot:
        raise CalibrationError("unloaded run: no request streamed two tokens or more, so "
                               "there is no TPOT; use outputs of at least 2 tokens")
    return Unloaded(len(records), percentile(ttft, 50), percentile(tpot, 50),
                    percentile(e2e, 50))


def calibrate(records: Sequence[RequestRecord], source: str, given: SLO = SLO(),
              ttft_factor: float = TTFT_FACTOR, tpot_factor: float = TPOT_FACTOR) -> Calibration:
    by_class: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_class.setdefault(r.class_name, []).append(r)
    return Calibration(source, {name: unloaded(rs) for name, rs in sorted(by_class.items())},
                       ttft_factor, tpot_factor, given)
