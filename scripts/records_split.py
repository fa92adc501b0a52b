"""Two splits of a compare JSON's records (`--save-records`), per system and rate: the
misses by cause against each class's objectives (the JSON's `slo.by_class`), TPOT by
how many other requests of the run were in flight while each one decoded, and (pdserve)
each TPOT miss with the prompts prefilled on a decode worker (local or moved) that reached
their first token while it decoded.

    .venv/bin/python scripts/records_split.py FILE.json
"""

from __future__ import annotations

import json
import statistics
import sys

from pdserve.bench.compare_report import saved_runs

OVERLAP_BUCKETS = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 99))


def miss_causes(records, by_class) -> dict[str, int]:
    causes = {"ttft": 0, "tpot": 0, "both": 0, "error": 0}
    for r in records:
        slo = by_class[r.class_name]
        if not r.ok:
            causes["error"] += 1
            continue
        late_ttft, late_tpot = r.ttft_s > slo["ttft_s"], (r.tpot_s or 0) > slo["tpot_s"]
        if late_ttft or late_tpot:
            causes["both" if late_ttft and late_tpot else "ttft" if late_ttft else "tpot"] += 1
    return causes


def tpot_by_overlap(records) -> list[tuple[tuple[int, int], list[float]]]:
    """TPOT (ms) of the served requests, bucketed by the mean number of others in flight
    between each one's first token and its end."""
    served = [r for r in records if r.ok and r.tpot_s]
    rows = []
    for r in served:
        start, end = r.send_s + r.ttft_s, r.done_s
        if end <= start:
            continue
        overlap = sum(max(0.0, min(end, o.done_s) - max(start, o.send_s)) for o in served if o is not r)
        rows.append((overlap / (end - start), r.tpot_s * 1000))
    return [((lo, hi), [t for o, t in rows if lo <= o < hi]) for lo, hi in OVERLAP_BUCKETS]


def decode_prefills_beside_tpot_misses(records, by_class) -> list[tuple[object, list[object]]]:
    """Each served request late on TPOT, with the others prefilled on a decode worker
    (`route["prefill"]` local or moved) whose first token came between its own and its end."""
    served = [r for r in records if r.ok and r.tpot_s]
    rows = []
    for r in served:
        if r.tpot_s <= by_class[r.class_name]["tpot_s"]:
            continue
        start, end = r.send_s + r.ttft_s, r.done_s
        beside = [o for o in served if o is not r and o.route.get("prefill") in ("local", "moved")
                  and start < o.send_s + o.ttft_s <= end]
        rows.append((r, beside))
    return rows


def main(path: str) -> None:
    doc = json.load(open(path))
    by_class = doc["slo"]["by_class"]
    for name, rate, records in sorted(saved_runs(doc["detail"]), key=lambda run: (run[0], run[1])):
        causes = miss_causes(records, by_class)
        print(f"{name} at {rate:g} req/s: misses " + ", ".join(f"{k} {v}" for k, v in causes.items()))
        for (lo, hi), tpots in tpot_by_overlap(records):
            if tpots:
                print(f"  others in flight {lo}-{hi}: n={len(tpots)} TPOT mean {statistics.mean(tpots):.1f} ms, "
                      f"p90 {sorted(tpots)[int(0.9 * len(tpots))]:.1f} ms")
        for r, beside in decode_prefills_beside_tpot_misses(records, by_class):
            if r.route:  # pdserve says where each prompt was prefilled; vLLM does not
                print(f"  TPOT miss {r.request_id} ({r.route.get('prefill')}, {r.prompt_len} tokens): "
                      f"{r.tpot_s * 1000:.0f} ms, decoding {r.send_s + r.ttft_s:.1f}-{r.done_s:.1f} s; prefilled on "
                      "a decode worker meanwhile: " + (", ".join(
                          f"{o.request_id} ({o.route['prefill']}, {o.prompt_len} tokens, first token "
                          f"{o.send_s + o.ttft_s:.1f} s)" for o in beside) or "none"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
