"""Temporary directories a process owns for the engines it starts: made at start, removed
when it stops, and swept by the next one when it was killed.

- the metrics directory (``pdserve-metrics-WORKER-PID-*``): PROMETHEUS_MULTIPROC_DIR of a
  worker's engine processes, which record our KV transfer metrics there;
- the engine directory (``pdserve-engine-PID-*``): TMPDIR and VLLM_RPC_BASE_PATH of a vLLM
  engine's processes. vLLM binds its ZMQ sockets as files in VLLM_RPC_BASE_PATH (the temp
  directory by default), writes its torch.distributed file store to the temp directory,
  and removes neither when it stops: a prefill worker stopped with SIGTERM once serving left
  7 socket files in its TMPDIR (tests/integration/test_worker_stop.py, "serving", run with
  6da4347's worker.py), and every engine start of the tests and benchmarks added its own.

Both names carry the owner's pid: `sweep_orphans` removes those whose owner is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

METRICS_DIR_PREFIX = "pdserve-metrics-"
ENGINE_DIR_PREFIX = "pdserve-engine-"
# A directory's name: its prefix, [worker id-,] owner pid, TemporaryDirectory's random part.
_OWNED = re.compile(rf"^(?:{METRICS_DIR_PREFIX}[^-]+|{ENGINE_DIR_PREFIX[:-1]})-(\d+)-[^-]+$")
# A Unix socket's path holds 107 bytes (sun_path less its NUL); vLLM names its sockets
# "<VLLM_RPC_BASE_PATH>/<uuid4>".
UNIX_SOCKET_PATH_MAX = 107
VLLM_SOCKET_NAME_LEN = 1 + 36
# TemporaryDirectory's random suffix.
_RANDOM_LEN = 8
# Where an engine directory goes when the temp directory's path is too long for sockets.
SHORT_TMP = "/tmp"


def metrics_dir(worker_id: str) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=f"{METRICS_DIR_PREFIX}{worker_id}-{os.getpid()}-")


def engine_dir() -> tempfile.TemporaryDirectory:
    """A directory for one engine's sockets and files, in the temp directory unless vLLM's
    socket paths in it would not fit a Unix socket's path (then in /tmp)."""
    prefix = f"{ENGINE_DIR_PREFIX}{os.getpid()}-"
    return tempfile.TemporaryDirectory(prefix=prefix, dir=engine_dir_parent(tempfile.gettempdir(), prefix))


def engine_dir_parent(tmp: str, prefix: str) -> str:
    path_len = len(os.fsencode(tmp)) + 1 + len(prefix) + _RANDOM_LEN + VLLM_SOCKET_NAME_LEN
    return tmp if path_len <= UNIX_SOCKET_PATH_MAX else SHORT_TMP


def engine_env(path: str) -> dict[str, str]:
    """What an engine's processes need in their environment to keep their files in ``path``."""
    return {"TMPDIR": path, "VLLM_RPC_BASE_PATH": path}


def use_engine_dir(path: str) -> None:
    """This process's engine (and every process it starts) keeps its files in ``path``."""
    os.environ.update(engine_env(path))
    tempfile.tempdir = path  # tempfile has read TMPDIR once already; forked children inherit this


@contextlib.contextmanager
def engine_dir_of_this_process():
    """For a script that runs vLLM's ``LLM`` in its own process: the engine it starts keeps
    its sockets and files in an engine directory of this process, removed on leaving (the
    environment and the temp directory as they were). Without it each run of
    scripts/vllm_speed.py left vLLM's socket files in the temp directory."""
    saved_env = {key: os.environ.get(key) for key in engine_env("")}
    saved_tempdir = tempfile.tempdir
    with engine_dir() as path:
        use_engine_dir(path)
        try:
            yield path
        finally:
            tempfile.tempdir = saved_tempdir
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def sweep_orphans(parents: list[str] | None = None) -> list[str]:
    """Removes the directories above whose owner is no longer running (killed before it
    could clean up), in ``parents`` (default: the temp directory and /tmp). Run by a
    starting worker and by `pdserve up` when it stops."""
    import psutil

    removed = []
    for parent in dict.fromkeys(parents or [tempfile.gettempdir(), SHORT_TMP]):
        for path in Path(parent).glob("pdserve-*"):
            owned = _OWNED.match(path.name)
            if owned is None or not path.is_dir():
                continue
            try:
                alive = psutil.Process(int(owned.group(1))).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    return removed
