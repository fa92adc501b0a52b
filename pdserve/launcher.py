"""`pdserve up`: the gateway and its prefill and decode workers as processes on this host,
supervised: a worker (or the gateway) that dies is restarted with backoff and rejoins; the
stack stops only when asked (SIGTERM / Ctrl-C).

Stopping is graceful: SIGTERM to each child process alone, the gateway first, so that it
stops taking calls and finishes those in flight (queued ones too) on workers that still
serve; then to the workers, each of which drains its requests on an engine that still
runs, then stops it (SIGTERM to a worker's whole process group reached its engine's
processes too, which stopped at once and failed every request in flight with
EngineDeadError). Each child runs in its own session (process group): after a grace period
SIGKILL goes to the group and to every descendant that outlived its worker.
The children print ``READY host:port`` on stdout when serving; their output is forwarded to
our stderr, so stdout carries only our own ``ready`` line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from kvtransfer import coreshare, prefill_threads
from pdserve import gpus
from pdserve.config import DRAIN_GRACE_S, STOP_GRACE_S
from pdserve.ports import free_port, free_port_block  # noqa: F401 (tests and scripts import them here)
from pdserve.segments import SegmentTracker

# How often the shared-memory segments each child's process tree holds are noted, so that
# those a killed child leaves in /dev/shm can be removed (pdserve/segments.py).
RECORD_SEGMENTS_EVERY_S = 10.0


RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# A child up this long has recovered: its next crash restarts it after the shortest delay.
STABLE_S = 60.0


@dataclass
class Child:
    name: str
    argv: list[str]
    restart: bool = False
    proc: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    env: dict[str, str] = field(default_factory=dict)
    started_s: float = 0.0
    num_restarts: int = 0
    restart_at_s: float | None = None
    # Set for this child only (a worker's GPU).
    env_overrides: dict[str, str] = field(default_factory=dict)
    segments: SegmentTracker = field(default_factory=SegmentTracker)
    segments_recorded_s: float = float("-inf")

    def start(self, env: dict[str, str]) -> None:
        self.env = env
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**env, **self.env_overrides},
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        """Relays the child's output; with our own stderr gone (whoever started `pdserve up`
        exited and closed the pipe), keeps reading and drops it, so the child never blocks
        on a full pipe."""
        assert self.proc is not None and self.proc.stdout is not None
        relay = True
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.ready.set()
            if relay:
                try:
                    sys.stderr.write(f"[{self.name}] {line}")
                except (OSError, ValueError):  # a broken pipe, or a closed stream
                    relay = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def record_segments(self, now_s: float, force: bool = False) -> None:
        """Notes the /dev/shm segments its process tree holds (at most every
        RECORD_SEGMENTS_EVERY_S unless ``force``), while they can still be read."""
        if not self.alive() or (not force and now_s - self.segments_recorded_s < RECORD_SEGMENTS_EVERY_S):
            return
        self.segments_recorded_s = now_s
        self.segments.record([self.proc.pid, *(p.pid for p in _descendants(self))])

    def sweep_segments(self) -> None:
        """Removes the segments its dead processes left in /dev/shm; says so once."""
        removed = self.segments.sweep()
        if removed:
            with contextlib.suppress(OSError, ValueError):
                print(f"pdserve: removed {len(removed)} shared-memory segments {self.name}'s killed processes "
                      f"left in /dev/shm", file=sys.stderr, flush=True)

    def terminate(self) -> None:
        """SIGTERM to the child alone: it stops what it started itself, in order."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def signal(self, sig: int) -> None:
        """``sig`` to the child's process group."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def core_split(mode: str = "split") -> tuple[str | None, str | None]:
    """The cores of the prefill and the decode engine.

    split: prefill the first half, decode the second (vLLM binds its compute threads).
    shared: both every core; the prefill worker then runs with ``--sched idle`` so its
    threads take a core only when decode leaves it idle.
    """
    cores = sorted(os.sched_getaffinity(0))
    fmt = lambda cs: ",".join(str(c) for c in cs)  # noqa: E731
    if mode == "shared":
        return fmt(cores), fmt(cores)
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return fmt(cores[:half]), fmt(cores[half:])


@dataclass
class Stack:
    children: list[Child]
    gateway_address: str
    core_share_file: str | None = None  # kvtransfer.coreshare's base path, when a yield is set
    # The children's --drain-grace-s; a child still running STOP_GRACE_S after it ends is killed.
    drain_grace_s: float = DRAIN_GRACE_S

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for child in self.children:
            child.start(env)

    def supervise(self, now_s: float | None = None) -> None:
        """Restarts children that died, after a backoff that grows while they keep dying."""
        now_s = time.monotonic() if now_s is None else now_s
        for child in self.children:
            if child.alive():
                child.record_segments(now_s)
                continue
            if child.restart_at_s is None:
                if now_s - child.started_s >= STABLE_S:
                    child.num_restarts = 0
                delay = RESTART_BACKOFF_S[min(child.num_restarts, len(RESTART_BACKOFF_S) - 1)]
                code = child.proc.returncode if child.proc is not None else None
                with contextlib.suppress(OSError, ValueError):  # our stderr may be gone
                    print(f"pdserve: {child.name} exited (code {code}); restarting in {delay:.0f} s",
                          file=sys.stderr, flush=True)
                _reap_group(child)
                child.restart_at_s = now_s + delay
            elif now_s >= child.restart_at_s:
                child.num_restarts += 1
                child.restart_at_s = None
                child.ready.clear()
                child.sweep_segments()
                child.start(child.env)

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until the gateway reports SERVING with every worker of the stack ready in
        its tiers (the gateway serves once a decode worker is there; the stack is ready when
        all of it is); raises if a child dies or time runs out."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from protos import worker_pb2, worker_pb2_grpc

        num_workers = sum(c.name != "gateway" for c in self.children)
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.gateway_address) as channel:
            health, registry = health_pb2_grpc.HealthStub(channel), worker_pb2_grpc.RegistryStub(channel)
            while time.monotonic() < deadline:
                dead = [c.name for c in self.children if not c.alive()]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited during start-up (see its log above)")
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        workers = registry.ListWorkers(worker_pb2.ListWorkersRequest(), timeout=1).workers
                        if sum(w.state == "ready" for w in workers) >= num_workers:
                            return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"the stack was not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        # vLLM's engine-core process may leave its parent's process group; remember every
        # descendant now, and kill whichever outlives its worker.
        descendants = [p for child in self.children for p in _descendants(child)]
        for child in self.children:
            child.record_segments(time.monotonic(), force=True)
        # The gateway first: it finishes its calls in flight, the queued ones too, on workers
        # that still serve (stopped at the same time, the workers left rotation and a queued
        # call had nowhere to go until the grace was over). The workers then drain with
        # nothing, or only what the gateway cut, in flight.
        gateways = [c for c in self.children if c.name == "gateway"]
        for group in (gateways, [c for c in self.children if c not in gateways]):
            for child in group:
                child.terminate()
            deadline = time.monotonic() + self.drain_grace_s + STOP_GRACE_S
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                # The group may hold the engine-core process even after the worker exited.
                child.signal(signal.SIGKILL)
                child.proc.wait()
        for proc in descendants:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(descendants, timeout=5)
        # What a worker killed before it could clean up left behind: its temporary
        # directories, its engine's shared-memory segments.
        from pdserve import tempdirs

        tempdirs.sweep_orphans()
        for child in self.children:
            child.sweep_segments()
        if self.core_share_file is not None:
            coreshare.remove_words(self.core_share_file)


def _reap_group(child: Child) -> None:
    """A dead worker's engine-core process may outlive it: end its process group."""
    child.signal(signal.SIGKILL)


