#!/usr/bin/env bash
# Where the Python time of pdserve's gateway and decode worker goes under a steady load:
# cProfile of each process's main thread (its event loop) over one closed-loop
# `pdserve bench run`, not over start-up.
#
#   scripts/cprofile_stack.sh [STREAMS] [REQUESTS] [OUT_DIR] [-- pdserve up flags]
#   defaults:                  4         80         bench-results/cprofile
#
# A sitecustomize on PYTHONPATH gives every Python process of the stack a profiler that
# SIGUSR1 starts and SIGUSR2 stops and writes to OUT_DIR/PROCESS-PID.prof; the script signals
# the gateway and the decode worker around the measured run and prints each one's functions
# by own time and by cumulative time. cProfile slows what it profiles (about 2x here): read
# the shares, not the seconds. Writes OUT_DIR/{server.log,bench.txt,*.prof,*.txt}.
set -euo pipefail
cd "$(dirname "$0")/.."
streams=${1:-4}; requests=${2:-80}; out=${3:-bench-results/cprofile}
shift $(( $# < 3 ? $# : 3 )); [[ ${1:-} == -- ]] && shift
py=${PYTHON:-.venv/bin/python}; py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
mkdir -p "$out"; out=$(cd "$out" && pwd)
hook=$(mktemp -d /tmp/pdserve-cprofile.XXXXXX)
up=
cleanup() { [[ -z $up ]] || { kill -INT "$up" 2>/dev/null; wait "$up" || true; }; rm -rf "$hook"; }
trap cleanup EXIT
cat > "$hook/sitecustomize.py" <<'PY'
import os
import signal
import sys

if os.environ.get("PDSERVE_CPROFILE_DIR"):
    import cProfile

    _profile = cProfile.Profile()
    _role = next((a for a in sys.argv[1:3] if a in ("gateway", "decode", "prefill", "up")), "python")

    def _start(signum, frame):
        _profile.enable()

    def _stop(signum, frame):
        _profile.disable()
        _profile.dump_stats(os.path.join(os.environ["PDSERVE_CPROFILE_DIR"], f"{_role}-{os.getpid()}.prof"))

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
PY
port=$($py -c 'from pdserve.ports import free_port; print(free_port())')
PDSERVE_CPROFILE_DIR=$out PYTHONPATH="$hook:$(pwd)" $py -m pdserve.cli up --port "$port" --metrics-port 0 "$@" \
    > "$out/server.log" 2>&1 &
up=$!
for _ in $(seq 300); do grep -q '^pdserve ready' "$out/server.log" && break; sleep 1; done
grep -q '^pdserve ready' "$out/server.log" || { echo "[cprofile] the stack did not start; see $out/server.log" >&2; exit 1; }
pids=$(ps -o pid=,args= --ppid "$up" | awk '/pdserve.cli (gateway|decode) /{print $1}')
bench() { PYTHONPATH="$(pwd)" $py -m pdserve.cli bench run --target "127.0.0.1:$port" --workload short \
    --concurrency "$streams" --warmup 0 "$@"; }
bench --num-requests 12 > /dev/null 2>&1  # warm
rm -f "$out"/*.prof
# shellcheck disable=SC2086 # pids is a list
kill -USR1 $pids
bench --num-requests "$requests" > "$out/bench.txt" 2>&1
# shellcheck disable=SC2086
kill -USR2 $pids
for _ in $(seq 20); do [[ $(ls "$out"/*.prof 2>/dev/null | wc -l) -ge 2 ]] && break; sleep 0.5; done
grep -E "ok in|TPOT " "$out/bench.txt"
for prof in "$out"/*.prof; do
  $py - "$prof" <<'PY' | tee "${prof%.prof}.txt"
import pstats, sys
stats = pstats.Stats(sys.argv[1])
total = sum(v[2] for v in stats.stats.values())
print(f"== {sys.argv[1]}: {total:.2f} s of Python time in its main thread")
stats.sort_stats("tottime").print_stats(15)
stats.sort_stats("cumulative").print_stats(25)
PY
done
