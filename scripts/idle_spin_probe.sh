#!/usr/bin/env bash
# A prompt on the prefill tier right after the decode engine finishes, per environment:
# starts `pdserve up` with each ENV (comma-separated VAR=VALUE pairs), runs
# scripts/idle_spin_probe.py against it (PAIRS pairs of a 64-token decode and a 1,400-token
# prompt sent during it), stops it; ROUNDS rounds of all environments, in turn.
#
#   ROUNDS=2 PAIRS=4 scripts/idle_spin_probe.sh PDSERVE_ENGINE_SPIN_S=1 PDSERVE_ENGINE_SPIN_S=0.2
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
mkdir -p bench-logs
port=$($py -c 'from pdserve.launcher import free_port; print(free_port())')
for round in $(seq "${ROUNDS:-1}"); do
  for spec in "$@"; do
    log=bench-logs/idle-spin-probe.log
    # shellcheck disable=SC2086
    env ${spec//,/ } $py -m pdserve.cli up --port "$port" --metrics-port 0 > "$log" 2>&1 &
    up=$!
    trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null' EXIT
    for _ in $(seq 300); do grep -q '^pdserve ready' "$log" && break; sleep 1; done
    grep -q '^pdserve ready' "$log" || { echo "pdserve up with $spec did not start: $log" >&2; exit 1; }
    echo "== round $round: $spec"
    $py scripts/idle_spin_probe.py "127.0.0.1:$port" "${PAIRS:-4}" 1400 64
    kill -INT $up; wait $up || true
    trap - EXIT
  done
done
