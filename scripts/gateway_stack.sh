# Sourced by scripts/bench_gateway_cpu.sh, profile_gateway.sh and floor_beside_load.sh: a
# `pdserve up` stack on free ports, its gateway's pid, and the 64-stream load they measure
# (in the foreground, or in the background while something else is measured beside it).
# The caller sets `py` (an absolute path to the venv's python) before sourcing.

gw_port=
gw_mport=
gw_up=
gw_load=

start_gateway_stack() {  # log, source tree, extra `pdserve up` arguments -> gw_port, gw_mport, gw_up
  local log=$1 src=$2; shift 2
  gw_port=$($py -c 'from pdserve.ports import free_port; print(free_port())')
  gw_mport=$($py -c 'from pdserve.ports import free_port_block; print(free_port_block(3))')
  # shellcheck disable=SC2086 # UP_ARGS is a list of arguments
  (cd "$src" && PYTHONPATH="$src" exec $py -m pdserve.cli up --port "$gw_port" --metrics-port "$gw_mport" \
      ${UP_ARGS:-} "$@") > "$log" 2>&1 &
  gw_up=$!
  local _
  for _ in $(seq 600); do
    grep -q '^pdserve ready' "$log" && return 0
    kill -0 "$gw_up" 2>/dev/null || break
    sleep 1
  done
  echo "[gateway] pdserve up from $src did not start; see $log" >&2
  kill -TERM "$gw_up" 2>/dev/null || true
  return 1
}

gateway_pid() {  # pid of `pdserve up` -> pid of its gateway process
  $py - "$1" <<'PY'
import sys, psutil
up = psutil.Process(int(sys.argv[1]))
print(next(p.pid for p in up.children(recursive=True) if "gateway" in p.cmdline()[3:5]))
PY
}

run_gateway_load() {  # json path: the closed-loop load against the stack started last
  # shellcheck disable=SC2086 # LOAD is a list of arguments
  PYTHONPATH="$(pwd)" $py -m pdserve.cli bench run --target "127.0.0.1:$gw_port" --concurrency "${STREAMS:-64}" \
      --num-requests "${REQUESTS:-128}" --warmup 0 ${LOAD:---input-len-range 16:32 --output-len-range 128:128} \
      --gateway-metrics "127.0.0.1:$gw_mport" --json "$1"
}

start_background_load() {  # out dir -> gw_load: the load, writing OUT/load.json and OUT/load.log
  run_gateway_load "$1/load.json" > "$1/load.log" 2>&1 &
  gw_load=$!
  sleep 10  # past the first prefills: the streams are decoding
}

stop_gateway_stack() {  # the background load and the stack, whichever are still running (an EXIT trap)
  [[ -z $gw_load ]] || kill "$gw_load" 2>/dev/null || true
  [[ -z $gw_up ]] || { kill -TERM "$gw_up" 2>/dev/null; wait "$gw_up" 2>/dev/null; } || true
}
