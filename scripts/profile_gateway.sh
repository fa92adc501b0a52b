#!/usr/bin/env bash
# Where the gateway's CPU goes at 64 streams: `perf record` on the gateway process while the
# load of scripts/bench_gateway_cpu.sh runs (closed loop, 64 streams, 128 requests of 128
# output tokens), then the samples by shared object (the Python interpreter, grpc's cygrpc,
# the kernel, libc, protobuf, tokenizers, uvloop) and the top symbols.
#
#   scripts/profile_gateway.sh [OUT_DIR]      (default bench-results/gateway-profile)
#
# Needs perf (Debian's linux-perf); software clock sampling works where the VM has no
# hardware counters. Environment: FREQ (999 Hz), SECONDS_SAMPLED (30), and the load's
# STREAMS (64), REQUESTS (128), LOAD as in bench_gateway_cpu.sh. Writes OUT_DIR/perf.data,
# OUT_DIR/by-dso.txt and OUT_DIR/by-symbol.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v perf >/dev/null || { echo "profile_gateway: perf not found (apt-get install linux-perf)" >&2; exit 2; }
out=${1:-bench-results/gateway-profile}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out" bench-logs
port=$($py -c 'from pdserve.launcher import free_port; print(free_port())')
mport=$($py -c 'from pdserve.launcher import free_port_block; print(free_port_block(3))')
log=bench-logs/gateway-profile.log
$py -m pdserve.cli up --port "$port" --metrics-port "$mport" > "$log" 2>&1 &
up=$!
load=
cleanup() {
  [[ -z $load ]] || kill "$load" 2>/dev/null || true
  kill -TERM "$up" 2>/dev/null || true
  wait "$up" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 600); do grep -q '^pdserve ready' "$log" && break; sleep 1; done
grep -q '^pdserve ready' "$log" || { echo "profile_gateway: pdserve did not start; see $log" >&2; exit 1; }
gateway=$($py - "$up" <<'PY'
import sys, psutil
up = psutil.Process(int(sys.argv[1]))
print(next(p.pid for p in up.children(recursive=True) if "gateway" in p.cmdline()[3:5]))
PY
)
# shellcheck disable=SC2086 # LOAD is a list of arguments
$py -m pdserve.cli bench run --target "127.0.0.1:$port" --concurrency "${STREAMS:-64}" \
    --num-requests "${REQUESTS:-128}" --warmup 0 ${LOAD:---input-len-range 16:32 --output-len-range 128:128} \
    --gateway-metrics "127.0.0.1:$mport" --json "$out/load.json" > "$out/load.log" 2>&1 &
load=$!
sleep 10  # past the first prefills: the streams are decoding
echo "[profile] perf on gateway pid $gateway for ${SECONDS_SAMPLED:-30} s" >&2
perf record -q -F "${FREQ:-999}" -g -p "$gateway" -o "$out/perf.data" -- sleep "${SECONDS_SAMPLED:-30}" >&2
wait "$load"; load=
perf report -i "$out/perf.data" --no-children --sort dso --stdio -g none 2>/dev/null \
    | grep '%' > "$out/by-dso.txt"
perf report -i "$out/perf.data" --no-children --sort dso,sym --stdio -g none 2>/dev/null \
    | grep '%' | sed -n 1,40p > "$out/by-symbol.txt"  # not head: with pipefail its early exit fails the pipe
grep 'gateway CPU' "$out/load.log" >&2 || true
echo "[profile] by shared object ($out/by-dso.txt):" >&2
sed -n 1,12p "$out/by-dso.txt"
