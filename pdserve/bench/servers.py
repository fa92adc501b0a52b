"""Starting and stopping the servers under test (``pdserve up``, vLLM's OpenAI server).

A server runs in its own session (process group), its output teed to a log file. Ready
means either a log line that matches (pdserve prints "ready" with its address) or an
HTTP health URL that answers 200 (vLLM's ``/health``). Stopping sends SIGTERM to the
group, waits, then SIGKILLs what is left, including descendants that moved to a session
of their own: each benchmark must start on an idle machine, and a leftover engine would
hold cores and memory through the next system's run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.ports import free_port  # noqa: F401 (the harness and its scripts import it here)
from pdserve.segments import SegmentTracker


# The signals that stop a bench command (Ctrl-C, and SIGTERM through `cli.stop_on_sigterm`).
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def start_quiet_thread(target, *args: object) -> threading.Thread:
    """A daemon thread that never takes SIGINT or SIGTERM, so that the kernel hands them to
    the main thread, the only one where Python runs their handlers. Taken by a helper thread
    blocked in a read, the handler waits for the main thread's next bytecode, which a main
    thread asleep in epoll does not run: in the test of it, a bench command asleep for
    600 s whose server's output pump took SIGTERM was still running 30 s later. The mask
    is set before the thread starts, so no signal finds it unmasked."""
    thread = threading.Thread(target=target, args=args, daemon=True)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        thread.start()  # a new thread inherits its creator's mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return thread


class ServerError(RuntimeError):
    """The server under test did not start or answer; the message says what it printed."""


@dataclass(slots=True)
class ServerSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the inherited environment
    ready_pattern: str | None = None  # regex searched in each output line
    health_url: str | None = None
    # After the ready line, also wait for gRPC health (service "") to say SERVING.
    grpc_health_target: str | None = None
    boot_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    # A vLLM server: it runs with its own temporary directory (pdserve/tempdirs.py), removed
    # when it stops, for the socket files vLLM leaves behind.
    engine_dir: bool = False
    # Where it runs (None: here). `python -m` puts the working directory first on sys.path,
    # ahead of PYTHONPATH, so a variant from another checkout runs from that checkout.
    cwd: Path | None = None

    def __post_init__(self) -> None:
        if (self.ready_pattern is None) == (self.health_url is None):
            raise ValueError(f"{self.name}: give exactly one of ready_pattern and health_url")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc (sessions and groups do not matter)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name may hold spaces and parentheses; fields resume after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in (pid, *descendants(pid)):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / tick


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes; its parent reaps it
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


class ServerProcess:
    """A running server; use as a context manager: enter waits for ready, exit stops it."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.boot_s: float | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._tail: deque[str] = deque(maxlen=30)
        self._pump_thread: threading.Thread | None = None
        self._engine_dir = None

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._started = time.monotonic()
        env = {**os.environ, **self.spec.env}
        if self.spec.engine_dir:
            from pdserve import tempdirs

            self._engine_dir = tempdirs.engine_dir()
            env |= tempdirs.engine_env(self._engine_dir.name)
        self._proc = subprocess.Popen(
            self.spec.argv, env=env, cwd=self.spec.cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True)
        self._pump_thread = start_quiet_thread(self._pump)

    def _pump(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        pattern = re.compile(self.spec.ready_pattern) if self.spec.ready_pattern else None
        with self.log_path.open("w") as log:
            for line in self._proc.stdout:
                log.write(line)
                log.flush()
                self._tail.append(line.rstrip())
                if pattern is not None and pattern.search(line):
                    self._ready.set()

    def _healthy(self) -> bool:
        assert self.spec.health_url is not None
        try:
            with urllib.request.urlopen(self.spec.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> None:
        assert self._proc is not None
        deadline = self._started + self.spec.boot_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(f"{self.spec.name} exited with {self._proc.returncode} before "
                                  f"it was ready; log {self.log_path}:\n" + self.tail())
            if self.spec.ready_pattern is not None:
                if self._ready.wait(0.5):
                    break
            elif self._healthy():
                break
            else:
                time.sleep(1.0)
        else:
            raise self._not_ready()
        if self.spec.grpc_health_target is not None:
            self._wait_serving(self.spec.grpc_health_target, deadline)
        self.boot_s = time.monotonic() - self._started

    def _not_ready(self) -> ServerError:
        return ServerError(f"{self.spec.name} not ready after {self.spec.boot_timeout_s:.0f} "
                           f"s; log {self.log_path}:\n" + self.tail())

    def _wait_serving(self, target: str, deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        assert self._proc is not None
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                time.sleep(0.5)
        raise self._not_ready()

    def freeze(self) -> None:
        """SIGSTOP the server and every descendant: a system idle while another is measured
        takes no CPU at all (an idle pdserve stack still polls, seen at 4-8% of a core)."""
        if self._proc is not None:
            signal_tree(self._proc.pid, signal.SIGSTOP)

    def thaw(self, settle_s: float = 0.0) -> None:
        """SIGCONT what `freeze` stopped; then, after ``settle_s`` (for the timers that came
        due meanwhile to run), wait until the server answers its readiness check again."""
        if self._proc is None:
            return
        signal_tree(self._proc.pid, signal.SIGCONT)
        time.sleep(settle_s)
        deadline = time.monotonic() + self.spec.boot_timeout_s
        if self.spec.grpc_health_target is not None:
            self._wait_serving(self.spec.grpc_health_target, deadline)
        elif self.spec.health_url is not None:
            while not self._healthy():
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    raise self._not_ready()
                time.sleep(0.5)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def tail(self) -> str:
        return "\n".join(self._tail)

    def stop(self) -> None:
        """SIGTERM the group, wait `stop_grace_s`, then SIGKILL every survivor. Interrupted
        while it waits (a second Ctrl-C, or SIGTERM: `cli.stop_on_sigterm`), it kills them
        at once, finishes, and lets the interrupt go on: seen when a compare stopped while
        booting vLLM was sent SIGTERM during that stop's grace, it left the server running."""
        proc = self._proc
        if proc is None:
            return
        family = [proc.pid, *descendants(proc.pid)]
        held = SegmentTracker()
        held.record(family)  # /dev/shm segments a process killed below would leave behind
        try:
            self._terminate(proc, family)
        except KeyboardInterrupt:
            _kill(proc.pid, family)
            raise
        finally:
            held.sweep()  # those a survivor still holds (a zombie holds none) stay
            if self._engine_dir is not None:
                self._engine_dir.cleanup()
                self._engine_dir = None
            if self._pump_thread is not None:
                self._pump_thread.join(timeout=5)
            self._proc = None

    def _terminate(self, proc: subprocess.Popen[str], family: list[int]) -> None:
        signal_tree(proc.pid, signal.SIGCONT)  # a frozen process would not act on SIGTERM
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
        for pid in family:  # descendants that left the group get the same notice
            _signal(pid, signal.SIGTERM)
        try:
            proc.wait(self.spec.stop_grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        # Children outlive a leader that exits first; give them the rest of the grace.
        deadline = time.monotonic() + self.spec.stop_grace_s
        while (survivors := [p for p in family if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        _kill(proc.pid, survivors)


def _kill(leader: int, pids: list[int]) -> None:
    """SIGKILL ``pids`` and the group of ``leader`` (anything forked since they were
    listed), and wait up to 5 s for them to go."""
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    _signal_group(leader, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """``sig`` to ``pid``'s process group and to each of its descendants (one may have
    left the group)."""
    _signal_group(pid, sig)
    for child in descendants(pid):
        _signal(child, sig)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
