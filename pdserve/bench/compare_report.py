"""What `compare` reports: the JSON document and the table, from its results alone.

- Each system: its goodput as the search found it (a value, or a bound with its reason:
  below the floor, above the ceiling, unbracketed when the time budget ran out), and every
  rate it measured with attainment, throughput and latencies overall and per class.
- `ratios`: pdserve / vLLM (`ratios_pdserve-NAME`: the same for each variant). Goodput
  as a value when both were found, else as the interval the two systems' goodput
  intervals allow (e.g. vLLM below the floor F: the ratio is at least pdserve's goodput /
  F, reported as `goodput_rps_lower_bound`). Throughput and latencies at one rate both
  systems were measured at: the highest such rate.
- `ab_pdserve-NAME` (a variant and pdserve both ran): the variant against pdserve at each
  rate both measured, request by request on the same requests: how many met their
  objectives under each, and how many only under one of them.
- `others_idle_cores` per measurement (interleaved): the cores each idle system used while
  it ran; `config.mode` and `config.measured_in_order` say how the systems took turns.
- `slo.recheck`: the unloaded run again at the end (interleaved), its p50s over the start's,
  the objectives it would have set, and each system's rates judged again by them.
- `policy` (when pdserve and pdserve-fifo both ran): the interactive class at the first
  rate where fifo's interactive attainment fell below 90%, under each policy, and
  (`by_rate`) at every rate both measured.

Pure: dataclasses in, dicts and text out.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from pdserve.bench.metrics import DISTSERVE_TARGET, LatencyStats, Objective, Summary
from pdserve.bench.presets import INTERACTIVE
from pdserve.bench.record import RequestRecord
from pdserve.bench.recheck import format_recheck, recheck_dict
from pdserve.bench.report import jsonable
from pdserve.bench.runner import RunResult
from pdserve.bench.search import SearchOutcome, SearchStatus
from pdserve.bench.variants import REPO_ROOT, VARIANT_PREFIX, git_commit

if TYPE_CHECKING:  # compare imports this module; the types are only annotations here
    from pdserve.bench.compare import CompareConfig, CompareResult, SystemResult

# The detail's unloaded runs, at the start and at the end (`detail_dict`).
UNLOADED_DETAIL = ("unloaded", "unloaded_again")
AT_RATE_KEYS = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def _stat(stats: LatencyStats | None, q: str) -> float | None:
    return None if stats is None else getattr(stats, q)


def class_entry(s: Summary) -> dict:
    return {"num_requests": s.num_requests, "num_ok": s.num_ok, "errors": s.errors,
            "slo_attainment": s.slo_attainment,
            **{f"{name}_{q}_s": _stat(getattr(s, f"{name}_s"), q)
               for name in ("ttft", "tpot") for q in ("p50", "p90", "p99")}}


def sweep_entry(run: RunResult) -> dict:
    s = run.summary
    return {
        "rate_rps": run.load.rate_rps,
        **class_entry(s),
        "request_goodput_rps": s.request_goodput_rps,
        "request_throughput_rps": s.request_throughput_rps,
        "output_tok_s": s.output_tok_s,
        "duration_s": s.duration_s,
        **{f"{name}_{q}_s": _stat(getattr(s, f"{name}_s"), q)
           for name in ("itl", "e2e") for q in ("p50", "p99")},
        "by_class": {name: class_entry(c) for name, c in s.by_class.items()},
        "gateway_cpu": None if run.gateway_cpu is None else dataclasses.asdict(run.gateway_cpu),
        "machine": None if run.machine is None else dataclasses.asdict(run.machine),
    }


def interactive_attainment(run: RunResult) -> float | None:
    c = run.summary.by_class.get(INTERACTIVE)
    return None if c is None else c.slo_attainment


def policy_rate(runs: Sequence[RunResult]) -> float | None:
    """The lowest measured rate at which the interactive class's attainment was < 90%."""
    missed = [r.load.rate_rps for r in runs
              if (a := interactive_attainment(r)) is not None and a < DISTSERVE_TARGET]
    return min(missed, default=None)


# ---------------------------------------------------------------- goodput ----------------


