"""The gateway process: its health (`Serving`), the loop that polls its workers, and
`serve`: the gRPC server's start and its ordered stop (no new calls, those in flight and
queued finish within --drain-grace-s, then the server goes). A call's path is
gateway/server.py's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from gateway import metrics
from gateway.dispatch import Dispatcher
from gateway.registry import SERVICE_NAME as REGISTRY_SERVICE
from gateway.registry import RegistryServicer
from gateway.server import SERVICE_NAME, GenerationServicer
from gateway.text import load_tokenizer
from gateway.tokenizer_pool import TokenizerPool
from gateway.workers import WorkerPool
from pdserve import rpc
from pdserve.config import GatewayConfig
from pdserve.logs import setup_logging
from protos import generation_pb2_grpc, worker_pb2_grpc

logger = logging.getLogger(__name__)

# A worker-polling round this late means the gateway itself did not run (see _poll_workers).
PAUSE_EXCUSED_AFTER_S = 2.0


class Serving:
    """The gateway's health: SERVING while a decode worker is routable (without a prefill
    worker, decode workers prefill every prompt themselves). Set at once when
    a worker registers, returns by heartbeat, leaves or drains, and on each poll round: seen
    in CI, a decode worker restarted and registered served a request while the gateway still
    said NOT_SERVING until the next round."""

    def __init__(self, health, workers: WorkerPool) -> None:
        self._health = health
        self._workers = workers
        self._was_ready: bool | None = None
        self._had_tier: bool | None = None
        self._stopping = False

    async def stop(self) -> None:
        """NOT_SERVING from now on, whatever the workers: the gateway is stopping."""
        self._stopping = True
        await rpc.set_serving(self._health, [SERVICE_NAME], False)

    async def refresh(self) -> None:
        ready = self._workers.ready()
        for role in ("prefill", "decode"):
            metrics.WORKERS_READY.labels(role).set(len(self._workers.routable(role)))
        if self._stopping:
            return
        if ready != self._was_ready:
            await rpc.set_serving(self._health, [SERVICE_NAME], ready)
            logger.info("gateway %s", "SERVING" if ready else "NOT_SERVING: waiting for a decode worker")
            self._was_ready = ready
        tier = bool(self._workers.routable("prefill"))
        if ready and tier != self._had_tier:
            if not tier and self._had_tier is None:
                # A stack's start: its decode worker often registers before its prefill worker.
                logger.info("no prefill worker in rotation yet: the decode workers prefill every prompt until one is")
            elif not tier and any(not w.healthy for w in self._workers.tier("prefill")):
                logger.warning("no prefill worker in rotation: the decode workers prefill every prompt until one is")
            elif not tier:
                # Drained or deregistered (an operator's drain, a stack stopping): no news.
                logger.info("no prefill worker in rotation (the tier drained): the decode workers prefill every "
                            "prompt until one is")
            elif self._had_tier is False:
                logger.info("a prefill worker is in rotation: long prompts go to the prefill tier again")
            self._had_tier = tier


async def _poll_workers(workers: WorkerPool, dispatcher: Dispatcher, serving: Serving, cfg: GatewayConfig) -> None:
    """Health of the static workers, heartbeats of the registered ones, and the gateway's own
    health from them."""
    sleep_s = min(cfg.poll_interval_s, cfg.heartbeat_interval_s)
    late_s = 0.0
    while True:
        try:
            if late_s > PAUSE_EXCUSED_AFTER_S:
                # The loop itself did not run (the process was stopped or starved): the
                # heartbeats of that time were not read, and the workers are not to blame.
                excused = workers.excuse_pause(late_s, time.monotonic())
                logger.warning("gateway did not run for %.1f s%s", late_s,
                               f"; that time is not counted as heartbeat silence of its {excused} "
                               f"registered worker(s)" if excused else "")
            await workers.poll_once()
            workers.expire_heartbeats(time.monotonic(), cfg.heartbeat_timeout_s)
            dispatcher.pump()  # a worker that came back may take queued work
            await serving.refresh()
        except Exception:
            # This loop is the gateway's health and heartbeat expiry: one bad round must not
            # end it (health would stay as it was for the gateway's life).
            logger.exception("polling workers failed; polling again")
        asleep_s = time.monotonic()
        await asyncio.sleep(sleep_s)
        late_s = time.monotonic() - asleep_s - sleep_s


async def serve(cfg: GatewayConfig) -> None:
    from prometheus_client import start_http_server

    tokenizers = TokenizerPool(cfg.model, cfg.tokenizer_workers)
    await tokenizers.start()
    metrics.register_tokenizer_pool_cpu(tokenizers.cpu_seconds)
    workers = WorkerPool.connect(cfg.prefill_addrs, cfg.decode_addrs)
    server = grpc.aio.server(options=rpc.CHANNEL_OPTIONS)
    generation = GenerationServicer(cfg, workers, tokenizers, load_tokenizer(cfg.model))
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    health = rpc.add_standard_services(server, [SERVICE_NAME, REGISTRY_SERVICE])
    serving = Serving(health, workers)

    async def workers_changed() -> None:
        generation.dispatcher.pump()  # room may have appeared
        await serving.refresh()

    worker_pb2_grpc.add_RegistryServicer_to_server(
        RegistryServicer(workers, cfg.heartbeat_interval_s, workers_changed), server)
    port = rpc.bind(server, cfg.host, cfg.port)
    if cfg.metrics_port is not None:
        start_http_server(cfg.metrics_port, addr=cfg.host)
    await server.start()
    poller = asyncio.create_task(_poll_workers(workers, generation.dispatcher, serving, cfg))
    logger.info("gateway listening on %s:%d", cfg.host, port)
    print(f"READY {cfg.host}:{port}", flush=True)
    stop = rpc.stop_event_on_signals()
    await stop.wait()
    # The server keeps its port through the drain: the workers' heartbeats go on (without
    # them a worker would leave rotation after --heartbeat-timeout-s and the queued calls
    # would have nowhere to go), and a new call is answered UNAVAILABLE at once.
    generation.stop_taking_calls()
    await serving.stop()
    logger.info("stopping: no new calls; %d in flight (queued ones too) may take up to %.0f s (--drain-grace-s)",
                generation.num_inflight, cfg.drain_grace_s)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(generation.idle.wait(), cfg.drain_grace_s)
    cut = generation.num_inflight
    await server.stop(0)  # cancels what is left
    poller.cancel()
    if cut:
        logger.warning("the %.0f s drain grace is over with %d calls in flight: cancelled (their callers get "
                       "UNAVAILABLE); a longer --drain-grace-s lets such answers finish", cfg.drain_grace_s, cut)
    await workers.close()
    tokenizers.close()
    logger.info("stopped")


def main(cfg: GatewayConfig) -> int:
    import uvloop

    setup_logging("gateway", json_logs=cfg.json_logs)
    uvloop.run(serve(cfg))
    return 0
