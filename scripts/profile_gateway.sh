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
# STREAMS (64), REQUESTS (128), LOAD and UP_ARGS as in bench_gateway_cpu.sh. Writes OUT_DIR/perf.data,
# OUT_DIR/by-dso.txt and OUT_DIR/by-symbol.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v perf >/dev/null || { echo "profile_gateway: perf not found (apt-get install linux-perf)" >&2; exit 2; }
out=${1:-bench-results/gateway-profile}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out" bench-logs
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
# shellcheck source=scripts/gateway_stack.sh
. scripts/gateway_stack.sh
log=bench-logs/gateway-profile.log
trap stop_gateway_stack EXIT
start_gateway_stack "$log" "$(pwd)" || exit 1
gateway=$(gateway_pid "$gw_up")
start_background_load "$out"
echo "[profile] perf on gateway pid $gateway for ${SECONDS_SAMPLED:-30} s" >&2
perf record -q -F "${FREQ:-999}" -g -p "$gateway" -o "$out/perf.data" -- sleep "${SECONDS_SAMPLED:-30}" >&2
wait "$gw_load"; gw_load=
perf report -i "$out/perf.data" --no-children --sort dso --stdio -g none 2>/dev/null \
    | grep '%' > "$out/by-dso.txt"
perf report -i "$out/perf.data" --no-children --sort dso,sym --stdio -g none 2>/dev/null \
    | grep '%' | sed -n 1,40p > "$out/by-symbol.txt"  # not head: with pipefail its early exit fails the pipe
grep 'gateway CPU' "$out/load.log" >&2 || true
echo "[profile] by shared object ($out/by-dso.txt):" >&2
sed -n 1,12p "$out/by-dso.txt"