def goodput_interval(outcome: SearchOutcome | None) -> tuple[float, float] | None:
    """[low, high] the goodput lies in: one point when found, else what the bound allows."""
    if outcome is None or outcome.status is SearchStatus.NOT_MEASURED:
        return None
    if outcome.goodput_rps is not None:
        return outcome.goodput_rps, outcome.goodput_rps
    assert outcome.bound_rps is not None
    return (0.0, outcome.bound_rps) if outcome.bound_kind == "<" else (outcome.bound_rps,
                                                                      math.inf)


def goodput_dict(outcome: SearchOutcome) -> dict:
    return {
        "status": outcome.status.value,
        "goodput_rps": outcome.goodput_rps,
        # Only when there is no value: goodput `bound_kind` bound_rps.
        "bound_rps": outcome.bound_rps,
        "bound_kind": outcome.bound_kind,
        "bracket": None if outcome.bracket is None else [dataclasses.asdict(p)
                                                         for p in outcome.bracket],
        "bisections_done": outcome.bisections_done,
        "rates_in_order": [p.rate_rps for p in outcome.points],
    }


def goodput_ratio(pd: SearchOutcome | None, vl: SearchOutcome | None,
                  names: tuple[str, str] = ("pdserve", "vllm")) -> dict:
    """pdserve / vLLM goodput (or ``names``' first over its second): a value, or the bounds
    the two intervals give, labelled."""
    a, b = goodput_interval(pd), goodput_interval(vl)
    out: dict = {"goodput_rps": None, "goodput_rps_lower_bound": None,
                 "goodput_rps_upper_bound": None}
    if a is None or b is None:
        out["goodput_note"] = "a system has no goodput (failed or not measured)"
        return out
    low = a[0] / b[1] if b[1] > 0 else None
    high = a[1] / b[0] if b[0] > 0 else math.inf
    if a[0] == a[1] and b[0] == b[1] and b[0] > 0:
        out["goodput_rps"] = a[0] / b[0]
        out["goodput_note"] = "both found"
        return out
    out["goodput_rps_lower_bound"] = low or None
    out["goodput_rps_upper_bound"] = None if math.isinf(high) else high
    out["goodput_note"] = f"bounds only: {names[0]} {describe(pd)}, {names[1]} {describe(vl)}"
    return out


def describe(outcome: SearchOutcome | None) -> str:
    if outcome is None:
        return "not measured"
    if outcome.goodput_rps is not None:
        return f"{outcome.goodput_rps:.3g} req/s"
    return f"{outcome.status.value} ({outcome.bound_kind} {outcome.bound_rps:g} req/s)"


# ---------------------------------------------------------------- per rate ---------------


def common_rate(a: dict, b: dict) -> float | None:
    rates = ({e["rate_rps"] for e in a.get("measurements", [])}
             & {e["rate_rps"] for e in b.get("measurements", [])})
    return max(rates, default=None)


def at_rate(system: dict, rate: float) -> dict:
    return next(e for e in system["measurements"] if e["rate_rps"] == rate)


def variant_names(names) -> list[str]:
    """The variants (pdserve-NAME, not pdserve-fifo) among system names, in their order."""
    return [n for n in names if n.startswith(VARIANT_PREFIX) and n != "pdserve-fifo"]


def ratio_keys(names) -> list[tuple[str, str]]:
    """Each pdserve system measured against vLLM: the JSON key of its ratios, and the system."""
    return [("ratios", "pdserve"), *((f"ratios_{n}", n) for n in variant_names(names))]


def ab_dict(variant: SystemResult, base: SystemResult, slos: Objective) -> dict:
    """A variant against pdserve (``base``), at each rate both measured: the same requests
    (same seeded lengths, schedule and prompts), each judged by its class's objectives
    under both. `only_variant` / `only_base`: requests met under one and not the other;
    their difference is the attainment difference, and their sum says how much of it is
    the same requests moving (little) or churn (much: noise)."""
    out: dict = {"against": base.name,
                 "goodput": goodput_ratio(variant.search, base.search, (variant.name, base.name)),
                 "rates": []}
    for run in variant.runs:
        other = next((r for r in base.runs if r.load.rate_rps == run.load.rate_rps), None)
        if other is None:
            continue
        theirs = {r.request_id: r for r in other.records}
        pairs = [(r, theirs[r.request_id]) for r in run.records if r.request_id in theirs]
        met = [(slos.met_by(v), slos.met_by(b)) for v, b in pairs]
        by_class: dict[str, list[int]] = {}
        for (v, _), (mv, mb) in zip(pairs, met):
            counts = by_class.setdefault(v.class_name, [0, 0, 0])
            counts[0] += 1
            counts[1] += mv
            counts[2] += mb
        out["rates"].append({
            "rate_rps": run.load.rate_rps, "num_paired": len(pairs),
            "met_variant": sum(mv for mv, _ in met), "met_base": sum(mb for _, mb in met),
            "only_variant": sum(mv and not mb for mv, mb in met),
            "only_base": sum(mb and not mv for mv, mb in met),
            "by_class": {name: {"num_paired": n, "met_variant": a, "met_base": b}
                         for name, (n, a, b) in by_class.items()},
        })
    return out


