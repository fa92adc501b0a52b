"""The gateway's view of the worker tiers: who is up, what they serve, how loaded they are.

Each worker is polled (gRPC health, then Info once) every poll interval. A worker is
routable when healthy and compatible with the first worker of the other tier (same KV
layout, transport and model limits). Routing picks the routable worker of a tier with the
fewest requests in flight from this gateway.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from pdserve import rpc
from protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    info: worker_pb2.WorkerInfo | None = None
    healthy: bool = False
    incompatible: str | None = None
    num_inflight: int = 0

    @property
    def routable(self) -> bool:
        return self.healthy and self.info is not None and self.incompatible is None


@dataclass
class WorkerPool:
    workers: list[Worker] = field(default_factory=list)

    @classmethod
    def connect(cls, prefill_addrs: tuple[str, ...], decode_addrs: tuple[str, ...]) -> WorkerPool:
        pool = cls()
        for role, addrs, stub_cls in (
            ("prefill", prefill_addrs, worker_pb2_grpc.PrefillWorkerStub),
            ("decode", decode_addrs, worker_pb2_grpc.DecodeWorkerStub),
        ):
            for address in addrs:
                channel = grpc.aio.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)
                pool.workers.append(Worker(role, address, channel, stub_cls(channel)))
        return pool

    def tier(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def ready(self) -> bool:
        return all(any(w.routable for w in self.tier(role)) for role in ("prefill", "decode"))

    def pick(self, role: str) -> Worker | None:
        candidates = [w for w in self.tier(role) if w.routable]
        return min(candidates, key=lambda w: w.num_inflight, default=None)

    def kv_transport(self, prefill: Worker, preference: str = "auto") -> str:
        """The transport ``prefill`` publishes a prompt's KV through: one every routable
        decode worker reads, so whichever decode worker is picked next can load it.

        ``auto`` follows where the workers run (kvtransfer.transport.choose_transport):
        one host: shared memory on CPU, CUDA IPC on GPU; across hosts: NCCL on GPU, TCP on
        CPU; failing that, the prefill worker's first common transport.
        """
        assert prefill.info is not None
        readers = [w.info for w in self.tier("decode") if w.routable]
        common = [t for t in prefill.info.transports if all(t in r.transports for r in readers)]
        if preference != "auto":
            if preference not in common:
                raise LookupError(
                    f"KV transport {preference!r} is not served by prefill worker "
                    f"{prefill.address} and read by every decode worker (common: {common})"
                )
            return preference
        if not common:
            raise LookupError(f"prefill worker {prefill.address} shares no KV transport with the decode tier")
        same_host = all(r.host_id == prefill.info.host_id for r in readers)
        gpu = prefill.info.kv_device == "cuda"
        wanted = ("cuda_ipc" if gpu else "shm") if same_host else ("nccl" if gpu else "tcp")
        return wanted if wanted in common else common[0]

    def model_info(self) -> worker_pb2.WorkerInfo | None:
        """Limits the gateway validates against: those of a routable decode worker."""
        worker = self.pick("decode")
        return worker.info if worker else None

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))
        self._check_compatibility()

    async def _poll(self, worker: Worker) -> None:
        healthy = await rpc.check_health(worker.channel)
        if healthy and worker.info is None:
            try:
                worker.info = await worker.stub.Info(worker_pb2.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                logger.warning("%s worker %s: Info failed: %s", worker.role, worker.address, e.details())
                healthy = False
        if healthy != worker.healthy:
            logger.info("%s worker %s is %s", worker.role, worker.address, "up" if healthy else "down")
        worker.healthy = healthy

    def _check_compatibility(self) -> None:
        known = [w for w in self.workers if w.info is not None]
        if not known:
            return
        reference = known[0].info
        for worker in known[1:]:
            problem = _incompatibility(reference, worker.info)
            if problem != worker.incompatible and problem:
                logger.error("%s worker %s cannot be used: %s", worker.role, worker.address, problem)
            worker.incompatible = problem

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in self.workers))


def _incompatibility(a: worker_pb2.WorkerInfo, b: worker_pb2.WorkerInfo) -> str | None:
    if a.layout != b.layout:
        return f"KV layout {b.layout} differs from {a.layout} (same model, dtype and --block-size needed)"
    if not set(a.transports) & set(b.transports):
        return f"no common KV transport ({list(a.transports)} vs {list(b.transports)})"
    if a.vocab_size != b.vocab_size or a.max_model_len != b.max_model_len:
        return "model limits differ (vocab size or max_model_len)"
    return None
