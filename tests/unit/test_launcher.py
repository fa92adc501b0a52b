"""pdserve.launcher: the children `pdserve up` starts, core allocation, supervision."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from pdserve import launcher
from pdserve.launcher import Child, Stack, build_stack, core_split


def up_args(**kw) -> argparse.Namespace:
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["up", "--model", "/m", *kw.pop("argv", [])])
    return args


def test_core_allocation():
    cores = sorted(os.sched_getaffinity(0))
    every = ",".join(map(str, cores))
    assert core_split("shared") == (every, every)
    if len(cores) >= 2:
        half = len(cores) // 2
        assert core_split("split") == (",".join(map(str, cores[:half])), ",".join(map(str, cores[half:])))


def test_up_starts_the_gateway_then_workers_that_register_with_it():
    stack = build_stack(up_args(argv=["--port", "6000", "--metrics-port", "9000", "--prefill", "2", "--decode", "1"]))
    names = [c.name for c in stack.children]
    assert names == ["gateway", "prefill0", "prefill1", "decode"]
    assert stack.gateway_address == "127.0.0.1:6000"
    for child in stack.children[1:]:
        argv = child.argv
        assert argv[argv.index("--gateway") + 1] == "127.0.0.1:6000" and child.restart
    metrics = [c.argv[c.argv.index("--metrics-port") + 1] for c in stack.children]
    assert metrics == ["9000", "9001", "9002", "9003"]
    # Shared cores by default: prefill engines at idle priority, decode at normal.
    assert [c.argv[c.argv.index("--sched") + 1] for c in stack.children[1:3]] == ["idle", "idle"]
    assert "--sched" not in stack.children[3].argv
    assert "--prefill" not in stack.children[0].argv  # no static worker list: they register


def test_every_child_drains_for_the_stacks_grace():
    for argv, grace in (([], "30.0"), (["--drain-grace-s", "90"], "90.0")):
        stack = build_stack(up_args(argv=argv))
        assert [c.argv[c.argv.index("--drain-grace-s") + 1] for c in stack.children] == [grace] * 3
        assert stack.drain_grace_s == float(grace)


def test_a_negative_drain_grace_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(launcher, "build_stack", lambda args: pytest.fail("started a stack"))
    with pytest.raises(ValueError, match="--drain-grace-s must be >= 0, got -1.0"):
        launcher.up(up_args(argv=["--drain-grace-s", "-1"]))


def test_a_child_that_ignores_sigterm_is_killed_after_its_drain_grace_and_the_stop_grace(monkeypatch):
    monkeypatch.setattr(launcher, "STOP_GRACE_S", 0.5)
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('READY 127.0.0.1:1', flush=True); time.sleep(60)")
    child = Child("decode", [sys.executable, "-c", stubborn], restart=True)
    stack = Stack([child], "127.0.0.1:1", drain_grace_s=1.5)
    child.start({**os.environ})
    try:
        assert child.ready.wait(30)
        started = time.monotonic()
        stack.stop()
        took = time.monotonic() - started
        assert child.proc.returncode == -signal.SIGKILL
        assert 2.0 <= took < 10.0, f"killed after {took:.1f} s, not after 1.5 + 0.5 s"
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def test_the_workers_are_told_to_stop_only_once_the_gateway_has_finished(tmp_path):
    """A stopping stack: SIGTERM to the gateway alone; it takes 1 s to finish its calls
    (queued ones need workers that still serve), and only once it has exited are the
    workers told. Each child writes when it got SIGTERM and when it exited."""
    def script(name: str, drain_s: float) -> str:
        return (f"import signal, sys, time\n"
                f"def stop(*_):\n"
                f"    open({str(tmp_path / name)!r}, 'a').write(f'term {{time.monotonic()}}\\n')\n"
                f"    time.sleep({drain_s})\n"
                f"    open({str(tmp_path / name)!r}, 'a').write(f'exit {{time.monotonic()}}\\n')\n"
                f"    sys.exit(0)\n"
                f"signal.signal(signal.SIGTERM, stop)\n"
                f"print('READY 127.0.0.1:1', flush=True)\n"
                f"time.sleep(60)\n")

    children = [Child("gateway", [sys.executable, "-c", script("gateway", 1.0)]),
                Child("prefill-0", [sys.executable, "-c", script("prefill-0", 0.0)], restart=True),
                Child("decode-0", [sys.executable, "-c", script("decode-0", 0.0)], restart=True)]
    stack = Stack(children, "127.0.0.1:1", drain_grace_s=5.0)
    stack.start()
    try:
        assert all(c.ready.wait(30) for c in children)
        stack.stop()
        assert [c.proc.returncode for c in children] == [0, 0, 0]
        times = {c.name: dict(line.split() for line in (tmp_path / c.name).read_text().splitlines())
                 for c in children}
        gateway_exit = float(times["gateway"]["exit"])
        assert float(times["gateway"]["term"]) + 1.0 <= gateway_exit
        for worker in ("prefill-0", "decode-0"):
            assert float(times[worker]["term"]) >= gateway_exit, times
    finally:
        for c in children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


def test_workers_compute_in_their_engine_core_process_unless_told_otherwise():
    for argv, executor in (([], "uni"), (["--executor", "mp"], "mp")):
        workers = build_stack(up_args(argv=argv)).children[1:]
        assert [c.argv[c.argv.index("--executor") + 1] for c in workers] == [executor, executor]


def test_split_cores_run_no_engine_at_idle_priority():
    stack = build_stack(up_args(argv=["--cores", "split"]))
    assert all("--sched" not in c.argv for c in stack.children)


def test_a_dead_child_is_restarted_after_a_growing_backoff(monkeypatch):
    starts = []
    child = Child("decode", [sys.executable, "-c", "raise SystemExit(1)"], restart=True)
    monkeypatch.setattr(Child, "start", lambda self, env: (starts.append(env), setattr(self, "started_s", now[0])))
    monkeypatch.setattr(Child, "alive", lambda self: False)
    monkeypatch.setattr(launcher, "_reap_group", lambda c: None)
    stack = Stack([child], "127.0.0.1:1")
    now = [100.0]
    child.started_s, child.env = 100.0, {"A": "1"}

    def tick(t: float) -> int:
        now[0] = t
        stack.supervise(t)
        return len(starts)

    # Died at once: restarts after 1 s, then 2 s, then 4 s.
    assert [tick(100.5), tick(101.4), tick(101.6)] == [0, 0, 1]
    assert [tick(101.7), tick(103.6), tick(103.8)] == [1, 1, 2]
    assert [tick(103.9), tick(107.8), tick(108.0)] == [2, 2, 3]
    # Up for a minute before dying again: back to the shortest delay.
    assert [tick(170.0), tick(171.1)] == [3, 4]
    assert starts[-1] == {"A": "1"}


def test_up_refuses_an_empty_decode_tier_and_serves_without_a_prefill_tier():
    with pytest.raises(ValueError, match="--decode needs at least one worker"):
        launcher.up(up_args(argv=["--decode", "0"]))
    for cores in ("shared", "split"):
        stack = build_stack(up_args(argv=["--prefill", "0", "--cores", cores]))
        assert [c.name for c in stack.children] == ["gateway", "decode"]
        decode = stack.children[1].argv
        assert decode[decode.index("--cpus") + 1] == core_split("shared")[1]  # every core


def test_on_a_gpu_machine_each_tier_gets_its_gpu(monkeypatch):
    monkeypatch.setattr(launcher.gpus, "visible_gpus", lambda: ["0", "1"])
    stack = build_stack(up_args())
    prefill, decode = stack.children[1], stack.children[2]
    assert (prefill.env_overrides, decode.env_overrides) == ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"})
    assert all(c.argv[c.argv.index("--gpu-memory-utilization") + 1] == "0.9" for c in (prefill, decode))
    assert all("--cpus" not in c.argv and "--sched" not in c.argv for c in (prefill, decode))


class BrokenStderr:
    """Our stderr after whoever started `pdserve up` exited: every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_child_whose_output_cannot_be_relayed_is_still_drained(monkeypatch):
    """256 KiB of output (four pipe buffers) and then READY: without anyone reading the
    pipe the child would block on its first full buffer and never exit."""
    monkeypatch.setattr(sys, "stderr", BrokenStderr())
    script = "import sys\nfor _ in range(4096): print('x' * 63)\nprint('READY 127.0.0.1:1')"
    child = Child("decode", [sys.executable, "-c", script])
    child.start({**os.environ})
    try:
        assert child.proc.wait(timeout=30) == 0
        assert child.ready.wait(5)
    finally:
        child.signal(signal.SIGKILL)


