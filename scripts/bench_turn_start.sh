#!/usr/bin/env bash
# pdserve at the start of a compare turn: a warm stack idles IDLE_S seconds while two busy
# loops hold both cores (as the other system's turn does), then a Poisson run at RATE with
# the given SLOs. Prints the run's summary, where the gateway placed prompts during it
# (pdserve_placements_total), and the TPOT of the requests sent in its first 6 s against
# the rest (from --save-records), and the first 12 requests' timelines with where the
# gateway says it prefilled each (its pdserve-prefill trailer).
#
# DROP_CACHES=1 (root) then drops the page cache, as another system's turn may evict the
# libraries' pages (a cold start).
#
#   flock /tmp/pdserve-cpu.lock scripts/bench_turn_start.sh [RATE] [IDLE_S] [N]
set -euo pipefail
RATE=${1:-1.31}; IDLE_S=${2:-45}; N=${3:-40}
SLO_TTFT_S=${SLO_TTFT_S:-0.446}; SLO_TPOT_S=${SLO_TPOT_S:-0.0969}
PORT=${PORT:-50191}; METRICS=${METRICS:-9491}
PY=${PY:-.venv/bin/python}
OUT=$(mktemp -d /tmp/turn-start.XXXXXX)
$PY -m pdserve.cli up --port "$PORT" --metrics-port "$METRICS" --max-model-len 4096 > "$OUT/up.log" 2>&1 &
UP=$!
HOGS=()
cleanup() { kill "${HOGS[@]}" 2>/dev/null || true; kill -TERM "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 1 150); do grep -q "ready" "$OUT/up.log" && break; sleep 2; done
grep -q "ready" "$OUT/up.log" || { echo "pdserve did not come up: $OUT/up.log" >&2; exit 1; }
placements() { curl -s "127.0.0.1:$METRICS/metrics" | awk '/^pdserve_placements_total/ {print $1, $2}' | tr '\n' ' '; echo; }
echo "[turn-start] warm: 20 requests at $RATE req/s"
$PY -m pdserve.cli bench run --target "127.0.0.1:$PORT" --workload short --rate "$RATE" --num-requests 20 \
    --warmup 2 --seed 3 --max-model-len 4096 --slo-ttft-s "$SLO_TTFT_S" --slo-tpot-s "$SLO_TPOT_S" > "$OUT/warm.log" 2>&1
echo "[turn-start] idle ${IDLE_S} s with both cores busy"
for _ in 1 2; do $PY -c "while True: pass" & HOGS+=($!); done
sleep "$IDLE_S"; kill "${HOGS[@]}"; HOGS=()
if [[ "${DROP_CACHES:-0}" == 1 ]]; then
    sync; echo 1 > /proc/sys/vm/drop_caches
    echo "[turn-start] page cache dropped: $(awk '/^Cached:/ {print $2, $3}' /proc/meminfo) cached"
fi
echo "[turn-start] placements before: $(placements)"
$PY -m pdserve.cli bench run --target "127.0.0.1:$PORT" --workload short --rate "$RATE" --num-requests "$N" \
    --warmup 0 --seed 0 --max-model-len 4096 --slo-ttft-s "$SLO_TTFT_S" --slo-tpot-s "$SLO_TPOT_S" \
    --save-records --json "$OUT/run.json" 2>&1 | grep -A6 "^throughput"
echo "[turn-start] placements after:  $(placements)"
$PY - "$OUT/run.json" <<'PY'
import json, sys
records = json.load(open(sys.argv[1]))["runs"][0]["records"]
def tpot(r):
    ch = r["chunks"]
    return (ch[-1]["time_s"] - ch[0]["time_s"]) / (r["output_tokens"] - 1) * 1000
ok = [r for r in records if not r["error"] and r["output_tokens"] > 1]
early = [tpot(r) for r in ok if r["send_s"] < 6]
rest = [tpot(r) for r in ok if r["send_s"] >= 6]
mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
print(f"[turn-start] first token of the first request {records[0]['chunks'][0]['time_s'] - records[0]['send_s'] if records[0]['chunks'] else float('nan'):.2f} s; "
      f"TPOT sent in the first 6 s {mean(early):.0f} ms (n={len(early)}), after {mean(rest):.0f} ms (n={len(rest)})")
for r in records[:12]:
    ch = r["chunks"]
    ttft = ch[0]["time_s"] - r["send_s"] if ch else float("nan")
    print(f"[turn-start]   {r['request_id']}: sent {r['send_s']:5.2f} s, prompt {r['prompt_len']}, "
          f"TTFT {ttft:.2f} s, TPOT {tpot(r) if r in ok else float('nan'):.0f} ms, "
          f"prefill {r.get('route', {}).get('prefill', '?')}")
PY
echo "[turn-start] logs in $OUT"
