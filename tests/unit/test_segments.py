"""pdserve.segments and the launcher's use of it: the /dev/shm segments a killed process
tree leaves behind are removed, and nothing a live process holds is."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time

from pdserve import launcher, segments
from pdserve.launcher import Child, Stack

HOLD = """
import mmap, os, sys, time
mapped = open(sys.argv[1], "r+b")
view = mmap.mmap(mapped.fileno(), 0)
mapped.close()
held = open(sys.argv[2], "rb")
print("holding", flush=True)
time.sleep(600)
"""

# What a vLLM engine does: a multiprocessing shared-memory buffer (registered with the
# resource tracker it starts in its own process group), then serve.
ENGINE = """
import signal, sys, time
from multiprocessing import shared_memory
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
shm.buf[:4] = b"pdsv"
print("READY 127.0.0.1:1", flush=True)
time.sleep(600)
"""


def test_held_segments_are_found_and_only_unheld_ones_swept(tmp_path):
    for name in ("psm_mapped", "sem.mp-open", "psm_orphan", "other_orphan"):
        (tmp_path / name).write_bytes(b"\0" * mmap.PAGESIZE)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "psm_mapped"), str(tmp_path / "sem.mp-open")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        # A mapping and an open file both count; names without vLLM's prefixes are not ours.
        assert segments.held_by([holder.pid], str(tmp_path)) == {"psm_mapped", "sem.mp-open"}
        names = ["psm_mapped", "sem.mp-open", "psm_orphan", "other_orphan", "psm_gone"]
        assert segments.sweep(names, str(tmp_path)) == ["psm_orphan"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other_orphan", "psm_mapped", "sem.mp-open"]
    finally:
        holder.kill()
        holder.wait()
    assert segments.held_by([holder.pid], str(tmp_path)) == set()  # gone: holds nothing
    assert segments.sweep(["psm_mapped", "sem.mp-open"], str(tmp_path)) == ["psm_mapped", "sem.mp-open"]


def test_a_tracker_sweeps_what_its_dead_tree_held(tmp_path):
    (tmp_path / "psm_a").write_bytes(b"\0" * mmap.PAGESIZE)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "psm_a"), os.devnull],
                              stdout=subprocess.PIPE, text=True)
    tracker = segments.SegmentTracker(str(tmp_path))
    try:
        assert holder.stdout.readline() == "holding\n"
        tracker.record([holder.pid])
        assert tracker.seen == {"psm_a"}
        assert tracker.sweep() == [] and tracker.seen == {"psm_a"}  # still held: kept, remembered
    finally:
        holder.kill()
        holder.wait()
    assert tracker.sweep() == ["psm_a"]
    assert tracker.seen == set() and not (tmp_path / "psm_a").exists()


def _shm_names(child: Child) -> set[str]:
    return {n for n in child.segments.seen if n.startswith("psm_")}


def _cleanup(child: Child) -> None:
    child.signal(signal.SIGKILL)
    if child.proc is not None:
        child.proc.wait()
    for name in child.segments.seen:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_a_killed_childs_segments_are_removed_before_it_restarts(monkeypatch):
    child = Child("decode", [sys.executable, "-c", ENGINE], restart=True)
    stack = Stack([child], "127.0.0.1:1")
    child.start({**os.environ})
    try:
        assert child.ready.wait(30)
        stack.supervise(1000.0)
        (name,) = _shm_names(child)
        # A crash of the whole group (its resource tracker too): the segment stays behind.
        child.signal(signal.SIGKILL)
        child.proc.wait()
        time.sleep(0.5)
        assert os.path.exists(f"/dev/shm/{name}")
        starts = []
        monkeypatch.setattr(Child, "start", lambda self, env: starts.append(env))
        stack.supervise(1001.0)  # seen dead: restart in 1 s
        assert os.path.exists(f"/dev/shm/{name}") and not starts
        stack.supervise(1002.5)
        assert len(starts) == 1
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        _cleanup(child)


def test_stopping_a_child_that_ignores_sigterm_leaves_no_segment(monkeypatch):
    monkeypatch.setattr(launcher, "STOP_GRACE_S", 1.0)
    child = Child("prefill", [sys.executable, "-c", ENGINE, "--ignore-term"], restart=True)
    stack = Stack([child], "127.0.0.1:1", drain_grace_s=0.0)
    child.start({**os.environ})
    try:
        assert child.ready.wait(30)
        (name,) = {n for n in segments.held_by([child.proc.pid]) if n.startswith("psm_")}
        stack.stop()  # notes its segments, SIGTERM, then SIGKILL to the group after the graces
        assert child.proc.returncode == -signal.SIGKILL
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        _cleanup(child)
