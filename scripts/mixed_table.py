"""The per-class table docs/benchmarks.md shows for a `pdserve bench compare --workload mixed --json` file.

    python scripts/mixed_table.py mixed.json
"""
import json, sys
d=json.load(open(sys.argv[1]))
u=d['slo']['unloaded_p50']['interactive']['ttft_p50_s']
print("| system | rate (req/s) | all: attainment | interactive: attainment / refused | interactive TTFT p50 / p90 (x unloaded p50) | interactive TPOT p90 | offline: attainment / refused | offline TTFT p90 | output tok/s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
f=lambda x,k=1,n=2: '-' if x is None else f"{x*k:.{n}f}"
for s in ('vllm','pdserve-fifo','pdserve'):
    if s not in d: continue
    for m in sorted(d[s]['measurements'], key=lambda m:m['rate_rps']):
        i=m['by_class']['interactive']; o=m['by_class']['offline']
        ir=i['errors'].get('RESOURCE_EXHAUSTED',0); orf=o['errors'].get('RESOURCE_EXHAUSTED',0)
        p90=i.get('ttft_p90_s')
        print(f"| {s} | {m['rate_rps']} | {m['slo_attainment']:.1%} | {i['slo_attainment']:.1%} / {ir} of {i['num_requests']} | {f(i.get('ttft_p50_s'))} / {f(p90)} s ({f(p90/u if p90 else None,1,2)}x) | {f(i.get('tpot_p90_s'),1000,0)} ms | {o['slo_attainment']:.1%} / {orf} of {o['num_requests']} | {f(o.get('ttft_p90_s'),1,1)} s | {m['output_tok_s']:.1f} |")
p=d.get('policy')
if p and 'slo_attainment' in p: print(f"\npolicy at {p['rate_rps']} req/s: slo {p['slo_attainment']:.1%} vs fifo {p['fifo_attainment']:.1%} ({p['slo_minus_fifo_points']:+.1f} points); slo interactive TTFT p90 / unloaded p50 = {p['slo_ttft_p90_over_unloaded_p50']:.2f}")
elif p: print(f"\npolicy at {p['rate_rps']} req/s: {p.get('note', 'no figure')}")
for b in (p or {}).get('by_rate', []):
    if 'slo_attainment' in p and b['rate_rps'] == p['rate_rps']: continue  # the line above
    print(f"policy at {b['rate_rps']} req/s: slo {b['slo_attainment']:.1%} vs fifo {b['fifo_attainment']:.1%} ({b['slo_minus_fifo_points']:+.1f} points)")
