"""Paired A/B of two systems of a compare JSON (`--save-records`), split by whether the
machine had another request of the run in flight when each request was sent: TTFT and
where it was prefilled, per system, for the requests both served.

    .venv/bin/python scripts/ab_idle_split.py FILE.json SYSTEM_A SYSTEM_B
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter

from pdserve.bench.compare_report import saved_runs


def main(path: str, a: str, b: str) -> None:
    doc = json.load(open(path))
    runs = {(name, rate): records for name, rate, records in saved_runs(doc["detail"])}
    for (name, rate), recs_a in sorted(runs.items()):
        if name != a or (b, rate) not in runs:
            continue
        by_id = {r.request_id: r for r in runs[(b, rate)]}
        print(f"== {a} vs {b} at {rate:g} req/s")
        for label, want_idle in (("sent with nothing else in flight", True), ("sent beside another", False)):
            ttfts: dict[str, list[float]] = {a: [], b: []}
            routes: dict[str, Counter] = {a: Counter(), b: Counter()}
            for r in recs_a:
                other = by_id.get(r.request_id)
                if other is None or not r.ok or not other.ok:
                    continue
                # In flight by system A's own timeline (the same schedule for both).
                idle = not any(o is not r and o.ok and o.send_s < r.send_s < o.done_s for o in recs_a)
                if idle != want_idle:
                    continue
                for name_, rec in ((a, r), (b, other)):
                    ttfts[name_].append(rec.ttft_s)
                    routes[name_][rec.route.get("prefill", "-")] += 1
            if not ttfts[a]:
                continue
            print(f"  {label}: {len(ttfts[a])} requests")
            for name_ in (a, b):
                t = ttfts[name_]
                print(f"    {name_:14s} TTFT mean {statistics.mean(t):.2f} s, median {statistics.median(t):.2f} s, "
                      f"max {max(t):.2f} s; prefill " + " / ".join(f"{k} {v}" for k, v in sorted(routes[name_].items())))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
