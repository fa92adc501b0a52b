"""Per-class SLO attainment of `--save-records` JSONs against one set of objectives given
here, so that runs calibrated separately (an A/B of two commits, each `--systems pdserve`)
are read against the same bar. A file is a `pdserve bench compare` JSON (each system and
rate) or a `pdserve bench run` JSON (each rate, the system named "run").

    .venv/bin/python scripts/class_attainment.py CLASS=TTFT_S:TPOT_S[,CLASS=...] FILE [FILE ...]

A request meets its class's objectives when it was served (not refused, no error), its first
token came within TTFT_S of its send and its mean time per output token after the first was
within TPOT_S. Per system and rate: each class's met / sent, with its late on TTFT, late on
TPOT and refused (of those, how many on a TPOT forecast, from the gateway's message)."""

import json
import sys

from pdserve.bench.compare_report import saved_runs
from pdserve.bench.record import RequestRecord


def parse_slos(text: str) -> dict[str, tuple[float, float]]:
    slos = {}
    for part in text.split(","):
        name, _, pair = part.partition("=")
        ttft, _, tpot = pair.partition(":")
        slos[name] = (float(ttft), float(tpot))
    return slos


def verdict(r: RequestRecord, ttft_s: float, tpot_s: float) -> str:
    """'met', 'refused', 'error', 'ttft', 'tpot' or 'ttft+tpot'."""
    if r.error:
        return "refused" if r.error == "RESOURCE_EXHAUSTED" else "error"
    if r.ttft_s is None:
        return "error"
    late = [k for k, bad in (("ttft", r.ttft_s > ttft_s), ("tpot", (r.tpot_s or 0.0) > tpot_s)) if bad]
    return "+".join(late) or "met"


def runs_of(doc: dict):
    """(system, rate, records) of a compare JSON or a `bench run` JSON."""
    if "detail" in doc:
        yield from saved_runs(doc["detail"])
        return
    for run in doc["runs"]:
        if "records" not in run:
            raise SystemExit("a `bench run` JSON without records: run it with --save-records")
        yield "run", run["load"]["rate_rps"], [RequestRecord.from_dict(r) for r in run["records"]]


def refused_on_tpot(r: RequestRecord) -> bool:
    return r.error == "RESOURCE_EXHAUSTED" and r.error_message.startswith("predicted time per output token")


def main() -> None:
    slos = parse_slos(sys.argv[1])
    for path in sys.argv[2:]:
        for system, rate, records in runs_of(json.load(open(path))):
            parts, met_all, sent_all = [], 0, 0
            for name, (ttft_s, tpot_s) in slos.items():
                got = [verdict(r, ttft_s, tpot_s) for r in records if r.class_name == name]
                met = got.count("met")
                met_all, sent_all = met_all + met, sent_all + len(got)
                on_tpot = sum(refused_on_tpot(r) for r in records if r.class_name == name)
                parts.append(f"{name} {met}/{len(got)} (TTFT late {sum('ttft' in g for g in got)}, TPOT late "
                             f"{sum('tpot' in g for g in got)}, refused {got.count('refused')}"
                             f", {on_tpot} on TPOT)")
            print(f"{path} {system} {rate} req/s: all {met_all}/{sent_all} "
                  f"({100 * met_all / max(sent_all, 1):.1f}%); " + "; ".join(parts))


if __name__ == "__main__":
    main()
