"""The TPOT of each system's short prompts (up to 300 tokens) in `--save-records` compare
JSONs, per system and rate: minimum, first quartile and median, to tell a slower decode
step (every short prompt slower) from placement (a few slower beside long prefills).

    python scripts/tpot_quiet.py FILE [FILE ...]"""

import json
import statistics
import sys


def tpots_ms(records, max_prompt=300):
    out = []
    for r in records:
        chunks = r.get("chunks") or []
        n = r.get("output_tokens") or 0
        if r.get("error") or not chunks or r["prompt_len"] > max_prompt or n < 2:
            continue
        ttft = chunks[0]["time_s"] - r["send_s"]
        out.append((r["done_s"] - r["send_s"] - ttft) / (n - 1) * 1000)
    return out


def main() -> None:
    for path in sys.argv[1:]:
        d = json.load(open(path))
        for system, runs in d["detail"].items():
            if system == "unloaded":
                continue
            for run in runs:
                t = tpots_ms(run["records"])
                if len(t) < 2:
                    print(f"{path} {system} {run['rate_rps']}: {len(t)} short prompts served")
                    continue
                print(f"{path} {system} {run['rate_rps']} req/s: {len(t)} short prompts, TPOT min "
                      f"{min(t):.1f} p25 {statistics.quantiles(t, n=4)[0]:.1f} p50 {statistics.median(t):.1f} ms")


if __name__ == "__main__":
    main()
