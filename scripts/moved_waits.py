"""The long prompts pdserve prefilled on a decode worker in a compare: those moved off its
prefill tier, with how long each waited there (the gateway's log line "prefill worker ...
did not answer in N s"), and those placed there as they came ("its N-token prompt is
prefilled on decode worker"); for each, whether its first token met its TTFT objective and,
where the log says, the first token the gateway predicted there against the time it took.

    .venv/bin/python scripts/moved_waits.py long.json bench-logs/compare-long-<UTC time>/pdserve.log

A compare JSON saved with `--save-records`; the log of the same compare's pdserve. Per
prompt: rate, request id, class, prompt tokens, route, wait on the tier (moved ones), TTFT,
"late" when over its class's objective, and "there: predicted P s, took T s" (T: from the
move or placement to the first token, the gateway's queue wait before a moved prompt's
tier call counted in); then the waits of the moves that met and that missed, and how the
predictions compared."""

import json
import re
import sys

from pdserve.bench.record import RequestRecord

WAITED = re.compile(r"request (\S+): prefill worker \S+ did not answer in ([0-9.]+) s"
                    r"(?:.*prefilling on decode worker \S+ \(predicted (nothing|[0-9.]+ s)\))?")
PLACED = re.compile(r"request (\S+): its \d+-token prompt is prefilled on decode worker \S+ "
                    r"\(predicted (nothing|[0-9.]+ s), ([0-9.]+) s after it came\)")


def _seconds(text: str) -> float | str:
    """A predicted time, "nothing" (none predicted), or "?" (a log from before the line said)."""
    return {"": "?", "nothing": "nothing"}.get(text) or float(text.split()[0])


def main(json_path: str, log_path: str, system: str = "pdserve") -> int:
    doc = json.load(open(json_path))
    with open(log_path) as f:
        text = f.read()
    # request id -> (wait on the tier, predicted there, seconds from its arrival to the placement there)
    there: dict[str, tuple[float | None, float | str, float]] = {}
    for rid, waited, predicted in WAITED.findall(text):
        there[rid] = (float(waited), _seconds(predicted), float(waited))
    for rid, predicted, after in PLACED.findall(text):
        there[rid] = (None, _seconds(predicted), float(after))
    objectives = doc["slo"]["by_class"]
    if system not in doc.get("detail", {}):
        sys.exit(f"{json_path}: no records of {system} (was it saved with --save-records?)")
    met, late, ratios = [], [], []
    for run in doc["detail"][system]:
        for raw in run["records"]:
            route = raw.get("route", {}).get("prefill")
            if route != "moved" and raw["request_id"] not in there:
                continue
            r = RequestRecord.from_dict(raw)
            ttft_slo = objectives.get(r.class_name, objectives.get("default", {})).get("ttft_s")
            wait, predicted, placed_after = there.get(r.request_id, (None, None, None))
            missed = r.ttft_s is None or (ttft_slo is not None and r.ttft_s > ttft_slo)
            if route == "moved":
                (late if missed else met).append(wait)
            took = None if r.ttft_s is None or placed_after is None else r.ttft_s - placed_after
            if took is not None and isinstance(predicted, float) and predicted > 0:
                ratios.append(took / predicted)
            print(f"{run['rate_rps']:g} {r.request_id} {r.class_name} {r.prompt_len} tokens, {route}: "
                  + (f"waited {'?' if wait is None else f'{wait:.2f} s'}, " if route == "moved" else "")
                  + f"TTFT {'-' if r.ttft_s is None else f'{r.ttft_s:.2f} s'}{' late' if missed else ''}"
                  + ("" if placed_after is None else
                     f"; there: predicted {f'{predicted:.2f} s' if isinstance(predicted, float) else predicted}, "
                     f"took {'-' if took is None else f'{took:.2f} s'}"))
    for name, group in (("met", met), ("late", late)):
        known = sorted(w for w in group if w is not None)
        span = f", waited {known[0]:.2f}-{known[-1]:.2f} s" if known else ""
        print(f"{name}: {len(group)} moved{span}")
    if ratios:
        ratios.sort()
        print(f"first token there, taken / predicted: {len(ratios)} prompts, median {ratios[len(ratios) // 2]:.2f}, "
              f"range {ratios[0]:.2f}-{ratios[-1]:.2f}")
    if not met and not late and not there:
        sys.exit("no prompts moved or placed on a decode worker in the records")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