def _descendants(child: Child) -> list[psutil.Process]:
    if not child.alive():
        return []
    try:
        return psutil.Process(child.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def build_stack(args) -> Stack:
    """Children for `pdserve up`, from its parsed arguments: the gateway, then
    ``--prefill`` prefill and ``--decode`` decode workers that register with it."""
    from pdserve.cli import policy_argv

    py = [sys.executable, "-m", "pdserve.cli"]
    connect_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    gateway_address = f"{connect_host}:{args.port}"
    # Without a prefill tier, the decode engines have every core whatever the split.
    prefill_cpus, decode_cpus = core_split(args.cores if args.prefill else "shared")
    common = ["--model", args.model, "--kv-cache-gib", str(args.kv_cache_gib), "--block-size", str(args.block_size),
              "--executor", args.executor,
              "--kv-lease-s", str(args.kv_lease_s), "--kv-timeout-s", str(args.kv_timeout_s),
              "--drain-grace-s", str(args.drain_grace_s), "--gateway", gateway_address]
    if args.max_model_len:
        common += ["--max-model-len", str(args.max_model_len)]
    if args.json_logs:
        common.append("--json-logs")
    # Metrics ports: gateway +0, prefill workers +1.., decode workers after them.
    metrics = (lambda i: ["--metrics-port", str(args.metrics_port + i)]) if args.metrics_port else (lambda i: [])
    children = [Child("gateway", [*py, "gateway", "--host", args.host, "--port", str(args.port), "--model", args.model,
                                  "--kv-transport", args.kv_transport, "--drain-grace-s", str(args.drain_grace_s),
                                  *metrics(0), *policy_argv(args),
                                  *(["--json-logs"] if args.json_logs else [])])]
    on_gpus = gpus.assign(gpus.visible_gpus(), args.prefill, args.decode)
    core_share_env = {}  # engines on GPUs share no cores
    if args.decode_yield != "off" and args.decode_yield_ms:
        raise ValueError(f"--decode-yield {args.decode_yield} sizes the pause itself: drop --decode-yield-ms")
    yield_ms = {"slack": coreshare.SLACK, "pace": coreshare.PACE,
                "whole": coreshare.WHOLE}.get(args.decode_yield, args.decode_yield_ms or None)
    threads = getattr(args, "prefill_threads", "team")
    if on_gpus is None and args.cores == "shared" and (yield_ms is not None or threads != "team"):
        core_share_env = {coreshare.ENV_FILE: core_share_path()}
        if yield_ms is not None:
            core_share_env[coreshare.ENV_YIELD_MS] = str(yield_ms)
        if threads != "team":
            core_share_env[prefill_threads.ENV_PREFILL_THREADS] = threads
    for role, count, cpus, offset in (("prefill", args.prefill, prefill_cpus, 1),
                                      ("decode", args.decode, decode_cpus, 1 + args.prefill)):
        for i in range(count):
            name = role if count == 1 else f"{role}{i}"
            # A fixed port, so a restarted worker comes back at the address the gateway knows.
            argv = [*py, role, "--port", str(free_port()), *common, *metrics(offset + i)]
            env = dict(core_share_env)
            if on_gpus is not None:
                gpu = on_gpus[role == "decode"][i]
                env["CUDA_VISIBLE_DEVICES"] = gpu.cuda_visible_devices
                argv += ["--gpu-memory-utilization", str(gpu.gpu_memory_utilization)]
            else:
                argv += ["--cpus", cpus] if cpus else []
                if role == "prefill" and args.cores == "shared":
                    argv += ["--sched", args.prefill_sched]
            children.append(Child(name, argv, restart=True, env_overrides=env))
    return Stack(children, gateway_address, core_share_env.get(coreshare.ENV_FILE), args.drain_grace_s)


def core_share_path() -> str:
    """Where this stack's prefill workers tell its decode engine they have work: the base
    path of their shared-memory words (kvtransfer.coreshare); removed when the stack stops."""
    return f"/dev/shm/pdserve-cores-{os.getpid()}"


def up(args) -> int:
    if args.prefill < 0 or args.decode < 1:
        raise ValueError(f"--decode needs at least one worker and --prefill none or more, got {args.decode} and "
                         f"{args.prefill}")
    if args.drain_grace_s < 0:
        raise ValueError(f"--drain-grace-s must be >= 0, got {args.drain_grace_s}")
    stack = build_stack(args)
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    stack.start()
    try:
        errors: list[BaseException] = []
        ready = threading.Thread(target=_capture(stack.wait_ready, errors), args=(args.ready_timeout_s,), daemon=True)
        ready.start()
        while ready.is_alive() and not stopping.is_set():
            ready.join(0.2)
        if stopping.is_set():
            return 130
        if errors:
            print(f"pdserve up failed: {errors[0]}", file=sys.stderr, flush=True)
            return 1
        print(f"pdserve ready at {stack.gateway_address} ({time.monotonic() - started:.0f} s)", flush=True)
        while not stopping.is_set():
            stack.supervise()
            stopping.wait(0.5)
        return 0
    finally:
        # Whoever started us may be gone with our stderr (a test runner that crashed):
        # the stack is stopped all the same.
        with contextlib.suppress(OSError, ValueError):
            print("pdserve: stopping", file=sys.stderr, flush=True)
        stack.stop()


def _capture(fn, errors: list[BaseException]):
    def run(*a):
        try:
            fn(*a)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    return run
