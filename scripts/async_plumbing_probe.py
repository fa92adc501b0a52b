"""CPU per item of the gateway's token plumbing in isolation (uvloop, no gRPC): a token
handed from a producer to a consumer through an asyncio.Queue per request (as
gateway.decode_stream's SharedDecode) against a deque with one waiter future, each with the
consumer reading it directly or through five nested async generators (the gateway's
Generate -> rpc_errors -> _generate -> _run -> _decode chain over SharedDecode).

    .venv/bin/python scripts/async_plumbing_probe.py [-n 200000]

Prints process CPU µs per item for each of the four; the differences are what replacing the
queue or flattening the chain could save per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import uvloop


class Mailbox:
    """A deque and at most one waiting getter: asyncio.Queue without its bookkeeping."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


async def _source(box):
    while (item := await box.get()) is not None:
        yield item


async def _wrap(inner):
    async for item in inner:
        yield item


async def per_item_us(box_type, depth: int, n: int) -> float:
    box = box_type()
    stream = _source(box)
    for _ in range(depth):
        stream = _wrap(stream)

    async def consume() -> int:
        return sum([1 async for _ in stream])

    consumer = asyncio.ensure_future(consume())
    t0 = time.process_time()
    for i in range(n):
        box.put_nowait(i)
        await asyncio.sleep(0)  # the consumer takes it, as a stream's task would
    box.put_nowait(None)
    assert await consumer == n
    return (time.process_time() - t0) / n * 1e6


async def main(n: int) -> None:
    for box_type in (asyncio.Queue, Mailbox):
        for depth in (0, 5):
            print(f"{box_type.__name__:8s} nested generators {depth}: "
                  f"{await per_item_us(box_type, depth, n):.2f} us per item")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=200_000)
    uvloop.run(main(parser.parse_args().n))