def test_up_stops_its_stack_when_stderr_is_gone(monkeypatch):
    events = []

    class FakeStack:
        gateway_address = "127.0.0.1:1"

        def start(self):
            events.append("start")

        def wait_ready(self, timeout_s):
            raise TimeoutError("not ready")

        def stop(self):
            events.append("stop")

    monkeypatch.setattr(launcher, "build_stack", lambda args: FakeStack())
    monkeypatch.setattr(launcher.signal, "signal", lambda *a: None)
    monkeypatch.setattr(sys, "stderr", BrokenStderr())
    args = SimpleNamespace(prefill=1, decode=1, ready_timeout_s=5.0, drain_grace_s=30.0)
    with pytest.raises(BrokenPipeError):  # reporting the failure itself could not be done
        launcher.up(args)
    assert events == ["start", "stop"]


def test_a_dead_child_is_restarted_when_stderr_is_gone(monkeypatch):
    starts = []
    child = Child("decode", [sys.executable, "-c", "pass"], restart=True)
    monkeypatch.setattr(Child, "start", lambda self, env: starts.append(env))
    monkeypatch.setattr(Child, "alive", lambda self: False)
    monkeypatch.setattr(launcher, "_reap_group", lambda c: None)
    monkeypatch.setattr(sys, "stderr", BrokenStderr())
    stack = Stack([child], "127.0.0.1:1")
    child.started_s = 100.0
    stack.supervise(100.5)  # reports the exit (to nowhere) and schedules the restart
    stack.supervise(101.6)
    assert len(starts) == 1


