"""vLLM's shared-memory segments in /dev/shm: which ones a process tree holds, and the
removal of those it left behind when it was killed.

A vLLM engine creates its message queues' buffers there (``psm_*``, 160-240 MB each, written
to, so they hold memory) and multiprocessing's named semaphores (``sem.mp-*``); a clean exit
unlinks them, through the creator or its multiprocessing resource tracker. A process group
killed with SIGKILL (a stop past its grace period, a crashed worker's group reaped before a
restart) takes the tracker with it, and nothing else ever removes them: seen on this
project's machine, 236 segments left by a day of test runs.

Only names a tracked tree was seen holding are ever removed, and only once no process
holds them (maps or has them open): another program's segment, or one a live engine still
uses, is never touched. pdserve's own KV segments are not matched here; kvtransfer/shm.py
keeps those, with their leases.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

SHM_DIR = "/dev/shm"
# multiprocessing.shared_memory's names (vLLM's queues) and multiprocessing's semaphores.
PREFIXES = ("psm_", "sem.mp-")


def _is_tracked_name(name: str) -> bool:
    return name.startswith(PREFIXES) and "/" not in name


def held_by(pids: Iterable[int], shm_dir: str = SHM_DIR) -> set[str]:
    """Names in ``shm_dir`` (with a tracked prefix) that these processes map or hold open.
    A process that is gone, or cannot be read, holds nothing."""
    names: set[str] = set()
    prefix = shm_dir.rstrip("/") + "/"
    for pid in pids:
        for path in _paths_of(pid):
            if path.startswith(prefix):
                name = path[len(prefix):].removesuffix(" (deleted)")
                if _is_tracked_name(name):
                    names.add(name)
    return names


def _paths_of(pid: int) -> list[str]:
    """The files a process maps (/proc/PID/maps) and has open (/proc/PID/fd)."""
    paths = []
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6:
                    paths.append(parts[5])
    fd_dir = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                paths.append(os.readlink(f"{fd_dir}/{fd}"))
    return paths


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def sweep(names: Iterable[str], shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks those of ``names`` that still exist and that no process holds; returns them
    (sorted). One pass over every process's maps and open files."""
    candidates = {n for n in names if _is_tracked_name(n) and os.path.exists(os.path.join(shm_dir, n))}
    if not candidates:
        return []
    still_held = held_by(_all_pids(), shm_dir) & candidates
    removed = []
    for name in sorted(candidates - still_held):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
    return removed


@dataclass
class SegmentTracker:
    """The segments one supervised process tree has been seen holding, so that they can be
    removed once it is gone (`sweep`). ``record`` is cheap (a few /proc reads per process):
    a supervisor calls it now and then while the tree runs, since a dead process's holdings
    can no longer be read."""

    shm_dir: str = SHM_DIR
    seen: set[str] = field(default_factory=set)

    def record(self, pids: Iterable[int]) -> None:
        self.seen |= held_by(pids, self.shm_dir)

    def sweep(self) -> list[str]:
        """Removes the recorded segments nobody holds any more; forgets those gone."""
        removed = sweep(self.seen, self.shm_dir)
        self.seen = {n for n in self.seen if os.path.exists(os.path.join(self.shm_dir, n))}
        return removed
