#!/usr/bin/env bash
# Prefill beside decode on real engines, for each set of `pdserve up` flags given: starts
# `pdserve up` with every prompt through the prefill tier (--local-prefill-max-tokens 0
# --rescue-prefill-max-tokens 0) plus the flags, runs scripts/solo_probe.py against it
# (PROBE_N prompts of 1,400 tokens alone, then PROBE_N beside two decoding requests), stops it.
#
#   scripts/solo_probe.sh FLAGS...      each FLAGS comma-separated, e.g. --decode-yield,whole
#   PROBE_N=3 scripts/solo_probe.sh --prefill-threads,team --decode-yield,whole,--prefill-threads,solo
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
mkdir -p bench-logs
port=$($py -c 'from pdserve.launcher import free_port; print(free_port())')
for spec in "$@"; do
  flags=${spec//,/ }
  log=bench-logs/solo-probe.log
  # shellcheck disable=SC2086
  $py -m pdserve.cli up --port "$port" --metrics-port 0 --local-prefill-max-tokens 0 \
      --rescue-prefill-max-tokens 0 $flags > "$log" 2>&1 &
  up=$!
  trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null' EXIT
  for _ in $(seq 300); do grep -q '^pdserve ready' "$log" && break; sleep 1; done
  grep -q '^pdserve ready' "$log" || { echo "pdserve up $flags did not start: $log" >&2; exit 1; }
  echo "== pdserve up $flags"
  $py scripts/solo_probe.py "127.0.0.1:$port" "${PROBE_N:-4}" 1400
  kill -INT $up; wait $up || true
  trap - EXIT
done
