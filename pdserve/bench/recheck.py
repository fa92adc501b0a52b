"""The unloaded run again at the end of a compare (`compare.recheck_on`): how far the
machine's speed moved while the systems were measured against objectives set at the start.

- `describe_recheck`: the log's lines, the end's p50s over the start's per class;
- `recheck_dict`: the JSON's `slo.recheck`, with every measured rate judged again by the
  objectives the end's run would set (`rejudged_goodput`);
- `format_recheck`: its lines in the compare's table.

Pure: results in, dicts and text out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.bench.calibration import Calibration
from pdserve.bench.metrics import DISTSERVE_TARGET, SweepPoint, distserve_goodput, summarize_run

if TYPE_CHECKING:  # compare imports this module; the type is only an annotation here
    from pdserve.bench.compare import CompareResult


def describe_recheck(start: Calibration, end: Calibration) -> list[str]:
    """One line per class: the end's unloaded p50s as multiples of the start's, and the
    objectives the end's would have set."""
    lines = []
    slos = end.slos()
    for name, e in end.unloaded.items():
        s, slo = start.unloaded[name], slos.of(name)
        lines.append(f"unloaded '{name}' again at the end on {end.source}: TTFT p50 "
                     f"{e.ttft_p50_s:.3f} s ({e.ttft_p50_s / s.ttft_p50_s:.2f}x the start's "
                     f"{s.ttft_p50_s:.3f} s), TPOT p50 {e.tpot_p50_s * 1000:.1f} ms "
                     f"({e.tpot_p50_s / s.tpot_p50_s:.2f}x the start's {s.tpot_p50_s * 1000:.1f} ms)"
                     f"; its SLOs would be TTFT {slo.ttft_s:.3f} s, TPOT {slo.tpot_s * 1000:.1f} ms")
    return lines


def rejudged_goodput(points: Sequence[SweepPoint], target: float = DISTSERVE_TARGET) -> dict:
    """Goodput from measured points alone (`distserve_goodput`, walking up from the lowest
    rate): a value where a rate that met ``target`` lies below the first that missed it;
    else a bound, below the lowest rate when that one missed (whatever higher rates did:
    seen in a mixed recheck, 85.0% at 0.167 req/s and 90.0% at 0.333), or at least the
    highest when none missed."""
    ordered = sorted(points, key=lambda p: p.rate_rps)
    if not ordered:
        return {"goodput_rps": None, "bound_kind": None, "bound_rps": None}
    if ordered[0].slo_attainment < target:
        return {"goodput_rps": None, "bound_kind": "<", "bound_rps": ordered[0].rate_rps}
    if all(p.slo_attainment >= target for p in ordered):
        return {"goodput_rps": None, "bound_kind": ">=", "bound_rps": ordered[-1].rate_rps}
    return {"goodput_rps": distserve_goodput(ordered, target), "bound_kind": None, "bound_rps": None}


def recheck_dict(result: CompareResult) -> dict | None:
    """The unloaded run again at the end (`compare.recheck_on`): its p50s over the start's,
    the objectives it would have set, and every measured rate judged again by those."""
    start, end = result.calibration, result.recheck
    if start is None or end is None:
        return None if result.recheck_note is None else {"note": result.recheck_note}
    slos = end.slos()
    systems = {}
    for name, system in result.systems.items():
        points = [SweepPoint(r.load.rate_rps, summarize_run(r.records, slos).slo_attainment)
                  for r in sorted(system.runs, key=lambda r: r.load.rate_rps)]
        systems[name] = {"measurements": [dataclasses.asdict(p) for p in points],
                         "goodput": rejudged_goodput(points)}
    pd, vl = systems.get("pdserve", {}).get("goodput"), systems.get("vllm", {}).get("goodput")
    ratio = (pd["goodput_rps"] / vl["goodput_rps"]
             if pd and vl and pd["goodput_rps"] and vl["goodput_rps"] else None)
    return {
        "derived_from": end.source,
        "lengths": "the unloaded run's, with other token ids",
        "unloaded_p50": {name: dataclasses.asdict(u) for name, u in end.unloaded.items()},
        "over_start": {name: {"ttft_p50": u.ttft_p50_s / start.unloaded[name].ttft_p50_s,
                              "tpot_p50": u.tpot_p50_s / start.unloaded[name].tpot_p50_s,
                              "e2e_p50": u.e2e_p50_s / start.unloaded[name].e2e_p50_s}
                       for name, u in end.unloaded.items()},
        "by_class": {name: dataclasses.asdict(end.slo_of(name)) for name in end.unloaded},
        "judged_by_these_slos": systems,
        "goodput_ratio_by_these_slos": ratio,
        "judged_note": "each measured rate's records judged again by the objectives the end's "
                       "unloaded run would set; pdserve's gateway admitted and placed them by "
                       "the start's, so its figures here are not what it would measure under these",
    }


def format_recheck(recheck: dict | None) -> list[str]:
    if recheck is None:
        return []
    if "note" in recheck:
        return [f"unloaded run again at the end: {recheck['note']}"]
    lines = [f"unloaded run again at the end on {recheck['derived_from']}:"]
    for name, over in recheck["over_start"].items():
        slo = recheck["by_class"][name]
        lines.append(f"  {name}: TTFT p50 {over['ttft_p50']:.2f}x, TPOT p50 {over['tpot_p50']:.2f}x "
                     f"the start's; its SLOs: TTFT {slo['ttft_s']:.3g} s, TPOT "
                     f"{slo['tpot_s'] * 1000:.3g} ms")
    for name, judged in recheck["judged_by_these_slos"].items():
        g = judged["goodput"]
        value = (f"{g['goodput_rps']:.3g} req/s" if g["goodput_rps"] is not None
                 else "-" if g["bound_kind"] is None else f"{g['bound_kind']} {g['bound_rps']:g} req/s")
        lines.append(f"  {name} judged by them: " + ", ".join(
            f"{m['slo_attainment']:.1%} at {m['rate_rps']:g}" for m in judged["measurements"])
            + f"; goodput {value}")
    if recheck["goodput_ratio_by_these_slos"] is not None:
        lines.append(f"  goodput ratio pdserve / vllm judged by them: "
                     f"{recheck['goodput_ratio_by_these_slos']:.3g} (pdserve admitted by the start's)")
    return lines
