"""A worker's membership in a gateway's tier: register, heartbeat its load, drain, leave.

  1. Register (`pdserve prefill|decode --gateway HOST:PORT`): retried with backoff until the
     gateway answers; a refusal (FAILED_PRECONDITION: model, KV layout or transports that
     cannot work with the tier) is final and stops the worker with the gateway's reason.
  2. Heartbeat every interval the gateway asked for, with the engine's load (vLLM's own
     running/waiting counts and KV usage, from a stat logger) and this worker's in-flight
     RPCs. NOT_FOUND (the gateway restarted) registers again.
  3. Drain, on SIGTERM or when a heartbeat reply asks for it: tell the gateway at once, let
     in-flight requests finish (up to a grace period), deregister, stop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import grpc

from pdserve import rpc
from protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

REGISTER_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
RPC_TIMEOUT_S = 5.0
OUTAGE_WARN_BEATS = 3  # heartbeats failed in a row before a worker that is not stopping warns
COUNTED_METHODS = {"Prefill", "Decode"}


@dataclass(slots=True)
class EngineLoad:
    """The engine's last reported scheduler state (None until its first step)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float | None = None


def load_logger_factory(load: EngineLoad):
    """A vLLM stat logger factory that keeps ``load`` current (AsyncLLM(stat_loggers=...))."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                load.num_running = scheduler_stats.num_running_reqs
                load.num_waiting = scheduler_stats.num_waiting_reqs
                load.kv_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger


class InflightInterceptor(grpc.aio.ServerInterceptor):
    """Counts the Prefill and Decode calls in progress, and the prompt tokens of prefills."""

    def __init__(self) -> None:
        self.num_inflight = 0
        self.num_prompt_tokens = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.rsplit("/", 1)[-1] not in COUNTED_METHODS:
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                tokens = self._enter(request)
                try:
                    return await inner(request, context)
                finally:
                    self._leave(tokens)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream

        async def stream(request, context):
            tokens = self._enter(request)
            try:
                async for item in inner_stream(request, context):
                    yield item
            finally:
                self._leave(tokens)

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _enter(self, request) -> int:
        tokens = len(request.token_ids) if isinstance(request, worker_pb2.PrefillRequest) else 0
        self.enter(tokens)
        return tokens

    def enter(self, tokens: int = 0) -> None:
        """One request in progress (DecodeStream counts each of its requests this way)."""
        self.num_inflight += 1
        self.num_prompt_tokens += tokens
        self.idle.clear()

    def leave(self, tokens: int = 0) -> None:
        self._leave(tokens)

    def _leave(self, tokens: int) -> None:
        self.num_inflight -= 1
        self.num_prompt_tokens -= tokens
        if self.num_inflight == 0:
            self.idle.set()


class RegistrationRefused(Exception):
    pass


class Membership:
    def __init__(self, gateway: str, info: worker_pb2.WorkerInfo, address: str, metrics_url: str,
                 engine_load: EngineLoad, inflight: InflightInterceptor, drain: asyncio.Event) -> None:
        self._channel = grpc.aio.insecure_channel(gateway, options=rpc.CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.RegistryStub(self._channel)
        self._gateway = gateway
        self._request = worker_pb2.RegisterRequest(info=info, address=address, metrics_url=metrics_url)
        self._engine_load = engine_load
        self._inflight = inflight
        self._drain = drain  # set when the gateway asks this worker to drain
        self._interval_s = 1.0
        self._wake = asyncio.Event()
        self._failed_beats = 0  # in a row, up to the last
        self._failing = False  # the outage is reported
        self.draining = False

    async def run(self) -> None:
        """Registers, then heartbeats until cancelled; raises RegistrationRefused."""
        await self._register()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                reply = await self._stub.Heartbeat(self._heartbeat(), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    logger.info("gateway %s does not know this worker; registering again", self._gateway)
                    await self._register()
                else:
                    self._failed_beats += 1
                    self._report_outage(e.details())
                continue
            if self._failing:
                logger.info("heartbeats to gateway %s go through again", self._gateway)
            self._failing = False
            self._failed_beats = 0
            if reply.drain and not self._drain.is_set():
                logger.info("gateway %s asked this worker to drain", self._gateway)
                self._drain.set()

    def _report_outage(self, details: str) -> None:
        """Once per outage, not once per beat. A stopping worker's outage is no warning (its
        stack's gateway may go first), and neither is one beat or two: the gateway of a stack
        told to stop closes its port at once, and this worker may hear its own SIGTERM a moment
        later."""
        if self._failing or not (self.draining or self._failed_beats >= OUTAGE_WARN_BEATS):
            return
        self._failing = True
        logger.log(logging.INFO if self.draining else logging.WARNING,
                   "heartbeats to gateway %s failing (%d beats): %s; retrying every %.1f s", self._gateway,
                   self._failed_beats, details, self._interval_s)

    def start_draining(self) -> None:
        """Tells the gateway now (the next heartbeat goes at once)."""
        self.draining = True
        self._wake.set()

    async def leave(self) -> None:
        try:
            await self._stub.Deregister(worker_pb2.DeregisterRequest(worker_id=self._request.info.worker_id),
                                        timeout=RPC_TIMEOUT_S)
            logger.info("deregistered from gateway %s", self._gateway)
        except grpc.aio.AioRpcError as e:
            # A gateway that is gone or going (a stack stopping as a whole: its server
            # cancels the calls in flight as it stops) has nothing to forget; one that is up
            # takes this worker out when its heartbeats stop.
            gone = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            logger.log(logging.INFO if gone else logging.WARNING,
                       "not deregistered from gateway %s: %s", self._gateway, e.details())
        await self._channel.close()

    async def _register(self) -> None:
        attempt = 0
        while True:
            try:
                reply = await self._stub.Register(self._request, timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    raise RegistrationRefused(f"gateway {self._gateway} refused this worker: {e.details()}") from e
                delay = REGISTER_BACKOFF_S[min(attempt, len(REGISTER_BACKOFF_S) - 1)]
                if attempt == 0 or delay == REGISTER_BACKOFF_S[-1] and attempt % 12 == 0:
                    logger.info("gateway %s not reachable yet (%s); retrying", self._gateway, e.code().name)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            self._interval_s = reply.heartbeat_interval_s or self._interval_s
            logger.info("registered with gateway %s as %s worker %s", self._gateway,
                        self._request.info.role, self._request.info.worker_id)
            return

    def _heartbeat(self) -> worker_pb2.HeartbeatRequest:
        load = worker_pb2.WorkerLoad(
            num_running=self._engine_load.num_running,
            num_waiting=self._engine_load.num_waiting,
            num_queued_prompt_tokens=self._inflight.num_prompt_tokens,
        )
        if self._engine_load.kv_usage is not None:
            load.kv_usage = self._engine_load.kv_usage
        return worker_pb2.HeartbeatRequest(worker_id=self._request.info.worker_id, load=load,
                                           draining=self.draining)


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """The host:port a gateway reaches this worker at: --advertise-host, else the bind host
    unless it is a wildcard, else this machine's name."""
    if advertise:
        return f"{advertise}:{port}"
    if host in ("0.0.0.0", "::", ""):
        return f"{socket.gethostname()}:{port}"
    return f"{host}:{port}"
