#!/usr/bin/env bash
# pdserve at the start of a compare turn: a warm stack idles IDLE_S seconds while two busy
# loops hold both cores (as the other system's turn does), then a Poisson run at RATE with
# the given SLOs. Prints the run's summary, where the gateway placed prompts during it
# (pdserve_placements_total), and the TPOT of the requests sent in its first 6 s against
# the rest (from --save-records), and the first 12 requests' timelines with where the
# gateway says it prefilled each (its pdserve-prefill trailer).
#
# PRESSURE=1 then has another process take all but 512 MiB of the available memory for
# 10 s (the kernel reclaims page cache, mapped libraries included). DROP_CACHES=1 (root)
# then drops the page cache (unmapped pages only: a running process's
# mapped libraries stay). Prints the stack's page faults and the CPU steal during the run.
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
if [[ "${PRESSURE:-0}" == 1 ]]; then  # another tenant takes all but 512 MiB of the memory for 10 s
    $PY -c "
import time
avail = int(next(l for l in open('/proc/meminfo') if l.startswith('MemAvailable')).split()[1]) * 1024
n = max(avail - (512 << 20), 0)
b = bytearray(n)
for i in range(0, n, 4096): b[i] = 1
time.sleep(10)"
    echo "[turn-start] memory pressure applied: the page cache now $(awk '/^Cached:/ {print $2, $3}' /proc/meminfo)"
fi
if [[ "${DROP_CACHES:-0}" == 1 ]]; then
    sync; echo 1 > /proc/sys/vm/drop_caches
    echo "[turn-start] page cache dropped: $(awk '/^Cached:/ {print $2, $3}' /proc/meminfo) cached"
fi
faults() {  # minor and major page faults of the stack (pdserve up and its descendants)
    $PY -c "import psutil; p = psutil.Process($UP); f = [open(f'/proc/{q.pid}/stat').read().rsplit(')', 1)[1].split() for q in [p, *p.children(recursive=True)]]; print(sum(int(x[7]) for x in f), sum(int(x[9]) for x in f))"
}
steal() { awk '/^cpu / {print $9}' /proc/stat; }  # ticks (1/100 s) the hypervisor ran others
read -r MIN_BEFORE MAJ_BEFORE <<< "$(faults)"; STEAL_BEFORE=$(steal)
echo "[turn-start] placements before: $(placements)"
$PY -m pdserve.cli bench run --target "127.0.0.1:$PORT" --workload short --rate "$RATE" --num-requests "$N" \
    --warmup 0 --seed 0 --max-model-len 4096 --slo-ttft-s "$SLO_TTFT_S" --slo-tpot-s "$SLO_TPOT_S" \
    --save-records --json "$OUT/run.json" 2>&1 | grep -A6 "^throughput"
echo "[turn-start] placements after:  $(placements)"
read -r MIN_AFTER MAJ_AFTER <<< "$(faults)"
echo "[turn-start] during the run: page faults of the stack $((MIN_AFTER - MIN_BEFORE)) minor, $((MAJ_AFTER - MAJ_BEFORE)) major; CPU steal $(( $(steal) - STEAL_BEFORE )) ticks"
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
