"""The prompts pdserve moved off its prefill tier in a compare, with how long each waited
there (from the gateway's log line "prefill worker ... did not answer in N s") and whether
its first token met its TTFT objective.

    .venv/bin/python scripts/moved_waits.py long.json bench-logs/compare-long-<UTC time>/pdserve.log

A compare JSON saved with `--save-records`; the log of the same compare's pdserve. Per
moved prompt: rate, request id, class, prompt tokens, wait on the tier, TTFT, and "late"
when over its class's objective; then the waits of the moves that met and that missed."""

import json
import re
import sys

from pdserve.bench.record import RequestRecord

WAITED = re.compile(r"request (\S+): prefill worker \S+ did not answer in ([0-9.]+) s")


def main(json_path: str, log_path: str, system: str = "pdserve") -> int:
    doc = json.load(open(json_path))
    with open(log_path) as f:
        waits = {rid: float(s) for rid, s in WAITED.findall(f.read())}
    objectives = doc["slo"]["by_class"]
    if system not in doc.get("detail", {}):
        sys.exit(f"{json_path}: no records of {system} (was it saved with --save-records?)")
    met, late = [], []
    for run in doc["detail"][system]:
        for raw in run["records"]:
            if raw.get("route", {}).get("prefill") != "moved":
                continue
            r = RequestRecord.from_dict(raw)
            ttft_slo = objectives.get(r.class_name, objectives.get("default", {})).get("ttft_s")
            wait = waits.get(r.request_id)
            missed = r.ttft_s is None or (ttft_slo is not None and r.ttft_s > ttft_slo)
            (late if missed else met).append(wait)
            print(f"{run['rate_rps']:g} {r.request_id} {r.class_name} {r.prompt_len} tokens: "
                  f"waited {'?' if wait is None else f'{wait:.2f} s'}, TTFT "
                  f"{'-' if r.ttft_s is None else f'{r.ttft_s:.2f} s'}{' late' if missed else ''}")
    for name, group in (("met", met), ("late", late)):
        known = sorted(w for w in group if w is not None)
        span = f", waited {known[0]:.2f}-{known[-1]:.2f} s" if known else ""
        print(f"{name}: {len(group)} moved{span}")
    if not met and not late:
        sys.exit("no moved prompts in the records")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
