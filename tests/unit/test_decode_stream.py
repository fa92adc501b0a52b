"""DecodeStream: the decode worker's servicer over a fake engine that steps when told, in
a real grpc.aio server on 127.0.0.1, and the gateway's shared call (gateway.decode_stream)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from decode_worker.server import DecodeServicer
from gateway.decode_stream import DecodeStreams
from pdserve.membership import InflightInterceptor
from protos import worker_pb2, worker_pb2_grpc


class SteppedEngine:
    """AsyncLLM.generate's shape: every running request gets one token per `step()`, all
    woken in the same loop turn, as vLLM's output handler wakes them after a step."""

    def __init__(self) -> None:
        self.waiting = 0
        self.aborted: list[str] = []
        self._step = asyncio.Event()

    def step(self) -> None:
        self._step.set()
        self._step = asyncio.Event()

    async def generate(self, prompt, params, request_id):
        made = 0
        try:
            while made < params.max_tokens:
                self.waiting += 1
                step = self._step
                try:
                    await step.wait()
                finally:
                    self.waiting -= 1
                made += 1
                finished = made == params.max_tokens
                yield SimpleNamespace(
                    outputs=[SimpleNamespace(token_ids=[100 + made],
                                             finish_reason="length" if finished else None)],
                    finished=finished, kv_transfer_params=None, num_cached_tokens=0)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise


def servicer(engine: SteppedEngine, inflight: InflightInterceptor) -> DecodeServicer:
    s = DecodeServicer.__new__(DecodeServicer)  # no vLLM engine: only what Decode reads
    s._engine, s._inflight = engine, inflight
    s._cfg = SimpleNamespace(kv_transports=("shm",))
    s._info = worker_pb2.WorkerInfo(max_model_len=64)
    return s


def request(request_id: str, max_tokens: int, token_ids=(1, 2, 3)) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=request_id, token_ids=list(token_ids),
                                    sampling=worker_pb2.EngineSampling(max_tokens=max_tokens, top_p=1.0))


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def run_with_worker(scenario):
    async def main():
        engine, inflight = SteppedEngine(), InflightInterceptor()
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer(engine, inflight), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            return await scenario(engine, inflight, worker_pb2_grpc.DecodeWorkerStub(channel), server)
        finally:
            await channel.close()
            await server.stop(None)

    return asyncio.run(main())


def test_one_message_carries_every_request_a_step_advanced():
    """Three requests of 2, 3 and 3 tokens: three steps, three messages (not eight)."""
    async def scenario(engine, inflight, stub, server):
        call = stub.DecodeStream()
        for stream_id, max_tokens in ((1, 2), (2, 3), (3, 3)):
            await call.write(worker_pb2.DecodeStreamRequest(stream_id=stream_id,
                                                            start=request(f"r{stream_id}", max_tokens)))
        await until(lambda: engine.waiting == 3)
        running = inflight.num_inflight
        messages = []
        for waiting_after in (3, 2, 0):
            engine.step()
            message = await call.read()
            messages.append([(c.stream_id, list(c.reply.token_ids), c.reply.finish_reason)
                             for c in message.chunks])
            await until(lambda: engine.waiting == waiting_after)
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF  # the caller closed, nothing runs: the call ends
        return running, messages, inflight.num_inflight

    running, messages, after = run_with_worker(scenario)
    assert running == 3 and after == 0
    assert messages == [
        [(1, [101], ""), (2, [101], ""), (3, [101], "")],
        [(1, [102], "length"), (2, [102], ""), (3, [102], "")],
        [(2, [103], "length"), (3, [103], "length")],
    ]


def test_the_gateways_shared_call_keeps_each_requests_tokens_status_and_cancel_its_own():
    async def scenario(engine, inflight, stub, server):
        streams = DecodeStreams(stub, "127.0.0.1:test")
        good, bad, gone = (streams.start(request("good", 2)), streams.start(request("bad", 2, token_ids=())),
                           streams.start(request("gone", 5)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in bad:
                pass
        await until(lambda: engine.waiting == 2)
        engine.step()
        got = []
        async for reply in good:
            got.append((list(reply.token_ids), reply.finish_reason))
            if not reply.finish_reason:
                await until(lambda: engine.waiting == 2)
                engine.step()
        gone.cancel()
        await until(lambda: "gone" in engine.aborted and inflight.num_inflight == 0)
        streams.close()
        return refused.value, got, engine.aborted

    refused, got, aborted = run_with_worker(scenario)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "token_ids is empty"
    assert got == [([101], ""), ([102], "length")]
    assert aborted == ["gone"]


def test_a_call_that_ends_fails_every_request_on_it_and_the_next_request_opens_another():
    async def scenario(engine, inflight, stub, server):
        streams = DecodeStreams(stub, "127.0.0.1:test")
        first, second = streams.start(request("a", 3)), streams.start(request("b", 3))
        await until(lambda: engine.waiting == 2)
        streams._call.cancel()  # as a worker's death ends the call (here from our side)
        codes = []
        for shared in (first, second):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in shared:
                    pass
            codes.append(e.value.code())
        await until(lambda: inflight.num_inflight == 0)
        again = streams.start(request("c", 1))
        await until(lambda: engine.waiting == 1)
        engine.step()
        replies = [list(r.token_ids) async for r in again]
        streams.close()
        return codes, sorted(engine.aborted), replies

    codes, aborted, replies = run_with_worker(scenario)
    assert codes == [grpc.StatusCode.CANCELLED, grpc.StatusCode.CANCELLED]
    assert aborted == ["a", "b"]  # the worker aborted them when their call ended
    assert replies == [[101]]
