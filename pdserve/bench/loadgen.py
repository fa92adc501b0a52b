"""The load drivers: open loop (requests arrive on a schedule) and closed loop (N users).

Open loop sends each request at its arrival time whatever the server's state, as real
traffic does; it is what exposes queueing and overload. With `max_concurrency` it also
caps the requests in flight (``vllm bench serve --max-concurrency``); requests over the
cap wait client-side and that wait counts in their latency, because they were due.
Closed loop keeps exactly `concurrency` requests in flight, each "user" sending its next
request when the last one ends; throughput then adapts to the server.

A run ends after `num_requests` requests or, with `duration_s`, when no new request is
due before that time; requests in flight are always awaited, never cut off.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from pdserve.bench.arrivals import arrival_gaps_s
from pdserve.bench.backends import Backend, Clock
from pdserve.bench.record import RequestRecord
from pdserve.bench.workload import RequestSpec


@dataclass(slots=True)
class LoadConfig:
    # Open loop at this mean rate (requests/s); None: closed loop at `concurrency`.
    rate_rps: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate_rps is None and self.concurrency is None:
            raise ValueError("give a request rate (open loop) or a concurrency (closed loop)")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a number of requests or a duration")
        if self.rate_rps == float("inf") and self.num_requests is None:
            raise ValueError("an infinite request rate needs a number of requests")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def describe(self) -> str:
        if self.rate_rps is None:
            return f"closed loop, concurrency {self.concurrency}"
        cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
        return f"open loop, {self.rate_rps:g} req/s, burstiness {self.burstiness:g}{cap}"


class Progress:
    """Requests done / total on stderr: one updating line on a terminal, else every 10%."""

    def __init__(self, total: int | None, label: str, stream: TextIO = sys.stderr) -> None:
        self._total, self._label, self._stream = total, label, stream
        self._done = 0
        self._tty = stream.isatty()
        self._every = max(1, (total or 10) // 10)

    def advance(self) -> None:
        self._done += 1
        if not self._tty and self._done % self._every and self._done != self._total:
            return
        total = f"/{self._total}" if self._total else ""
        end = "\r" if self._tty and self._done != self._total else "\n"
        self._stream.write(f"[bench] {self._label}: {self._done}{total} requests done{end}")
        self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")


def run_clock() -> Clock:
    """Seconds since this call, on the monotonic high-resolution clock."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


async def drive(backend: Backend, requests: Iterator[RequestSpec], load: LoadConfig,
                progress: Progress | None = None) -> list[RequestRecord]:
    """Runs one load phase; records come back in send order."""
    now = run_clock()
    if load.rate_rps is None:
        return await _closed_loop(backend, requests, load, now, progress)
    return await _open_loop(backend, requests, load, now, progress)


async def _send(backend: Backend, spec: RequestSpec, now: Clock,
                progress: Progress | None) -> RequestRecord:
    record = await backend.generate(spec, now)
    if progress is not None:
        progress.advance()
    return record


async def _open_loop(backend: Backend, requests: Iterator[RequestSpec], load: LoadConfig,
                     now: Clock, progress: Progress | None) -> list[RequestRecord]:
    assert load.rate_rps is not None
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def send_at(spec: RequestSpec, due_s: float) -> RequestRecord:
        if cap is None:
            return await _send(backend, spec, now, progress)
        async with cap:
            record = await _send(backend, spec, now, progress)
        record.send_s = min(record.send_s, due_s)  # latency counts from when it was due
        return record

    tasks: list[asyncio.Task[RequestRecord]] = []
    gaps = arrival_gaps_s(load.rate_rps, load.burstiness, load.seed)
    due_s = 0.0
    for spec in requests:
        if load.num_requests is not None and len(tasks) >= load.num_requests:
            break
        if load.duration_s is not None and due_s >= load.duration_s:
            break
        # Wait here rather than in the task, so the endless iterator is read on schedule.
        await asyncio.sleep(max(0.0, due_s - now()))
        tasks.append(asyncio.create_task(send_at(spec, due_s)))
        due_s += next(gaps)
    return list(await asyncio.gather(*tasks))


async def _closed_loop(backend: Backend, requests: Iterator[RequestSpec], load: LoadConfig,
                       now: Clock, progress: Progress | None) -> list[RequestRecord]:
    assert load.concurrency is not None
    records: list[RequestRecord] = []
    num_sent = 0

    def next_spec() -> RequestSpec | None:
        nonlocal num_sent
        if load.num_requests is not None and num_sent >= load.num_requests:
            return None
        if load.duration_s is not None and now() >= load.duration_s:
            return None
        num_sent += 1
        return next(requests, None)

    async def user() -> None:
        while (spec := next_spec()) is not None:
            records.append(await _send(backend, spec, now, progress))

    await asyncio.gather(*(user() for _ in range(load.concurrency)))
    records.sort(key=lambda r: r.send_s)
    return records