def test_a_decode_yield_gives_both_workers_one_core_share_word(monkeypatch):
    from kvtransfer import coreshare

    monkeypatch.setattr(launcher, "gpus", SimpleNamespace(visible_gpus=lambda: [], assign=lambda *a: None))
    stack = build_stack(up_args(argv=["--decode-yield-ms", "15"]))
    envs = {c.name: c.env_overrides for c in stack.children}
    word = launcher.core_share_path()
    assert stack.core_share_file == word
    for name in ("prefill", "decode"):
        assert envs[name] == {coreshare.ENV_FILE: word, coreshare.ENV_YIELD_MS: "15.0"}
    assert coreshare.ENV_FILE not in envs["gateway"]
    stack = build_stack(up_args(argv=["--decode-yield", "slack"]))
    assert {c.name: c.env_overrides.get(coreshare.ENV_YIELD_MS) for c in stack.children} == {
        "gateway": None, "prefill": "slack", "decode": "slack"}
    for mode in ("pace", "whole"):
        stack = build_stack(up_args(argv=["--decode-yield", mode]))
        assert {c.name: c.env_overrides.get(coreshare.ENV_YIELD_MS) for c in stack.children} == {
            "gateway": None, "prefill": mode, "decode": mode}
    with pytest.raises(ValueError, match="drop --decode-yield-ms"):
        build_stack(up_args(argv=["--decode-yield", "whole", "--decode-yield-ms", "15"]))
    # Off by default, and meaningless with a core each.
    for argv in ([], ["--cores", "split", "--decode-yield-ms", "15"], ["--cores", "split", "--decode-yield", "slack"],
                 ["--cores", "split", "--decode-yield", "whole"]):
        stack = build_stack(up_args(argv=argv))
        assert stack.core_share_file is None
        assert all(coreshare.ENV_FILE not in c.env_overrides for c in stack.children)


def test_prefill_threads_solo_gives_both_workers_the_word_and_the_mode(monkeypatch):
    from kvtransfer import coreshare, prefill_threads

    monkeypatch.setattr(launcher, "gpus", SimpleNamespace(visible_gpus=lambda: [], assign=lambda *a: None))
    stack = build_stack(up_args(argv=["--prefill-threads", "solo"]))
    envs = {c.name: c.env_overrides for c in stack.children}
    for name in ("prefill", "decode"):
        assert envs[name] == {coreshare.ENV_FILE: stack.core_share_file, prefill_threads.ENV_PREFILL_THREADS: "solo"}
    assert envs["gateway"] == {}
    stack = build_stack(up_args(argv=["--prefill-threads", "solo", "--cores", "split"]))
    assert all(c.env_overrides == {} for c in stack.children)  # a core each: nothing shared
