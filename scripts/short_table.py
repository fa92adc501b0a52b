"""The table docs/benchmarks.md shows for a `pdserve bench compare --workload short|long
--json --save-records` file (one request class): per system and rate, attainment, refusals, misses among the served
(from each request's timeline against its SLOs), latencies and throughput, where pdserve
prefilled the served prompts (its trailing metadata: local / remote / moved), the order
the systems took turns in, and for each TPOT refusal how the served requests sent within
4 s of it fared against the TPOT objective.

    python scripts/short_table.py short.json
"""
import json
import sys

d = json.load(open(sys.argv[1]))
# vllm, pdserve, then any --variant systems (pdserve-NAME) the compare measured.
SYSTEMS = [n for n in ("vllm", "pdserve") if n in d] + sorted(n for n in d.get("variants", {}) if n in d)
if "detail" not in d:
    sys.exit(f"{sys.argv[1]}: no per-request records; run the compare with --save-records")
slo = d["slo"]["by_class"]["default"]
ttft_slo, tpot_slo = slo["ttft_s"], slo["tpot_s"]
print(f"SLOs: TTFT {ttft_slo:.3f} s, TPOT {tpot_slo * 1000:.1f} ms "
      f"(vLLM unloaded TTFT p50 {d['slo']['unloaded_p50']['default']['ttft_p50_s']:.3f} s, "
      f"TPOT p50 {d['slo']['unloaded_p50']['default']['tpot_p50_s'] * 1000:.1f} ms)\n")


def tpot_s(record: dict) -> float | None:
    """A served request's time per output token from its chunks' times (None below 2)."""
    chunks = record["chunks"]
    n = sum(c["num_tokens"] for c in chunks)
    return (chunks[-1]["time_s"] - chunks[0]["time_s"]) / (n - 1) if n > 1 else None


print("| system | rate (req/s) | SLO attainment | refused | other errors | late among served "
      "(TTFT / TPOT) | TTFT p50 / p99 | TPOT p50 / p99 | output tok/s | prefill local / remote / moved |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for name in SYSTEMS:
    runs = {x["rate_rps"]: x["records"] for x in d["detail"][name]}
    for m in sorted(d[name]["measurements"], key=lambda m: m["rate_rps"]):
        refused = errors = late_ttft = late_tpot = 0
        placed = {"local": 0, "remote": 0, "moved": 0}
        for r in runs[m["rate_rps"]]:
            where = r.get("route", {}).get("prefill")
            if where in placed:
                placed[where] += 1
            if r["error"]:
                refused += r["error"] == "RESOURCE_EXHAUSTED"
                errors += r["error"] != "RESOURCE_EXHAUSTED"
                continue
            late_ttft += r["chunks"][0]["time_s"] - r["send_s"] > ttft_slo
            late_tpot += (tpot_s(r) or 0.0) > tpot_slo
        print(f"| {name} | {m['rate_rps']:g} | {m['slo_attainment']:.1%} | {refused} | "
              f"{errors} | {late_ttft} / {late_tpot} | {m['ttft_p50_s']:.3f} / {m['ttft_p99_s']:.3f} s | "
              f"{m['tpot_p50_s'] * 1000:.1f} / {m['tpot_p99_s'] * 1000:.1f} ms | "
              f"{m['output_tok_s']:.1f} | "
              f"{' / '.join(map(str, placed.values())) if any(placed.values()) else '-'} |")
if "ratios" in d:  # a compare without vLLM (an A/B of pdserves) has none
    r = d["ratios"]
    print(f"\ngoodput: vllm {d['vllm']['goodput']['goodput_rps'] or d['vllm']['goodput']['status']}, "
          f"pdserve {d['pdserve']['goodput']['goodput_rps'] or d['pdserve']['goodput']['status']}; "
          f"ratio {r['goodput_rps']}; output tok/s ratio at {r['at_rate_rps']} req/s "
          f"{r['output_tok_s']}")
    for name in SYSTEMS[2:]:
        ratios = d.get(f"ratios_{name}", {})
        print(f"goodput: {name} {d[name]['goodput']['goodput_rps'] or d[name]['goodput']['status']}; "
              f"ratio to vllm {ratios.get('goodput_rps')}")
else:
    print("\n" + "; ".join(f"goodput: {n} {d[n]['goodput']['goodput_rps'] or d[n]['goodput']['status']}"
                           for n in SYSTEMS))
print("turns: " + ", ".join(f"{n} {rate:g}" for n, rate in d["config"].get("measured_in_order", [])))

print("\nTPOT refusals and the served requests sent within 4 s of each (TPOT ms):")
met = near_all = 0
for name in SYSTEMS:
    for run in d["detail"][name]:
        records = run["records"]
        for r in records:
            if r["error"] != "RESOURCE_EXHAUSTED" or "time per output token" not in r["error_message"]:
                continue
            near = [t for q in records if not q["error"] and abs(q["send_s"] - r["send_s"]) <= 4
                    and (t := tpot_s(q)) is not None]
            met += sum(t <= tpot_slo for t in near)
            near_all += len(near)
            print(f"  {name} {run['rate_rps']:g} {r['request_id']}: "
                  f"{' '.join(f'{t * 1000:.0f}' for t in near) or 'none'}")
print(f"  {met} of {near_all} within the {tpot_slo * 1000:.1f} ms objective")
