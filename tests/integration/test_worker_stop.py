"""A worker, or `pdserve up`, stopped at any point of its start-up leaves no temp directory
and no /dev/shm file behind.

Each worker case starts a prefill worker (the tier that places its KV cache in /dev/shm)
with its own TMPDIR, waits for one stage of start-up to be visible, and stops it as `pdserve
up` stops a child: SIGTERM to its process group, SIGKILL after the launcher's grace period.
The stack case presses Ctrl-C (SIGINT) on `pdserve up` while its engines start.
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

from pdserve.launcher import STOP_GRACE_S, free_port, free_port_block
from pdserve.worker import METRICS_DIR_PREFIX

STAGE_TIMEOUT_S = 300


def _shm_files(worker_id: str) -> list[Path]:
    return [p for p in Path("/dev/shm").glob("pdserve-*") if worker_id in p.name]


# stage -> (log lines, worker id, TMPDIR) -> whether start-up has reached it
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
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"start-up never reached {stage}:\n" + "".join(log[-30:])
            )
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


def test_pdserve_up_stopped_by_ctrl_c_during_start_up_leaves_no_temp_files(model_path, tmp_path):
    metrics_port = free_port_block(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", str(free_port()), "--metrics-port", str(metrics_port),
         "--kv-cache-gib", "1", "--model", model_path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)},
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    up = psutil.Process(proc.pid)
    worker_ids: set[str] = set()
    try:
        # Both workers have their metrics directories; the prefill engine has placed its KV
        # cache in /dev/shm and is still starting (pdserve up is not ready).
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while True:
            pids = {str(p.pid) for p in up.children(recursive=True)}
            caches = [p for p in Path("/dev/shm").glob("pdserve-kvcache-*") if p.name.rsplit("-", 1)[-1] in pids]
            dirs = list(tmp_path.glob(f"{METRICS_DIR_PREFIX}*"))
            if caches and len(dirs) == 2:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log[-30:])
            time.sleep(0.05)
        worker_ids = {d.name.removeprefix(METRICS_DIR_PREFIX).split("-")[0] for d in dirs}
        assert not any(line.startswith("pdserve ready") for line in log), "stopped too late: the stack is up"
        group = [up, *up.children(recursive=True)]
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, alive = psutil.wait_procs(group, timeout=STOP_GRACE_S + 15)
        print(f"pdserve up: {len(group)} processes stopped in {time.monotonic() - stopped:.1f} s")
        assert not alive, f"still running after Ctrl-C: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert list(tmp_path.glob("pdserve-*")) == [], "".join(log[-20:])
    assert [p for wid in worker_ids for p in _shm_files(wid)] == [], "".join(log[-20:])
