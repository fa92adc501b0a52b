#!/bin/bash
# One `pdserve up` (this checkout, default flags), one `pdserve bench run` against it, then
# the stack stopped: for a load the compare does not give (a closed loop, one request at a
# time). Run from the checkout to measure (a worktree of another commit measures that one).
#
#   flock /tmp/pdserve-cpu.lock scripts/stack_run.sh OUT [bench run flags...]
#
# Writes OUT.json (with every request's timeline), OUT.out (the bench's table) and
# OUT-up.log (the stack's log: the gateway's placements and moves). Example, the long
# prompts one at a time with the long compare's objectives:
#
#   scripts/stack_run.sh /tmp/c1 --workload long --concurrency 1 --num-requests 10 \
#       --slo-ttft-s 6.9 --slo-tpot-s 0.076
set -eu
out=$1
shift
port=${PORT:-50071}
python=${PYTHON:-.venv/bin/python}
"$python" -m pdserve.cli up --port "$port" --metrics-port 0 > "$out-up.log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up' EXIT
for _ in $(seq 1 150); do
    grep -q "pdserve ready" "$out-up.log" && break
    kill -0 $up 2>/dev/null || { echo "pdserve up exited; see $out-up.log" >&2; exit 1; }
    sleep 2
done
grep -q "pdserve ready" "$out-up.log" || { echo "pdserve up not ready in 300 s; see $out-up.log" >&2; exit 1; }
"$python" -m pdserve.cli bench run --target "127.0.0.1:$port" --save-records --json "$out.json" "$@" \
    > "$out.out" 2>&1
tail -n 12 "$out.out"
echo "moves: $(grep -c 'did not answer' "$out-up.log" || true) ($out-up.log)"