def ratios(pd: dict, vl: dict, pd_outcome: SearchOutcome | None,
           vl_outcome: SearchOutcome | None) -> dict:
    out = goodput_ratio(pd_outcome, vl_outcome)
    rate = common_rate(pd, vl)
    out["at_rate_rps"] = rate
    out["at_rate_rule"] = "the highest rate both systems were measured at"
    for key in AT_RATE_KEYS:
        x = None if rate is None else at_rate(pd, rate)[key]
        y = None if rate is None else at_rate(vl, rate)[key]
        out[key] = None if x is None or not y else x / y
    return out


def policy_by_rate(fifo: SystemResult, slo: SystemResult) -> list[dict]:
    """The interactive class under each policy at every rate both measured, lowest first.
    Attainment cannot pass 100%, so slo can lead fifo by 30 points only where fifo is at or
    below 70%: the rate where fifo just crosses 90% alone cannot show such a lead."""
    slo_runs = {r.load.rate_rps: r for r in slo.runs}
    rows = []
    for f_run in sorted(fifo.runs, key=lambda r: r.load.rate_rps):
        s_run = slo_runs.get(f_run.load.rate_rps)
        f = interactive_attainment(f_run)
        s = None if s_run is None else interactive_attainment(s_run)
        if f is not None and s is not None:
            rows.append({"rate_rps": f_run.load.rate_rps, "fifo_attainment": f, "slo_attainment": s,
                         "slo_minus_fifo_points": 100 * (s - f)})
    return rows


def policy_dict(fifo: SystemResult, slo: SystemResult, unloaded_ttft_p50_s: float | None) -> dict:
    rate = policy_rate(fifo.runs)
    out: dict = {"class": INTERACTIVE, "rate_rps": rate,
                 "rate_rule": "the lowest rate where pdserve-fifo's interactive SLO "
                              "attainment was < 90%",
                 "by_rate": policy_by_rate(fifo, slo)}
    if rate is None:
        out["note"] = "pdserve-fifo met 90% for the interactive class at every rate measured"
        return out
    fifo_run = next(r for r in fifo.runs if r.load.rate_rps == rate)
    slo_run = next((r for r in slo.runs if r.load.rate_rps == rate), None)
    if slo_run is None:
        out["note"] = "pdserve (slo) was not measured at that rate"
        return out
    f, s = (run.summary.by_class[INTERACTIVE] for run in (fifo_run, slo_run))
    out.update({
        "fifo_attainment": f.slo_attainment, "slo_attainment": s.slo_attainment,
        "slo_minus_fifo_points": 100 * (s.slo_attainment - f.slo_attainment),
        "fifo_ttft_p90_s": _stat(f.ttft_s, "p90"), "slo_ttft_p90_s": _stat(s.ttft_s, "p90"),
        "unloaded_ttft_p50_s": unloaded_ttft_p50_s,
    })
    if s.ttft_s is not None and unloaded_ttft_p50_s:
        out["slo_ttft_p90_over_unloaded_p50"] = s.ttft_s.p90 / unloaded_ttft_p50_s
    return out


# ---------------------------------------------------------------- the document -----------


def system_dict(system: SystemResult) -> dict:
    return {
        "command": system.command, "env": system.env, "boot_s": system.boot_s,
        "engines_of": system.engines_of, "error": system.error,
        "goodput": None if system.search is None else goodput_dict(system.search),
        "stopped_by_budget": system.stopped_by_budget,
        "skipped_rates": system.skipped_rates,
        "measurements": [
            {**sweep_entry(r), **({"others_idle_cores": system.others_idle_cores[i]}
                                  if i < len(system.others_idle_cores) else {})}
            for i, r in enumerate(system.runs)],
    }


