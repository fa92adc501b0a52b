#!/usr/bin/env bash
# How `pdserve up` should share this host's cores between the two engines (issue #8 item 5):
# the same seeded workload at the same rate against each allocation, one after the other.
#
#   scripts/bench_cores.sh [WORKLOAD] [RATE] [NUM_REQUESTS] [OUT_DIR]
#   defaults:              long       0.08   24             bench-results/cores
#
# Candidates: `split` (half the cores each, today's old default), `shared` (both engines on
# every core, prefill at idle CPU priority: the default) and `shared-normal` (both on every
# core at normal priority: what OpenMP threads do when another engine takes their core);
# `shared-yieldN` is `shared` with the decode engine yielding N ms per step while prefill
# has work (--decode-yield-ms N), `shared-slack` with the decode engine yielding what its
# requests' TPOT objectives leave over (--decode-yield slack), `shared-pace` with it waiting
# a steady share of each step (--decode-yield pace), `shared-whole` with the
# decode engine waiting for prefill one prompt at a time (--decode-yield whole). A candidate
# with the suffix -quiet runs with PDSERVE_ENGINE_QUIET=1 (vLLM's engine processes sleep
# between looks at each other's queue: kvtransfer.engine_waits.quiet_engine_waits); one with
# -solo (before any -quiet) adds --prefill-threads solo (kvtransfer.prefill_threads).
# CANDIDATES="shared split shared-yield15" picks some; a candidate named twice runs twice
# (alternate them for an A/B on a drifting machine), its second result in <candidate>-2.json.
# SLOs: --slo-ttft-s/--slo-tpot-s from the environment (SLO_TTFT_S, SLO_TPOT_S), default
# 15 s / 0.075 s. Writes OUT_DIR/<candidate>.json (`pdserve bench run --json`).
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${1:-long}; rate=${2:-0.08}; n=${3:-24}; out=${4:-bench-results/cores}
ttft=${SLO_TTFT_S:-15}; tpot=${SLO_TPOT_S:-0.075}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out" bench-logs
port=$($py -c 'from pdserve.launcher import free_port; print(free_port())')

run_candidate() {  # name, extra `pdserve up` flags...
  local name=$1; shift
  local k=2 base=$name
  while [ -e "$out/$name.json" ]; do name=$base-$k; k=$((k + 1)); done
  echo "[cores] $name: starting pdserve up $*" >&2
  local metrics
  metrics=$($py -c 'from pdserve.launcher import free_port_block; print(free_port_block(3))')
  $py -m pdserve.cli up --port "$port" --metrics-port "$metrics" "$@" > "bench-logs/cores-$name.log" 2>&1 &
  local up=$!
  trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null' EXIT
  for _ in $(seq 600); do grep -q '^pdserve ready' "bench-logs/cores-$name.log" && break; sleep 1; done
  grep -q '^pdserve ready' "bench-logs/cores-$name.log" || { echo "[cores] $name did not start" >&2; exit 1; }
  $py -m pdserve.cli bench run --target "127.0.0.1:$port" --workload "$workload" --rate "$rate" \
      --num-requests "$n" --slo-ttft-s "$ttft" --slo-tpot-s "$tpot" --json "$out/$name.json" >&2
  # Decode's metrics (gateway +0, prefill +1, decode +2): how long it yielded to prefill.
  echo "[cores] $name: decode yielded $(curl -s "127.0.0.1:$((metrics + 2))/metrics" \
      | awk '/^pdserve_decode_yield_seconds_total/ {print $2}') s" >&2
  kill -TERM $up; wait $up || true
  trap - EXIT
}

for candidate in ${CANDIDATES:-shared split shared-normal}; do
  engine=${candidate%-quiet}
  if [ "$engine" != "$candidate" ]; then export PDSERVE_ENGINE_QUIET=1; else unset PDSERVE_ENGINE_QUIET; fi
  threads=()
  if [ "${engine%-solo}" != "$engine" ]; then engine=${engine%-solo}; threads=(--prefill-threads solo); fi
  case $engine in
    shared) run_candidate "$candidate" --cores shared "${threads[@]}" ;;
    split) run_candidate "$candidate" --cores split ;;
    shared-normal) run_candidate "$candidate" --cores shared --prefill-sched normal "${threads[@]}" ;;
    shared-yield*) run_candidate "$candidate" --cores shared --decode-yield-ms "${engine#shared-yield}" "${threads[@]}" ;;
    shared-slack) run_candidate "$candidate" --cores shared --decode-yield slack "${threads[@]}" ;;
    shared-pace) run_candidate "$candidate" --cores shared --decode-yield pace "${threads[@]}" ;;
    shared-whole) run_candidate "$candidate" --cores shared --decode-yield whole "${threads[@]}" ;;
    *) echo "[cores] unknown candidate $candidate" >&2; exit 2 ;;
  esac
done
unset PDSERVE_ENGINE_QUIET
$py - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'candidate':<16}{'attain':>8}{'ttft p50':>10}{'ttft p90':>10}{'tpot p50':>10}{'tpot p90':>10}{'tok/s':>8}")
for f in sorted(out.glob("*.json"), key=lambda f: f.stat().st_mtime):
    s = json.loads(f.read_text())["runs"][0]["summary"]
    q = lambda k, p: (s[k] or {}).get(p) or float("nan")
    print(f"{f.stem:<16}{s['slo_attainment']:>8.2f}{q('ttft_s','p50'):>10.2f}{q('ttft_s','p90'):>10.2f}"
          f"{q('tpot_s','p50')*1000:>9.0f}m{q('tpot_s','p90')*1000:>9.0f}m{s['output_tok_s']:>8.1f}")
PY
