#!/usr/bin/env bash
# Gateway CPU per generated token (gateway process + tokenizer pool) at 64 concurrent streams,
# for two revisions of pdserve side by side (issue #8 item 6): the same `pdserve bench run`
# (closed loop, 64 streams, 128 output tokens each) against a stack of each revision.
#
#   scripts/bench_gateway_cpu.sh [BEFORE_REV] [OUT_DIR]
#   defaults:                    1c07105     bench-results/gateway-cpu
#   scripts/bench_gateway_cpu.sh --intervals [OUT_DIR]
#   scripts/bench_gateway_cpu.sh --decode-stream [OUT_DIR]
#   scripts/bench_gateway_cpu.sh --cores [OUT_DIR]
#
# The "before" revision runs from a temporary git worktree with this checkout's venv; the
# benchmark client is always this checkout's. Writes OUT_DIR/{before,after}.json.
# --intervals: this checkout twice instead, the interactive class streamed one token per
# message (the default) and four (`--stream-intervals 4,4,8`); writes
# OUT_DIR/{interval1,interval4}.json. `python -m pdserve.bench.grpc_floor` gives the
# floor of the same message counts through a bare grpc.aio relay.
# --decode-stream: this checkout twice, the gateway taking each request's tokens over a
# Decode call of its own (`--decode-stream per-request`) and over the decode worker's one
# shared DecodeStream call (`shared`, the default); OUT_DIR/{per-request,shared}.json.
# --cores: this checkout twice, both engines on every core (`--cores shared`, the default)
# and half the cores each (`--cores split`); OUT_DIR/{split,shared}.json: at 64 streams the
# decode engine is the bottleneck, so the output tok/s and TPOT mean lines compare the two.
# Each run also reports the decode worker's front-end process (gRPC and vLLM's AsyncLLM,
# not its engine's processes) per token.
# Environment: STREAMS (64), REQUESTS (128) and LOAD (the lengths: "--input-len-range 16:32
# --output-len-range 128:128") set the load; REPEATS=N (1) alternates the two sides N times
# (before, after, before, after, ...), each run named NAME-i, for drift to show as spread;
# UP_ARGS adds arguments to every `pdserve up` (e.g. "--max-model-len 4096", as the compare).
#   STREAMS=4 REQUESTS=100 LOAD="--workload short" REPEATS=2 scripts/bench_gateway_cpu.sh REV OUT
set -euo pipefail
cd "$(dirname "$0")/.."
mode=revisions
if [[ ${1:-} == --intervals ]]; then mode=intervals; shift; out=${1:-bench-results/gateway-cpu}
elif [[ ${1:-} == --decode-stream ]]; then mode=decode-stream; shift; out=${1:-bench-results/gateway-cpu}
elif [[ ${1:-} == --cores ]]; then mode=cores; shift; out=${1:-bench-results/gateway-cpu}
else before_rev=${1:-1c07105}; out=${2:-bench-results/gateway-cpu}; fi
# Absolute, without resolving links: a venv's python is a link to the system one, and only
# through the venv's path does it find the venv's packages.
py=${PYTHON:-.venv/bin/python}; py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
root=$(pwd)
mkdir -p "$out" bench-logs
tree=
cleanup() { [[ -z $tree ]] || git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"; }
trap cleanup EXIT

# shellcheck source=scripts/gateway_stack.sh
. scripts/gateway_stack.sh

measure() {  # name, source tree, extra `pdserve up` arguments
  local name=$1 src=$2; shift 2
  echo "[gateway-cpu] $name: pdserve up from $src" >&2
  start_gateway_stack "bench-logs/gateway-cpu-$name.log" "$src" "$@" || exit 1
  local up=$gw_up gw
  gw=$(gateway_pid $up)
  # The gateway's process tree (the gateway and its tokenizer pool), read the same way for
  # both revisions: the "before" gateway exports no pool CPU.
  local cpu0 dcpu0
  cpu0=$(gateway_tree_cpu $gw)
  dcpu0=$(decode_front_cpu $up)
  run_gateway_load "$out/$name.json" >&2 || true
  echo "$(gateway_tree_cpu $gw) - $cpu0" | bc > "$out/$name.tree_cpu_s"
  echo "$(decode_front_cpu $up) - $dcpu0" | bc > "$out/$name.decode_cpu_s"
  kill -TERM $up; wait $up || true
}

gateway_tree_cpu() {  # pid of the gateway -> CPU seconds of it and its children (the tokenizer pool)
  $py - "$1" <<'PY'
import sys, psutil
gw = psutil.Process(int(sys.argv[1]))
procs = [gw, *gw.children(recursive=True)]
print(sum(p.cpu_times().user + p.cpu_times().system for p in procs))
PY
}

decode_front_cpu() {  # pid of `pdserve up` -> CPU seconds of its decode worker's own process
  $py - "$1" <<'PY'
import sys, psutil
up = psutil.Process(int(sys.argv[1]))
worker = next(p for p in up.children() if "decode" in p.cmdline()[3:5])
print(worker.cpu_times().user + worker.cpu_times().system)
PY
}

repeats=${REPEATS:-1}
names=
pair() {  # name1 tree1 args1 -- name2 tree2 args2, alternated $repeats times
  local i suffix
  for i in $(seq "$repeats"); do
    suffix=$([[ $repeats == 1 ]] && echo "" || echo "-$i")
    names="$names $1$suffix $2$suffix"
    "measure_$1" "$1$suffix"
    "measure_$2" "$2$suffix"
  done
}
if [[ $mode == decode-stream ]]; then
  measure_per-request() { measure "$1" "$root" --decode-stream per-request; }
  measure_shared() { measure "$1" "$root" --decode-stream shared; }
  pair per-request shared
elif [[ $mode == cores ]]; then
  measure_split() { measure "$1" "$root" --cores split; }
  measure_shared() { measure "$1" "$root" --cores shared; }
  pair split shared
elif [[ $mode == intervals ]]; then
  measure_interval1() { measure "$1" "$root"; }
  measure_interval4() { measure "$1" "$root" --stream-intervals 4,4,8; }
  pair interval1 interval4
else
  tree=$(mktemp -d /tmp/pdserve-before.XXXXXX)
  git worktree add -q --detach "$tree" "$before_rev"
  measure_before() { measure "$1" "$tree"; }
  measure_after() { measure "$1" "$root"; }
  pair before after
fi
# shellcheck disable=SC2086 # names is a list
$py - "$out" $names <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in sys.argv[2:]:
    run = json.loads((out / f"{name}.json").read_text())["runs"][0]
    tokens = run["summary"]["output_tokens"]
    tree_s = float((out / f"{name}.tree_cpu_s").read_text())
    decode = out / f"{name}.decode_cpu_s"
    decode_s = float(decode.read_text()) if decode.exists() and decode.read_text().strip() else None
    print(f"{name}: {tree_s / tokens * 1e6:.0f} us of gateway+pool CPU per generated token "
          f"({tree_s:.1f} s / {tokens} tokens, process tree); /metrics says "
          f"{json.dumps(run.get('gateway_cpu'))}; decode worker's front end "
          + ("-" if decode_s is None else f"{decode_s / tokens * 1e6:.0f} us per token ({decode_s:.1f} s)")
          + f"; output {run['summary']['output_tok_s']:.1f} tok/s"
          + f", TPOT mean {run['summary']['tpot_s']['mean'] * 1000:.1f} ms")
PY
