"""Every request of a `--save-records` JSON, one line each, with whether it met the SLOs,
and a count of the late and refused: for a `pdserve bench run` file (its one run) or a
`pdserve bench compare` file (each system and rate).

    python scripts/records_table.py FILE [TTFT_SLO_S TPOT_SLO_S]

Without the two SLOs a compare file is read against its own (`slo.by_class`: in `mixed`
each class has its own pair). A line: send time, the request's class where the file has
more than one, prompt and output lengths, TTFT (s), TPOT (ms), T / P when late on
TTFT / TPOT, where pdserve prefilled it (local, remote, moved; blank for vLLM and for a
refused request), and the error with its message."""

import json
import sys


def lines(records, slos):
    """``slos``: class name -> (TTFT s, TPOT s); a class not in it, the pair under None."""
    late_t = late_p = late = refused = served = 0
    for r in records:
        pair = slos.get(r.get("class_name"), slos.get(None))
        if pair is None:
            sys.exit(f"the file states no SLOs for class {r.get('class_name')!r}: give TTFT_SLO_S and TPOT_SLO_S")
        ttft_slo_s, tpot_slo_s = pair
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
        cls = f"{r.get('class_name', ''):12s}" if len(slos) > 1 else ""
        print(f"{r['send_s']:7.1f} {cls}p={r['prompt_len']:5d} out={r['expected_output_len']:4d} "
              f"ttft={ttft or 0:6.2f} tpot={(tpot or 0) * 1000:6.1f} {flag:2s} "
              f"{(r.get('route') or {}).get('prefill', ''):6s} {r.get('error') or ''} "
              f"{(r.get('error_message') or '')[:140]}")
    print(f"served {served}: late {late} ({late_t} on TTFT, {late_p} on TPOT); refused {refused}")


def file_slos(d) -> dict:
    by_class = (d.get("slo") or {}).get("by_class")
    if not by_class:
        sys.exit("this file states no SLOs (a `pdserve bench run` file, or a compare without vLLM's "
                 "calibration): give TTFT_SLO_S and TPOT_SLO_S")
    return {name: (slo["ttft_s"], slo["tpot_s"]) for name, slo in by_class.items()}


def main() -> None:
    if len(sys.argv) not in (2, 4):
        sys.exit(__doc__)
    d = json.load(open(sys.argv[1]))
    slos = {None: (float(sys.argv[2]), float(sys.argv[3]))} if len(sys.argv) == 4 else file_slos(d)
    if "runs" in d:
        for run in d["runs"]:
            lines(run["records"], slos)
        return
    for system, runs in d["detail"].items():
        if system in ("unloaded", "unloaded_again"):  # the calibration's requests, no rate
            continue
        for run in runs:
            print(f"== {system} at {run['rate_rps']} req/s")
            lines(run["records"], slos)


if __name__ == "__main__":
    main()