def slo_dict(result: CompareResult) -> dict | None:
    c = result.calibration
    if c is None:
        return None
    return {"source": c.source_note(), "derived_from": c.source,
            "ttft_factor": c.ttft_factor, "tpot_factor": c.tpot_factor,
            "unloaded_p50": {name: dataclasses.asdict(u) for name, u in c.unloaded.items()},
            "by_class": {name: dataclasses.asdict(c.slo_of(name)) for name in c.unloaded}}


def compare_dict(cfg: CompareConfig, result: CompareResult) -> dict:
    out: dict = {name: system_dict(s) for name, s in result.systems.items()}
    out["slo"] = slo_dict(result)
    if out["slo"] is not None:
        out["slo"]["recheck"] = recheck_dict(result)
    c = result.calibration
    for key, pd in ratio_keys(result.systems):
        if pd in out and "vllm" in out:
            out[key] = ratios(out[pd], out["vllm"], result.systems[pd].search,
                              result.systems["vllm"].search)
    if "pdserve" in result.systems and c is not None:
        for name in variant_names(result.systems):
            out[f"ab_{name}"] = ab_dict(result.systems[name], result.systems["pdserve"], c.slos())
    if cfg.variants:
        out["variants"] = {v.system: v.describe() for v in cfg.variants}
    if "pdserve" in result.systems and "pdserve-fifo" in result.systems:
        unloaded = c.unloaded.get(INTERACTIVE) if c is not None else None
        out["policy"] = policy_dict(result.systems["pdserve-fifo"], result.systems["pdserve"],
                                    unloaded.ttft_p50_s if unloaded is not None else None)
    bench, search = cfg.bench, result.search
    out["config"] = {
        "model": str(cfg.model), "workload_name": cfg.workload_name,
        "workload": jsonable(dataclasses.asdict(bench.workload)),
        "num_requests_per_rate": bench.num_requests, "min_duration_s": cfg.min_duration_s,
        "requests_at_a_rate": "max(num_requests_per_rate, ceil(rate x min_duration_s))",
        "burstiness": bench.burstiness,
        "warmup": bench.warmup, "seed": bench.seed,
        "sampling": dataclasses.asdict(bench.sampling),
        "calibration_requests_per_class": cfg.plan.calibration_requests,
        "calibration_lengths": "each class's length quantiles (i + 0.5) / n, where it has "
                               "one range of lengths; else drawn at random",
        "recheck": cfg.recheck,
        "search": None if search is None else {
            **dataclasses.asdict(search), "ceiling_rps": search.ceiling_rps,
            "start_rule": "given" if cfg.plan.start_rps else "1 / unloaded mean E2E p50",
            "floor_rule": "given" if cfg.plan.floor_rps else "start / factor"},
        "goodput": "highest rate with >= 90% of requests meeting their class's SLOs, "
                   "interpolated in the final bracket",
        "mode": result.mode, "mode_reason": result.mode_reason,
        "idle_systems": (("frozen" if cfg.freeze_idle else "running")
                         if result.mode == "interleaved" else None),
        "measured_in_order": [[name, rate] for name, rate in result.measured_in_order],
        "budget_s": cfg.plan.budget_s, "elapsed_s": result.elapsed_s,
        "cpu_count": os.cpu_count(),
        "commit": git_commit(REPO_ROOT),  # of the checkout pdserve (and the harness) ran from
    }
    return out


def detail_dict(result: CompareResult) -> dict:
    """Every request's timeline (`--save-records`): the unloaded run (and its recheck at
    the end) and each rate."""
    return {"unloaded": [dataclasses.asdict(r) for r in result.unloaded_records],
            **({"unloaded_again": [dataclasses.asdict(r) for r in result.recheck_records]}
               if result.recheck_records else {}),
            **{name: [{"rate_rps": r.load.rate_rps,
                       "records": [dataclasses.asdict(x) for x in r.records]} for r in s.runs]
               for name, s in result.systems.items()}}


def saved_runs(detail: dict) -> Iterator[tuple[str, float, list[RequestRecord]]]:
    """Each system's measured rates from a `detail_dict` read back (a compare JSON's
    "detail"): (system, rate, records); the unloaded runs have no rate and are left out."""
    for name, runs in detail.items():
        if name in UNLOADED_DETAIL:
            continue
        for run in runs:
            yield name, run["rate_rps"], [RequestRecord.from_dict(r) for r in run["records"]]


