"""A worker stopped at any point of its start-up leaves no temp directory and no /dev/shm
file behind.

Each case starts a prefill worker (the tier that places its KV cache in /dev/shm) with its
own TMPDIR, waits for one stage of start-up to be visible, and stops it as `pdserve up`
stops a child: SIGTERM to its process group, SIGKILL after the launcher's grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pdserve.launcher import STOP_GRACE_S
from pdserve.worker import METRICS_DIR_PREFIX

STAGE_TIMEOUT_S = 300


def _shm_files(worker_id: str) -> list[Path]:
    return [p for p in Path("/dev/shm").glob("pdserve-*") if worker_id in p.name]


# stage -> (worker_id, tmp) -> whether start-up has reached it
STAGES = {
    # The worker made its metrics directory; the engine is not started yet.
    "metrics-dir": lambda log, wid, tmp: any(tmp.glob(f"{METRICS_DIR_PREFIX}{wid}-*")),
    # The engine-core process has allocated its KV cache in /dev/shm; start-up goes on.
    "kv-cache": lambda log, wid, tmp: bool(_shm_files(wid)),
    "serving": lambda log, wid, tmp: any(line.startswith("READY ") for line in log),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_worker_stopped_during_start_up_leaves_no_temp_files(model_path, tmp_path, stage):
    worker_id = "stop" + uuid.uuid4().hex[:8]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "prefill", "--port", "0", "--cpus", "0", "--kv-cache-gib", "1",
         "--kv-transport", "shm", "--worker-id", worker_id, "--model", model_path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)},
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    group = [psutil.Process(proc.pid)]
    try:
        reached = STAGES[stage]
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while not reached(log, worker_id, tmp_path):
            assert proc.poll() is None and time.monotonic() < deadline, f"start-up never reached {stage}:\n" + "".join(log[-30:])
            time.sleep(0.05)
        group += group[0].children(recursive=True)
        stopped = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(group, timeout=STOP_GRACE_S)
        took = time.monotonic() - stopped
        print(f"{stage}: {len(group)} processes stopped in {took:.1f} s")
        assert not alive, f"still running {STOP_GRACE_S:.0f} s after SIGTERM (the launcher would SIGKILL them): {alive}"
    finally:
        for p in group:
            if p.is_running():
                p.kill()
        proc.wait(30)
    assert list(tmp_path.glob("pdserve-*")) == [], "".join(log[-20:])
    assert _shm_files(worker_id) == [], "".join(log[-20:])
