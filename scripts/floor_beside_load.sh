#!/usr/bin/env bash
# The gateway's CPU per generated token and the bare grpc.aio send floor's, measured at the
# same time on the same cores: `pdserve bench run`'s 64-stream load against a `pdserve up`
# stack (as scripts/bench_gateway_cpu.sh), and, while its engines are decoding,
# `python -m pdserve.bench.grpc_floor --engine-steps` (a grpc.aio server that hands each of
# 64 open streams a token per 250 ms step, one message each: the gateway's send half with
# nothing of pdserve in it). A process's CPU per message on these VMs depends on what else
# runs (the floor alone read 83-85 µs, beside the engines 49-59 µs, minutes apart): this
# puts the two figures under one contention.
#
#   scripts/floor_beside_load.sh [OUT_DIR]      (default bench-results/floor-beside)
#
# Environment: STREAMS (64), REQUESTS (192: the load outlasts the floor), LOAD and UP_ARGS as in bench_gateway_cpu.sh;
# FLOOR_ARGS (default "--step-ms 250 --engine-steps --calls 64") for grpc_floor. Writes
# OUT_DIR/load.json (its gateway_cpu is the gateway's figure) and OUT_DIR/floor.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results/floor-beside}
py=${PYTHON:-.venv/bin/python}
export REQUESTS=${REQUESTS:-192}
mkdir -p "$out" bench-logs
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
# shellcheck source=scripts/gateway_stack.sh
. scripts/gateway_stack.sh
trap stop_gateway_stack EXIT
start_gateway_stack bench-logs/floor-beside.log "$(pwd)" || exit 1
start_background_load "$out"
echo "[floor-beside] grpc_floor ${FLOOR_ARGS:---step-ms 250 --engine-steps --calls 64} beside the load" >&2
# shellcheck disable=SC2086 # FLOOR_ARGS is a list of arguments
$py -m pdserve.bench.grpc_floor ${FLOOR_ARGS:---step-ms 250 --engine-steps --calls 64} > "$out/floor.txt"
kill -0 "$gw_load" 2>/dev/null || { echo "[floor-beside] the load ended before the floor did: raise REQUESTS" >&2; exit 1; }
wait "$gw_load"; gw_load=
grep "gateway CPU" "$out/load.log" || { echo "[floor-beside] no gateway CPU figure in $out/load.log" >&2; exit 1; }
cat "$out/floor.txt"