# ---------------------------------------------------------------- table ------------------


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".3g") -> str:
    return "-" if value is None else format(value * scale, spec)


def format_compare(doc: dict) -> str:
    parts = []
    if doc.get("slo"):
        lines = [f"SLOs: {doc['slo']['source']}"]
        for name, slo in doc["slo"]["by_class"].items():
            lines.append(f"  {name}: TTFT {_fmt(slo['ttft_s'])} s, TPOT "
                         f"{_fmt(slo['tpot_s'], 1000)} ms")
        lines.extend(format_recheck(doc["slo"].get("recheck")))
        parts.append("\n".join(lines))
    for name in (n for n, v in doc.items() if isinstance(v, dict) and "measurements" in v):
        system = doc[name]
        rows = [f"######## {name} ########"]
        if system["error"]:
            rows.append(f"failed: {system['error']}")
        rows.append(f"{'rate':>7} {'attain':>7} {'tok/s':>7} {'TTFT50':>7} {'TTFT99':>7} "
                    f"{'TPOT50':>7} {'TPOT99':>7}  (s, ms)")
        for e in sorted(system["measurements"], key=lambda e: e["rate_rps"]):
            rows.append(f"{e['rate_rps']:>7g} {e['slo_attainment']:>7.1%} "
                        f"{_fmt(e['output_tok_s'], 1, '.1f'):>7} {_fmt(e['ttft_p50_s']):>7} "
                        f"{_fmt(e['ttft_p99_s']):>7} {_fmt(e['tpot_p50_s'], 1000, '.1f'):>7} "
                        f"{_fmt(e['tpot_p99_s'], 1000, '.1f'):>7}")
            for cname, c in e["by_class"].items():
                rows.append(f"{'':>7} {c['slo_attainment']:>7.1%} {cname}: TTFT p90 "
                            f"{_fmt(c['ttft_p90_s'])} s")
        g = system["goodput"]
        if g is not None:
            value = (f"{g['goodput_rps']:.3g} req/s" if g["goodput_rps"] is not None
                     else f"{g['bound_kind']} {g['bound_rps']:g} req/s ({g['status']})")
            rows.append(f"goodput: {value}")
        parts.append("\n".join(rows))
    for key, pd in ratio_keys(doc):
        if key not in doc:
            continue
        r = doc[key]
        if r["goodput_rps"] is not None:
            line = f"goodput ratio {pd} / vllm: {r['goodput_rps']:.3g}"
        else:
            bounds = [f"{op} {r[k]:.3g}" for op, k in
                      ((">=", "goodput_rps_lower_bound"), ("<=", "goodput_rps_upper_bound"))
                      if r[k] is not None]
            line = (f"goodput ratio {pd} / vllm: {', '.join(bounds) or 'unknown'} "
                    f"({r['goodput_note']})")
        at = r["at_rate_rps"]
        parts.append(line + f"\nat {_fmt(at, 1, 'g')} req/s (" + r["at_rate_rule"] + "): "
                     + ", ".join(f"{k} {_fmt(r[k])}" for k in AT_RATE_KEYS))
    for name in variant_names(doc):
        ab = doc.get(f"ab_{name}")
        if ab is None:
            continue
        g = ab["goodput"]
        lines = [f"{name} against {ab['against']}, same requests: goodput ratio "
                 + (_fmt(g["goodput_rps"]) if g["goodput_rps"] is not None else g["goodput_note"])]
        for e in ab["rates"]:
            lines.append(f"  at {e['rate_rps']:g} req/s: met {e['met_variant']} vs "
                         f"{e['met_base']} of {e['num_paired']} (only {name} {e['only_variant']}, "
                         f"only {ab['against']} {e['only_base']})")
        parts.append("\n".join(lines))
    if "policy" in doc:
        p = doc["policy"]
        lines = [f"policy (interactive at {_fmt(p['rate_rps'], 1, 'g')} req/s): "
                 + (p.get("note") or f"slo {p['slo_attainment']:.1%} vs fifo "
                    f"{p['fifo_attainment']:.1%} ({p['slo_minus_fifo_points']:+.1f} points)")]
        for e in p.get("by_rate", []):
            lines.append(f"  at {e['rate_rps']:g} req/s: slo {e['slo_attainment']:.1%} vs fifo "
                         f"{e['fifo_attainment']:.1%} ({e['slo_minus_fifo_points']:+.1f} points)")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)

