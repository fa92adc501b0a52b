"""What both worker tiers share: engine start, metrics, the gRPC server's lifecycle.

A worker process: SIGTERM/SIGINT end it cleanly from here on -> multiprocess Prometheus
directory (the engine's processes record our KV transfer metrics there; vLLM's engine
metrics stay in this process's memory) -> vLLM engine -> gRPC server with health and
reflection -> prints ``READY host:port`` -> registers with its gateway if given one
(pdserve/membership.py) -> serves until SIGTERM/SIGINT or the gateway asks it to drain ->
out of rotation and NOT_SERVING, in-flight requests finish (up to --drain-grace-s),
deregisters, stops the engine -> removes its temporary directories (pdserve/tempdirs.py:
the metrics directory, the engine's sockets and files) and any KV cache its engine left in
/dev/shm (also when stopped at any point of its start-up). A gateway that refuses
it (incompatible with its tier) stops it with exit code 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from pdserve import tempdirs
from pdserve.config import WorkerConfig
from pdserve.logs import setup_logging

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long a stopping worker waits for its engine's processes to exit before it removes the
# KV cache they left in /dev/shm (`pdserve up` kills what is left 15 s after SIGTERM).
KV_OWNER_EXIT_WAIT_S = 5.0

# (server, engine, cfg) -> the gRPC service's full name (for health and reflection) and
# what the worker serves (WorkerInfo, for the registry).
AddServicer = Callable[[Any, Any, WorkerConfig, Any], tuple[str, Any]]  # server, engine, cfg, inflight


def run_worker(cfg: WorkerConfig, add_servicer: AddServicer, background: Callable[..., Awaitable[None]] | None = None) -> int:
    from pdserve.engine import resolve_kv_ports

    cfg = resolve_kv_ports(cfg)
    setup_logging(f"{cfg.role}[{cfg.worker_id}]", json_logs=cfg.json_logs)
    _exit_on_stop_signals()
    swept = tempdirs.sweep_orphans()
    if swept:
        logger.info("removed %d temporary directories of killed workers: %s", len(swept), swept)
    with worker_files(cfg.worker_id):
        import uvloop

        uvloop.run(_serve(cfg, add_servicer, background))
    return 0


def _exit_on_stop_signals() -> None:
    """Until the server takes the signals over, SIGTERM/SIGINT raise SystemExit wherever
    start-up is (importing, waiting for the engine core), so vLLM stops its processes and
    ``worker_files`` removes ours; SIGTERM's default action would skip both."""

    def stop(signum: int, frame: object) -> None:
        _ignore_stop_signals()  # a second signal must not cut that clean-up short
        logger.info("%s during start-up; stopping", signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def worker_files(worker_id: str) -> Iterator[str]:
    """A fresh PROMETHEUS_MULTIPROC_DIR for the engine processes this process spawns (they
    inherit it, and our KV transfer metrics, recorded there, write to it) and a fresh
    directory for the engine's sockets and temporary files (`tempdirs.engine_dir`); on the
    way out, however start-up or serving ended, both are removed, and so is the KV cache
    in /dev/shm of an engine that did not remove it.

    This process keeps its own metric values in memory: vLLM's stat logger records its
    engine metrics here at every engine step, and a file-backed value costs a pid check, an
    environment lookup and an mmap write per update (scripts/cprofile_stack.sh at 4 streams:
    the logger's record() took 0.30 of the 0.64 s of vLLM's output handler with file-backed
    values, 0.18 of 0.46 s in memory). The exporter (`MetricsCollector`) serves both.
    """
    from prometheus_client import values

    # A stop signal waits until the directory exists and TemporaryDirectory's finalizer
    # knows it, so none leaves it behind.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        metrics_dir = tempdirs.metrics_dir(worker_id)
        engine_dir = tempdirs.engine_dir()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
        tempdirs.use_engine_dir(engine_dir.name)
        # In memory here whatever the environment said when prometheus_client was imported.
        values.ValueClass = values.MutexValue
        yield metrics_dir.name
    finally:
        _ignore_stop_signals()
        _remove_orphan_kv_cache(worker_id)
        metrics_dir.cleanup()
        engine_dir.cleanup()


def _remove_orphan_kv_cache(worker_id: str) -> None:
    """vLLM's model-runner process places a prefill worker's KV cache in /dev/shm and
    unlinks it in an atexit hook, which a process forked by multiprocessing never runs (seen
    when it is stopped during start-up). Once that process is gone, its cache and the
    leases naming it are removed here."""
    from kvtransfer.shm import drop_leases, has_shared_cache, sweep_orphan_caches

    deadline = time.monotonic() + KV_OWNER_EXIT_WAIT_S
    while has_shared_cache(worker_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    if has_shared_cache(worker_id):
        logger.warning("the engine process holding this worker's /dev/shm KV cache is still running")
    sweep_orphan_caches()
    drop_leases(worker_id)


class MetricsCollector:
    """A worker's /metrics: what the engine's processes wrote to the multiprocess directory
    (our KV transfer metrics), then vLLM's metrics from this process's memory (``vllm:``
    families of ``in_process``, the default registry) that the directory does not hold."""

    PREFIX = "vllm:"

    def __init__(self, files, in_process) -> None:
        self._files = files
        self._in_process = in_process

    def collect(self):
        names = set()
        for family in self._files.collect():
            names.add(family.name)
            yield family
        for family in self._in_process.collect():
            if family.name.startswith(self.PREFIX) and family.name not in names:
                yield family


async def _serve(cfg: WorkerConfig, add_servicer: AddServicer, background) -> None:
    import grpc
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess, start_http_server

    from pdserve import rpc
    from pdserve.membership import EngineLoad, InflightInterceptor, load_logger_factory

    engine_load = EngineLoad()
    engine = _start_engine(cfg, [load_logger_factory(engine_load)])
    # As vLLM's engine processes do once started: its settings are read from the environment
    # at each use otherwise, one read per generated token in its stat logger here.
    from vllm import envs as vllm_envs

    vllm_envs.enable_envs_cache()
    inflight = InflightInterceptor()
    server = grpc.aio.server(options=rpc.CHANNEL_OPTIONS, interceptors=[inflight])
    service_name, info = add_servicer(server, engine, cfg, inflight)
    health = rpc.add_standard_services(server, [service_name])
    port = rpc.bind(server, cfg.host, cfg.port)
    if cfg.metrics_port is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(MetricsCollector(multiprocess.MultiProcessCollector(None), REGISTRY))
        start_http_server(cfg.metrics_port, addr=cfg.host, registry=registry)
    await server.start()
    await rpc.set_serving(health, [service_name], True)
    logger.info("%s worker %s serving on %s:%d", cfg.role, cfg.worker_id, cfg.host, port)
    print(f"READY {cfg.host}:{port}", flush=True)
    stop = rpc.stop_event_on_signals()  # SIGTERM / SIGINT, or the gateway asking us to drain
    membership = _join(cfg, info, port, engine_load, inflight, stop)
    tasks = [asyncio.create_task(background(cfg))] if background else []
    died = asyncio.Event()
    tasks.append(asyncio.create_task(_watch_engine(engine, stop, died)))
    joined = asyncio.create_task(membership.run()) if membership else None
    refused = await _wait_stop(stop, joined)
    # Drain: out of rotation first, then let what runs here finish.
    logger.info("draining: %d requests in flight (up to %.0f s)", inflight.num_inflight, cfg.drain_grace_s)
    if membership is not None and not refused:
        membership.start_draining()
    await rpc.set_serving(health, [service_name], False)
    try:
        await asyncio.wait_for(inflight.idle.wait(), cfg.drain_grace_s)
    except TimeoutError:
        logger.warning("%d requests still in flight after %.0f s; stopping", inflight.num_inflight, cfg.drain_grace_s)
    if joined is not None:
        joined.cancel()
    if membership is not None and not refused:
        await membership.leave()
    await server.stop(1.0)
    for task in tasks:
        task.cancel()
    _stop_engine(engine)
    logger.info("stopped")
    sys.stdout.flush()
    if refused:
        raise SystemExit(3)
    if died.is_set():
        raise SystemExit(4)


def _stop_engine(engine) -> None:
    """Stops the engine once its requests are done. vLLM's own shutdown alone (SIGTERM to
    its engine core, which then waits for its model worker) took 5 s in a stack on this
    project's machine and ended in SIGKILL: the process that computes frees its KV cache and
    runs a full garbage collection on its way out (py-spy), beside the other engine, the
    prefill engine at idle CPU priority. Nothing in that process is left to save, so it is
    killed first: the model worker (`--executor mp`), or the engine core that computes
    itself (`--executor uni`: 4-5 s of teardown, then vLLM's SIGKILL, in its log); the shared
    KV cache it leaves in /dev/shm is removed by `_remove_orphan_kv_cache`. The engine
    client is told first that the exit is asked for, or its monitor would report the engine
    core's death as unexpected."""
    import psutil

    def named(name: str) -> list:
        found = []
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if proc.name() == name:
                    found.append(proc)
        return found

    workers = named("VLLM::Worker")
    computing = workers or named("VLLM::EngineCore")
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    if computing and not workers and resources is not None:
        resources.engine_dead = True
    for proc in computing:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    engine.shutdown()


# How often a worker checks that its engine is alive.
ENGINE_CHECK_S = 1.0


async def _watch_engine(engine, stop: asyncio.Event, died: asyncio.Event) -> None:
    """A worker whose engine died stops (out of rotation, then exit code 4) so that `pdserve
    up` restarts it, instead of answering every request with EngineDeadError. Seen in the
    long benchmark: the prefill engine core's execute_model RPC timed out after the stack
    was paused (SIGSTOP) for seven minutes, and the live worker failed all 40 prompts of
    the next run with UNAVAILABLE while the gateway kept it in rotation."""
    while not stop.is_set():
        if engine.errored:
            logger.error("the engine died; stopping this worker so that it is restarted")
            died.set()
            stop.set()
            return
        await asyncio.sleep(ENGINE_CHECK_S)


def _start_engine(cfg: WorkerConfig, stat_loggers: list):
    from pdserve.engine import build_engine

    if cfg.sched != "idle":
        return build_engine(cfg, stat_loggers)
    from pdserve.sched import enter_background, leave_background

    enter_background()  # the engine-core process starts now and inherits it
    engine = build_engine(cfg, stat_loggers)
    leave_background()
    logger.info("engine runs at idle CPU priority: it yields its cores to other work")
    return engine


def _join(cfg: WorkerConfig, info, port: int, engine_load, inflight, drain: asyncio.Event):
    """This worker's membership in its gateway's tier, if it was given one (--gateway)."""
    from pdserve.membership import Membership, advertised_address

    if not cfg.gateway:
        return None
    metrics_url = ""
    address = advertised_address(cfg.host, port, cfg.advertise_host)
    if cfg.metrics_port is not None:
        metrics_url = f"http://{address.rsplit(':', 1)[0]}:{cfg.metrics_port}/metrics"
    return Membership(cfg.gateway, info, address, metrics_url, engine_load, inflight, drain)


async def _wait_stop(stop: asyncio.Event, joined: asyncio.Task | None) -> bool:
    """Waits for a stop (signal or drain request); True when the gateway refused us."""
    from pdserve.membership import RegistrationRefused

    waiters = [asyncio.ensure_future(stop.wait())] + ([joined] if joined else [])
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    if joined is not None and joined.done() and not joined.cancelled():
        error = joined.exception()
        if isinstance(error, RegistrationRefused):
            logger.error("%s", error)
            return True
        if error is not None:
            raise error
    return False
