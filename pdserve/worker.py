"""What both worker tiers share: engine start, metrics, the gRPC server's lifecycle.

A worker process: multiprocess Prometheus directory (the engine-core process records KV
transfer metrics there) -> vLLM engine -> gRPC server with health and reflection -> prints
``READY host:port`` -> serves until SIGTERM/SIGINT -> NOT_SERVING, drains, stops the engine.
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

DRAIN_GRACE_S = 10.0

# (server, engine, cfg) -> awaitable that runs until the server should stop; returns the
# gRPC service's full name for health and reflection.
AddServicer = Callable[[Any, Any, WorkerConfig], str]


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
    from pdserve.engine import build_engine

    if cfg.sched == "idle":
        from pdserve.sched import enter_background, leave_background

        enter_background()  # the engine-core process starts now and inherits it
        engine = build_engine(cfg)
        leave_background()
        logger.info("engine runs at idle CPU priority: it yields its cores to other work")
    else:
        engine = build_engine(cfg)
    server = grpc.aio.server(options=rpc.CHANNEL_OPTIONS)
    service_name = add_servicer(server, engine, cfg)
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
    stop = rpc.stop_event_on_signals()
    tasks = [asyncio.create_task(background(cfg))] if background else []
    await stop.wait()
    logger.info("draining (up to %.0f s)", DRAIN_GRACE_S)
    await rpc.set_serving(health, [service_name], False)
    await server.stop(DRAIN_GRACE_S)
    for task in tasks:
        task.cancel()
    engine.shutdown()
    logger.info("stopped")
    sys.stdout.flush()
