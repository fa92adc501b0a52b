#!/usr/bin/env bash
# The KV transports on a real NVIDIA GPU, on a machine that has PyTorch with CUDA but no vLLM
# (the lent H200 here: nothing can be installed there, and vLLM's CUDA wheel is too large to
# carry). It proves what needs no engine: the cuda_ipc transport between two processes, bit
# for bit, and how fast it moves a prompt's KV against a device-to-device copy of the same
# bytes (issue #10's yardstick: cuda_ipc >= 0.8x memcpy at 4,096 tokens). The engine-level
# GPU check (greedy identity, bench compare) stays scripts/device_check.sh, which needs vLLM.
#
#   scripts/device_kv_check.sh        # PYTHON=python3; OUT=dir for the logs and bench_kv.json
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-.}
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', \
torch.cuda.device_count(), torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())" \
  || exit 1
# --noconftest: tests/unit/conftest.py imports the bench driver (grpc stubs), not needed here.
timeout 240 "$PY" -m pytest --noconftest -p no:cacheprovider -q -rs \
  tests/unit/test_kv_transports.py 2>&1 | tee "$OUT_DIR/unit_kv_transports.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for transports in cuda_ipc tcp; do
  # `pdserve bench kv` without pdserve.cli, whose other commands import the grpc stubs
  # (generated for a newer grpcio than such a machine may have).
  timeout 180 "$PY" -c 'import argparse, sys; from kvtransfer import bench
p = argparse.ArgumentParser(); bench.add_arguments(p); sys.exit(bench.run(p.parse_args()))' \
    --device cuda --transports "$transports" --sizes "${SIZES:-128,1024,4096,16384}" \
    --repeats "${REPEATS:-7}" --json > "$OUT_DIR/bench_kv_$transports.json" || status=1
  "$PY" - "$OUT_DIR/bench_kv_$transports.json" <<'PY' || status=1
import json, sys
from kvtransfer.bench import Result, format_table
print(format_table([Result(**r) for r in json.load(open(sys.argv[1]))["results"]]))
PY
done
exit $status
