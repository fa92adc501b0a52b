#!/usr/bin/env bash
# Per-process CPU of a `pdserve up` stack: 20 s idle, then under the short workload at RATE
# req/s (120 requests; SLOs of the thirteenth session's short compare), from /proc/PID/stat.
#
#   scripts/stack_cpu.sh [RATE]     default 4.81
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/.venv/bin:$PATH
RATE=${1:-4.81}
PORT=$(python -c 'from pdserve.launcher import free_port; print(free_port())')
LOG=$(mktemp /tmp/stack-cpu-XXXX.log)
TMP=$(mktemp -d)
pdserve up --port $PORT --metrics-port 0 > $LOG 2>&1 &
UP=$!
for i in $(seq 150); do grep -q "^pdserve ready" $LOG && break; sleep 1; done
sleep 5
pids=$(ps -o pid= --ppid $UP; for c in $(ps -o pid= --ppid $UP); do ps -o pid= --ppid $c; for g in $(ps -o pid= --ppid $c); do ps -o pid= --ppid $g; done; done)
pids="$UP $pids"
snap() { for p in $pids; do echo "$p $(awk '{print $14+$15}' /proc/$p/stat 2>/dev/null)"; done; }
name() { tr '\0' ' ' < /proc/$1/cmdline | sed 's|^[^ ]*python3* ||' | cut -c1-70; }
report() {  # label seconds before-file after-file
  echo "== $1 ($2 s): ticks (1/100 s) per process"
  join <(sort $3) <(sort $4) | while read p a b; do echo "$((b - a)) $p $(name $p)"; done | sort -rn | head -12
}
snap > $TMP/c0; sleep 20; snap > $TMP/c1
report idle 20 $TMP/c0 $TMP/c1
snap > $TMP/c2; t0=$(date +%s.%N)
pdserve bench run --target 127.0.0.1:$PORT --workload short --rate $RATE --num-requests 120 --slo-ttft-s 0.172 --slo-tpot-s 0.037 2>&1 | grep -E "attainment|TPOT|throughput" | head -5
t1=$(date +%s.%N); snap > $TMP/c3
report "short at $RATE req/s" $(echo "$t1 - $t0" | bc) $TMP/c2 $TMP/c3
kill -INT $UP; wait $UP
rm -rf $TMP $LOG
