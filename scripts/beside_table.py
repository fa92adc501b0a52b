"""What ran beside each interactive request of a mixed `--save-records` JSON (a `pdserve bench
run` file, or each pdserve system and rate of a `pdserve bench compare` file): per served
interactive request its TPOT (late against TPOT_SLO_S or not) and how many offline requests
were waiting for their first token ("prefilling") or decoding during its decode; per refused
one, the offline prompts waiting for their first token when it arrived.

    python scripts/beside_table.py FILE TPOT_SLO_S
"""

import json
import sys


def window(r):
    return r["chunks"][0]["time_s"], r["done_s"]


def table(records, tpot_slo_s):
    served = [r for r in records if not r.get("error")]
    offline = [r for r in records if r["class_name"] == "offline"]
    for r in records:
        if r["class_name"] != "interactive":
            continue
        if r.get("error"):
            pending = [(y["prompt_len"], (y.get("route") or {}).get("prefill", "")) for y in offline
                       if y.get("chunks") and y["send_s"] <= r["send_s"] <= y["chunks"][0]["time_s"]]
            print(f"{r['send_s']:7.1f} refused  offline waiting for their first token: {pending}  "
                  f"{(r.get('error_message') or '')[:90]}")
            continue
        start, end = window(r)
        tpot = (end - start) / max(r["output_tokens"] - 1, 1)
        prefilling = sum(1 for y in offline if y["send_s"] < end
                         and (y["chunks"][0]["time_s"] if y.get("chunks") else y["send_s"]) > start)
        decoding = sum(1 for y in served
                       if y["class_name"] == "offline" and window(y)[0] < end and window(y)[1] > start)
        print(f"{r['send_s']:7.1f} tpot {tpot * 1000:5.1f} ms {'LATE' if tpot > tpot_slo_s else '    '} "
              f"offline prefilling {prefilling}, decoding {decoding}")


def main() -> None:
    path, tpot_slo_s = sys.argv[1], float(sys.argv[2])
    d = json.load(open(path))
    if "runs" in d:
        for run in d["runs"]:
            table(run["records"], tpot_slo_s)
    else:
        for run in d["detail"]["pdserve"]:
            print(f"== pdserve at {run['rate_rps']} req/s")
            table(run["records"], tpot_slo_s)


if __name__ == "__main__":
    main()
