"""Fake workers, tickets and a clock for the dispatcher's unit tests (no servers: Worker
objects with WorkerInfo and no channel)."""

from __future__ import annotations

import asyncio

from gateway.dispatch import ClassObjectives, Dispatcher
from gateway.placement import PlacementConfig
from gateway.queue import Priority, RequestQueue, Ticket
from gateway.workers import Worker, WorkerPool
from protos import worker_pb2

I, O = Priority.INTERACTIVE, Priority.OFFLINE


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def worker(role: str, address: str) -> Worker:
    info = worker_pb2.WorkerInfo(worker_id=address, role=role, kv_capacity_tokens=100_000, max_num_seqs=8,
                                 layout=worker_pb2.KvLayout(block_size=32))
    return Worker(role, address, channel=None, stub=None, info=info, healthy=True)  # type: ignore[arg-type]


def dispatcher(policy="slo", ttft=None, **placement) -> tuple[Dispatcher, WorkerPool, Clock]:
    pool = WorkerPool([worker("prefill", "p0"), worker("decode", "d0")])
    clock = Clock()
    objectives = ClassObjectives({p: ttft for p in Priority}, {p: None for p in Priority})
    d = Dispatcher(RequestQueue(policy), pool, PlacementConfig(**placement), objectives,
                   admission=policy == "slo", clock=clock)
    return d, pool, clock


def ticket(name, tokens, priority=I, arrival=100.0, deadline=None, ttft=None) -> Ticket:
    return Ticket(name, priority, tokens, 8, arrival, deadline_s=deadline, ttft_slo_s=ttft)


def measured_prefill(pool: WorkerPool, tokens: int, contended: bool = False) -> Worker:
    """The prefill worker, having prefilled ``tokens`` in the 10 s before the clock's start
    (with decode requests running beside it, ``contended``)."""
    p0 = pool.by_address("p0")
    p0.prefill_meter.start(90.0, contended)
    p0.prefill_meter.finish(tokens, 100.0, contended)
    return p0


def run(coro):
    return asyncio.run(coro)
