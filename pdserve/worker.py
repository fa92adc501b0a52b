"""What both worker tiers share: engine start, metrics, the gRPC server's lifecycle.

A worker process: multiprocess Prometheus directory (the engine-core process records KV
transfer metrics there) -> vLLM engine -> gRPC server with health and reflection -> prints
``READY host:port`` -> registers with its gateway if given one (pdserve/membership.py) ->
serves until SIGTERM/SIGINT or the gateway asks it to drain -> out of rotation and
NOT_SERVING, in-flight requests finish (up to --drain-grace-s), deregisters, stops the
engine. A gateway that refuses it (incompatible with its tier) stops it with exit code 3.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.config import WorkerConfig
from pdserve.logs import setup_logging

logger = logging.getLogger(__name__)

# (server, engine, cfg) -> the gRPC service's full name (for health and reflection) and
# what the worker serves (WorkerInfo, for the registry).
AddServicer = Callable[[Any, Any, WorkerConfig], tuple[str, Any]]


def run_worker(cfg: WorkerConfig, add_servicer: AddServicer, background: Callable[..., Awaitable[None]] | None = None) -> int:
    from pdserve.engine import resolve_kv_ports

    cfg = resolve_kv_ports(cfg)
    setup_logging(f"{cfg.role}[{cfg.worker_id}]", json_logs=cfg.json_logs)
    # Must precede the first prometheus_client import in this process and the engine-core
    # spawn, which inherits it.
    metrics_dir = tempfile.TemporaryDirectory(prefix=f"pdserve-metrics-{cfg.worker_id}-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
    import uvloop

    try:
        uvloop.run(_serve(cfg, add_servicer, background))
    finally:
        metrics_dir.cleanup()
    return 0


async def _serve(cfg: WorkerConfig, add_servicer: AddServicer, background) -> None:
    import grpc
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    from pdserve import rpc
    from pdserve.membership import EngineLoad, InflightInterceptor, load_logger_factory

    engine_load = EngineLoad()
    engine = _start_engine(cfg, [load_logger_factory(engine_load)])
    inflight = InflightInterceptor()
    server = grpc.aio.server(options=rpc.CHANNEL_OPTIONS, interceptors=[inflight])
    service_name, info = add_servicer(server, engine, cfg)
    health = rpc.add_standard_services(server, [service_name])
    port = rpc.bind(server, cfg.host, cfg.port)
    if cfg.metrics_port is not None:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        start_http_server(cfg.metrics_port, addr=cfg.host, registry=registry)
    await server.start()
    await rpc.set_serving(health, [service_name], True)
    logger.info("%s worker %s serving on %s:%d", cfg.role, cfg.worker_id, cfg.host, port)
    print(f"READY {cfg.host}:{port}", flush=True)
    stop = rpc.stop_event_on_signals()  # SIGTERM / SIGINT, or the gateway asking us to drain
    membership = _join(cfg, info, port, engine_load, inflight, stop)
    tasks = [asyncio.create_task(background(cfg))] if background else []
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
    engine.shutdown()
    logger.info("stopped")
    sys.stdout.flush()
    if refused:
        raise SystemExit(3)


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
