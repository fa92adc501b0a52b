"""pdserve.worker.v1.Registry on the gateway: workers join, heartbeat, drain and leave.

A thin servicer over the gateway's WorkerPool (gateway/workers.py), which owns the view of
the workers that placement and admission read.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from gateway.workers import Worker, WorkerPool
from pdserve import rpc
from protos import worker_pb2, worker_pb2_grpc

SERVICE_NAME = "pdserve.worker.v1.Registry"


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, workers: WorkerPool, heartbeat_interval_s: float, on_change: Callable[[], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._workers = workers
        self._interval_s = heartbeat_interval_s
        # Told when a worker joins, returns, leaves or drains: the dispatcher's pump (room may
        # have appeared) and the gateway's health.
        self._on_change = on_change
        self._clock = clock

    @rpc.rpc_errors
    async def Register(self, request: worker_pb2.RegisterRequest, context) -> worker_pb2.RegisterResponse:
        if not request.address:
            raise rpc.InvalidArgument("address is empty: give the host:port the gateway reaches the worker at")
        if not request.info.worker_id:
            raise rpc.InvalidArgument("info.worker_id is empty")
        try:
            self._workers.register(request.info, request.address, request.metrics_url, self._clock())
        except ValueError as e:
            raise rpc.FailedPrecondition(str(e)) from e
        await self._on_change()
        return worker_pb2.RegisterResponse(heartbeat_interval_s=self._interval_s)

    @rpc.rpc_errors
    async def Heartbeat(self, request: worker_pb2.HeartbeatRequest, context) -> worker_pb2.HeartbeatResponse:
        try:
            routable = self._workers.by_id(request.worker_id).routable
            drain = self._workers.heartbeat(request.worker_id, request.load, request.draining, self._clock())
        except KeyError as e:
            raise rpc.NotFound(f"worker {request.worker_id!r} is not registered here; register again") from e
        if self._workers.by_id(request.worker_id).routable != routable:  # back, or now draining
            await self._on_change()
        return worker_pb2.HeartbeatResponse(drain=drain)

    @rpc.rpc_errors
    async def Deregister(self, request: worker_pb2.DeregisterRequest, context) -> worker_pb2.DeregisterResponse:
        self._workers.deregister(request.worker_id)
        await self._on_change()
        return worker_pb2.DeregisterResponse()

    @rpc.rpc_errors
    async def ListWorkers(self, request, context) -> worker_pb2.ListWorkersResponse:
        now = self._clock()
        return worker_pb2.ListWorkersResponse(workers=[status(w, now) for w in self._workers.workers])

    @rpc.rpc_errors
    async def Drain(self, request: worker_pb2.DrainRequest, context) -> worker_pb2.DrainResponse:
        try:
            worker = self._workers.drain(request.worker_id)
        except KeyError as e:
            known = ", ".join(w.worker_id for w in self._workers.workers if w.worker_id) or "none"
            raise rpc.NotFound(f"no worker {request.worker_id!r} (known: {known}); see `pdserve workers`") from e
        await self._on_change()
        return worker_pb2.DrainResponse(worker=status(worker, self._clock()))


def status(worker: Worker, now_s: float) -> worker_pb2.WorkerStatus:
    msg = worker_pb2.WorkerStatus(
        worker_id=worker.worker_id,
        role=worker.role,
        address=worker.address,
        state=worker.state,
        reason=worker.incompatible or "",
        source=worker.source,
        num_inflight=worker.num_inflight,
        metrics_url=worker.metrics_url,
    )
    if worker.reported_load is not None:
        msg.load.CopyFrom(worker.reported_load)
    if worker.last_heartbeat_s is not None:
        msg.heartbeat_age_s = now_s - worker.last_heartbeat_s
    return msg
