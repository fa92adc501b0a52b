#!/usr/bin/env bash
# One system under a steady short load, side by side with the other: per-process CPU and a
# py-spy profile of the busiest process (the engine's model worker), so that a TPOT gap
# between colocated vLLM and pdserve can be placed. Closed loop, so both see the same batch.
#
#   scripts/engine_profile.sh vllm|pdserve [CONCURRENCY] [REQUESTS] [OUTDIR] [-- pdserve up flags]
#
# Needs py-spy on PATH or in $PYSPY (e.g. pip install --target /tmp/pyspy-inst py-spy).
# PROFILE=0: no py-spy (it takes a core's share: TPOT 35 -> 51 ms under it); STOP_PREFILL=1:
# the prefill worker stopped while measuring; VLLM_KV=1: vLLM with pdserve's KV connector;
# VLLM_UNI=1: vLLM computing in its engine-core process (as `pdserve up --executor uni` does).
# Writes OUTDIR/SYSTEM-cpu.txt, SYSTEM-bench.txt and SYSTEM-profile.txt (collapsed stacks).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/.venv/bin:$PATH
SYSTEM=$1; C=${2:-4}; N=${3:-160}; OUT=${4:-/tmp/engine-profile}
shift $(( $# < 4 ? $# : 4 )); [ "${1:-}" = "--" ] && shift
PYSPY=${PYSPY:-$(command -v py-spy || echo /tmp/pyspy-inst/bin/py-spy)}
mkdir -p $OUT
PORT=$(python -c 'from pdserve.launcher import free_port; print(free_port())')
LOG=$OUT/$SYSTEM-server.log
MODEL=$(python -c 'from pdserve.model import default_model_path; print(default_model_path())' 2>/dev/null)
if [ "$SYSTEM" = vllm ]; then
  DTYPE=$(python -c 'from pdserve.engine import resolve_dtype; print(resolve_dtype())')
  # VLLM_KV=1: with pdserve's KV connector in the decode role, as pdserve's decode engine has it.
  KV=()
  [ "${VLLM_KV:-0}" = 1 ] && KV=(--kv-transfer-config '{"kv_connector": "PdConnector", "kv_connector_module_path": "kvtransfer.connector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"transports": ["shm"], "producer_id": "probe", "kv_timeout_s": 10, "kv_lease_s": 30}}')
  # Its own temporary directory for the socket files vLLM leaves behind (pdserve/tempdirs.py).
  ENGINE_TMP=$(mktemp -d /tmp/pdserve-engine-$$-XXXXXXXX); trap 'rm -rf "$ENGINE_TMP"' EXIT
  # VLLM_UNI=1: vLLM's uni executor kept on CPU, with the OpenMP binding its mp worker gets.
  UNI=()
  [ "${VLLM_UNI:-0}" = 1 ] && UNI=(VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=2 "OMP_PLACES={0,1}" OMP_PROC_BIND=true)
  env "${UNI[@]}" TMPDIR=$ENGINE_TMP VLLM_RPC_BASE_PATH=$ENGINE_TMP \
  PYTHONPATH=$PWD VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 python -m vllm.entrypoints.openai.api_server \
    --model $MODEL --dtype $DTYPE --block-size 32 --max-model-len 4096 --enforce-eager \
    --enable-prefix-caching --port $PORT --host 127.0.0.1 "${KV[@]}" > $LOG 2>&1 &
  TARGET=(--backend openai --base-url http://127.0.0.1:$PORT)
  READY="Application startup complete"
else
  pdserve up --port $PORT --model $MODEL --max-model-len 4096 --metrics-port 0 "$@" > $LOG 2>&1 &
  TARGET=(--target 127.0.0.1:$PORT)
  READY="^pdserve ready"
fi
UP=$!
for i in $(seq 240); do grep -q "$READY" $LOG && break; sleep 1; done
grep -q "$READY" $LOG || { echo "not ready; see $LOG"; kill -INT $UP; exit 1; }
tree() { local p=$1; echo $p; for c in $(ps -o pid= --ppid $p); do tree $c; done; }
pids=$(tree $UP)
snap() { for p in $pids; do echo "$p $(awk '{print $14+$15}' /proc/$p/stat 2>/dev/null)"; done; }
name() { tr '\0' ' ' < /proc/$1/cmdline | sed 's|^[^ ]*python3* ||' | cut -c1-60; }
bench() { pdserve bench run "${TARGET[@]}" --workload short --concurrency $C --warmup 0 "$@"; }
snap > $OUT/s0; bench --num-requests 12 > /dev/null 2>&1; snap > $OUT/s1
busiest=$(join <(sort $OUT/s0) <(sort $OUT/s1) | awk '{print $3-$2, $1}' | sort -rn | head -1 | cut -d' ' -f2)
if [ "${PROFILE:-1}" = 1 ]; then
  $PYSPY record --nonblocking -r 250 -f raw -p $busiest -o $OUT/$SYSTEM-profile.txt -d 600 > $OUT/$SYSTEM-pyspy.log 2>&1 &
  SPY=$!
fi
stat() { head -1 /proc/stat; }
# Per thread: run and runqueue-wait nanoseconds (/proc/PID/task/TID/schedstat).
threads() { for p in $pids; do for t in /proc/$p/task/*; do
  echo "$p:${t##*/} $(cat $t/schedstat 2>/dev/null | cut -d' ' -f1,2) $(tr ' ' _ < $t/comm)"; done; done; }  # cpu user nice system idle iowait irq softirq steal
# STOP_PREFILL=1: the prefill worker and its engine stopped (SIGSTOP) while measuring.
stopped=""
[ "${STOP_PREFILL:-0}" = 1 ] && for p in $pids; do
  tr '\0' ' ' < /proc/$p/cmdline | grep -q "pdserve.cli prefill" && stopped=$(tree $p); done
[ -n "$stopped" ] && kill -STOP $stopped
sleep 1; snap > $OUT/s2; threads > $OUT/t2; m0=$(stat); t0=$(date +%s.%N)
bench --num-requests $N > $OUT/$SYSTEM-bench.txt 2>&1
t1=$(date +%s.%N); m1=$(stat); snap > $OUT/s3; threads > $OUT/t3
[ -n "${SPY:-}" ] && { kill -INT $SPY; wait $SPY; }
[ -n "$stopped" ] && kill -CONT $stopped
{ echo "$SYSTEM, concurrency $C, $N requests, $(echo "$t1 - $t0" | bc) s; busiest pid $busiest (profiled: ${PROFILE:-1}; prefill stopped: ${stopped:-none})"
  echo "$m0" "$m1" | awk -v t=$(echo "$t1 - $t0" | bc) '{b=($13+$14+$15+$18+$19)-($2+$3+$4+$7+$8); s=$20-$9; printf "machine: busy %.2f cores, steal %.3f cores\n", b/100/t, s/100/t}'
  echo "ticks (1/100 s) per process, resident memory at the end:"
  join <(sort $OUT/s2) <(sort $OUT/s3) | while read p a b; do
    echo "$((b - a)) $p $(awk '/VmRSS/ {printf "%d MB", $2 / 1024}' /proc/$p/status 2>/dev/null) $(name $p)"; done | sort -rn
  echo "threads with > 0.1 s run: run s, runqueue wait s (waited while runnable), pid:tid name"
  join <(sort $OUT/t2) <(sort $OUT/t3) | awk '{r=($5-$2)/1e9; w=($6-$3)/1e9; if (r > 0.1) printf "%8.2f %8.2f %s %s\n", r, w, $1, $7}' | sort -rn
} > $OUT/$SYSTEM-cpu.txt
cat $OUT/$SYSTEM-cpu.txt; grep -E "TPOT|TTFT|throughput" $OUT/$SYSTEM-bench.txt | head -6
kill -INT $UP; wait $UP
rm -f $OUT/s0 $OUT/s1 $OUT/s2 $OUT/s3 $OUT/t2 $OUT/t3
