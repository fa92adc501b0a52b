"""The TPOT of each system's short prompts (up to 300 tokens) in `--save-records` compare
JSONs, per system and rate: minimum, first quartile and median, to tell a slower decode
step (every short prompt slower) from placement (a few slower beside long prefills).

    .venv/bin/python scripts/tpot_quiet.py FILE [FILE ...]"""

import json
import statistics
import sys

from pdserve.bench.compare_report import saved_runs

MAX_PROMPT_TOKENS = 300


def main() -> None:
    for path in sys.argv[1:]:
        for system, rate, records in saved_runs(json.load(open(path))["detail"]):
            t = [r.tpot_s * 1000 for r in records
                 if r.error is None and r.tpot_s is not None and r.prompt_len <= MAX_PROMPT_TOKENS]
            if len(t) < 2:
                print(f"{path} {system} {rate}: {len(t)} short prompts served")
                continue
            print(f"{path} {system} {rate} req/s: {len(t)} short prompts, TPOT min "
                  f"{min(t):.1f} p25 {statistics.quantiles(t, n=4)[0]:.1f} p50 {statistics.median(t):.1f} ms")


if __name__ == "__main__":
    main()
