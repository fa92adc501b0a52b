"""One DecodeStream call per decode worker, shared by every request the gateway sends it.

Decode costs a gRPC message per request per engine step on both ends of the hop; over
DecodeStream (protos/worker.proto) a step's tokens for all the requests it advanced come in
one message. `DecodeStreams.start` sends a request on the worker's call (opening one when
none is open) and returns a `SharedDecode`, which iterates and cancels like the
`Decode` call it replaces and raises the same `grpc.aio.AioRpcError` on failure: the
request's own status when the worker ended it with one, the call's when the call ended
(a worker gone fails every request it was running, as their Decode calls would).
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from protos import worker_pb2

logger = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeStreams:
    """The gateway's end of one decode worker's DecodeStream call."""

    def __init__(self, stub, address: str) -> None:
        self._stub = stub
        self._address = address
        self._ids = itertools.count(1)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._outgoing: asyncio.Queue | None = None
        self._open: dict[int, asyncio.Queue] = {}
        self._tasks: set[asyncio.Task] = set()

    def start(self, request: worker_pb2.DecodeRequest) -> SharedDecode:
        if self._call is None:
            self._connect()
        assert self._outgoing is not None
        stream_id = next(self._ids)
        replies: asyncio.Queue = asyncio.Queue()
        self._open[stream_id] = replies
        self._outgoing.put_nowait(worker_pb2.DecodeStreamRequest(stream_id=stream_id, start=request))
        return SharedDecode(self, stream_id, replies)

    def _cancel(self, stream_id: int) -> None:
        if self._open.pop(stream_id, None) is not None and self._outgoing is not None:
            self._outgoing.put_nowait(worker_pb2.DecodeStreamRequest(stream_id=stream_id, cancel=True))

    def _forget(self, stream_id: int) -> None:
        self._open.pop(stream_id, None)

    def _connect(self) -> None:
        self._outgoing = outgoing = asyncio.Queue()
        self._call = call = self._stub.DecodeStream()
        for coroutine in (self._write(call, outgoing), self._read(call)):
            task = asyncio.ensure_future(coroutine)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _write(self, call, outgoing: asyncio.Queue) -> None:
        try:
            while True:
                await call.write(await outgoing.get())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.CancelledError):
            pass  # the call ended: _read fails what was open on it
        except Exception:  # noqa: BLE001 - a write on a finished call; the reader says why
            logger.debug("writing to decode worker %s's stream failed", self._address, exc_info=True)

    async def _read(self, call) -> None:
        error = None
        try:
            async for response in call:
                for chunk in response.chunks:
                    replies = self._open.get(chunk.stream_id)
                    if replies is not None:
                        replies.put_nowait(chunk)
            error = _error(grpc.StatusCode.UNAVAILABLE, f"decode worker {self._address} ended its stream")
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the gateway closed its stream")
            raise
        finally:
            if self._call is call:  # the next request opens a new call
                self._call = self._outgoing = None
                call.cancel()
            failed, self._open = self._open, {}
            for replies in failed.values():
                replies.put_nowait(error)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()


class SharedDecode:
    """One request on a DecodeStream call: async-iterates its DecodeResponses; `cancel`."""

    def __init__(self, streams: DecodeStreams, stream_id: int, replies: asyncio.Queue) -> None:
        self._streams = streams
        self._id = stream_id
        self._replies = replies
        self._done = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while not self._done:
            item = await self._replies.get()
            if isinstance(item, grpc.aio.AioRpcError):
                self._done = True
                raise item
            if item.error_code:
                self._done = True
                self._streams._forget(self._id)
                raise _error(_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN), item.error_message)
            if item.reply.finish_reason:
                self._done = True
                self._streams._forget(self._id)
            yield item.reply

    def cancel(self) -> None:
        """Stops the request on the worker unless it already ended (idempotent)."""
        if not self._done:
            self._done = True
            self._streams._cancel(self._id)
