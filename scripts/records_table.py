"""Every request of a `--save-records` JSON, one line each, with whether it met the SLOs,
and a count of the late and refused: for a `pdserve bench run` file (its one run) or a
`pdserve bench compare` file (each system and rate).

    python scripts/records_table.py FILE TTFT_SLO_S TPOT_SLO_S

A line: send time, prompt and output lengths, TTFT (s), TPOT (ms), T / P when late on
TTFT / TPOT, where pdserve prefilled it (local, remote, moved; blank for vLLM and for a
refused request), and the error with its message."""

import json
import sys


def lines(records, ttft_slo_s, tpot_slo_s):
    late_t = late_p = late = refused = served = 0
    for r in records:
        chunks = r.get("chunks") or []
        ttft = chunks[0]["time_s"] - r["send_s"] if chunks else None
        n, done = r.get("output_tokens") or 0, r.get("done_s")
        tpot = (done - r["send_s"] - ttft) / (n - 1) if ttft is not None and done and n > 1 else None
        flag = ""
        if r.get("error"):
            refused += r["error"] == "RESOURCE_EXHAUSTED"
        else:
            served += 1
            flag = ("T" if ttft is not None and ttft > ttft_slo_s else "") + ("P" if tpot and tpot > tpot_slo_s else "")
            late_t, late_p, late = late_t + ("T" in flag), late_p + ("P" in flag), late + bool(flag)
        print(f"{r['send_s']:7.1f} p={r['prompt_len']:5d} out={r['expected_output_len']:4d} "
              f"ttft={ttft or 0:6.2f} tpot={(tpot or 0) * 1000:6.1f} {flag:2s} "
              f"{(r.get('route') or {}).get('prefill', ''):6s} {r.get('error') or ''} "
              f"{(r.get('error_message') or '')[:140]}")
    print(f"served {served}: late {late} ({late_t} on TTFT, {late_p} on TPOT); refused {refused}")


def main() -> None:
    path, ttft_slo_s, tpot_slo_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    d = json.load(open(path))
    if "runs" in d:
        for run in d["runs"]:
            lines(run["records"], ttft_slo_s, tpot_slo_s)
        return
    for system, runs in d["detail"].items():
        if system == "unloaded":  # the calibration's requests, no rate
            continue
        for run in runs:
            print(f"== {system} at {run['rate_rps']} req/s")
            lines(run["records"], ttft_slo_s, tpot_slo_s)


if __name__ == "__main__":
    main()
