"""The CPU floor of relaying tokens through a grpc.aio process, without pdserve in it.

The gateway receives each streamed token from a decode worker (one gRPC message) and
sends it to its caller (another). This measures what those two messages cost a process
that does nothing else: a *source* process streams `tokens` GenerateResponse messages per
call on engine-like steps (`step_ms`); a *relay* process (grpc.aio on uvloop, as the
gateway) serves Generate by calling the source and forwarding each message; the client
(this process) runs `streams` calls at once, `calls` in all. CPU is each server process's
user + system time from /proc, before and after.

    python -m pdserve.bench.grpc_floor [--streams 64] [--calls 128] [--tokens 128]

Prints the relay's and the source's CPU per token (the source's is the floor of sending
alone, plus a timer per message). With `--engine-steps` the source wakes once per step and
hands every open stream its token through a queue, as the gateway's shared decode stream
does: its CPU is then the floor of the gateway's send half alone (a wake-up per stream per
step, a message per token), without a timer per stream. Compare with the gateway's figure
(`scripts/bench_gateway_cpu.sh`): what is above the relay's is pdserve's own work per token.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time
from pathlib import Path

import grpc

from pdserve import rpc
from protos import generation_pb2, generation_pb2_grpc


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Source(generation_pb2_grpc.GenerationServicer):
    def __init__(self, step_s: float, per_message: int, engine_steps: bool = False) -> None:
        self.step_s, self.per_message, self.engine_steps = step_s, per_message, engine_steps
        self.open: set[asyncio.Queue] = set()
        self.ticker: asyncio.Task | None = None

    async def _tick(self) -> None:
        """One engine step every step_s: a token for every open stream."""
        while True:
            await asyncio.sleep(self.step_s)
            for tokens in self.open:
                tokens.put_nowait(1)

    async def Generate(self, request, context):
        if self.engine_steps:
            async for response in self._stepped(request):
                yield response
            return
        n, k = request.sampling.max_tokens, self.per_message
        for i in range(0, n, k):
            batch = range(i, min(i + k, n))
            await asyncio.sleep(self.step_s * len(batch))
            yield generation_pb2.GenerateResponse(request_id=request.request_id,
                                                  token_ids=[1000 + j for j in batch],
                                                  text=" tok" * len(batch))

    async def _stepped(self, request):
        if self.ticker is None:
            self.ticker = asyncio.create_task(self._tick())
        n, k = request.sampling.max_tokens, self.per_message
        tokens: asyncio.Queue = asyncio.Queue()
        self.open.add(tokens)
        try:
            sent = 0
            while sent < n:
                count = min(k, n - sent)
                for _ in range(count):
                    await tokens.get()
                yield generation_pb2.GenerateResponse(request_id=request.request_id,
                                                      token_ids=[1000 + j for j in range(sent, sent + count)],
                                                      text=" tok" * count)
                sent += count
        finally:
            self.open.discard(tokens)


class Relay(generation_pb2_grpc.GenerationServicer):
    def __init__(self, upstream: str) -> None:
        self.channel = grpc.aio.insecure_channel(upstream, options=rpc.CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def Generate(self, request, context):
        async for response in self.stub.Generate(request):
            yield response


def serve(role: str, port_out, upstream: str | None, step_s: float, per_message: int,
          engine_steps: bool = False) -> None:
    import uvloop

    async def main() -> None:
        server = grpc.aio.server(options=rpc.CHANNEL_OPTIONS)
        servicer = Source(step_s, per_message, engine_steps) if role == "source" else Relay(upstream or "")
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.send(port)
        await server.wait_for_termination()

    uvloop.run(main())


def start(role: str, upstream: str | None, step_s: float, per_message: int = 1,
          engine_steps: bool = False) -> tuple[multiprocessing.Process, int]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(role, child, upstream, step_s, per_message, engine_steps),
                       daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise RuntimeError(f"the {role} did not start")
    return proc, parent.recv()


async def drive(target: str, streams: int, calls: int, tokens: int) -> int:
    received = 0
    async with grpc.aio.insecure_channel(target, options=rpc.CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        todo = iter(range(calls))

        async def worker() -> None:
            nonlocal received
            for i in todo:
                request = generation_pb2.GenerateRequest(
                    request_id=f"r{i}", token_ids=[1, 2, 3],
                    sampling=generation_pb2.SamplingParams(max_tokens=tokens))
                async for response in stub.Generate(request):
                    received += len(response.token_ids)

        await asyncio.gather(*(worker() for _ in range(streams)))
    return received


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--calls", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=50.0,
                   help="the source's time between a stream's tokens (an engine step)")
    p.add_argument("--tokens-per-message", type=int, default=1,
                   help="tokens the source sends per message (a stream interval)")
    p.add_argument("--engine-steps", action="store_true",
                   help="one timer for all streams, tokens handed over through queues (the "
                        "gateway's send half), instead of a timer per stream")
    args = p.parse_args()
    source, source_port = start("source", None, args.step_ms / 1000, args.tokens_per_message,
                                 args.engine_steps)
    relay, relay_port = start("relay", f"127.0.0.1:{source_port}", 0.0)
    try:
        asyncio.run(drive(f"127.0.0.1:{relay_port}", args.streams, args.streams, 4))  # warm
        before = {name: cpu_s(p.pid) for name, p in (("relay", relay), ("source", source))}
        t0 = time.monotonic()
        tokens = asyncio.run(drive(f"127.0.0.1:{relay_port}", args.streams, args.calls,
                                   args.tokens))
        wall = time.monotonic() - t0
        used = {name: cpu_s(p.pid) - before[name] for name, p in (("relay", relay),
                                                                  ("source", source))}
    finally:
        for proc in (relay, source):
            proc.kill()
            proc.join()
    expected = args.calls * args.tokens
    if tokens != expected:
        raise SystemExit(f"received {tokens} tokens, expected {expected}")
    messages = args.calls * -(-args.tokens // args.tokens_per_message)
    print(f"{args.streams} streams, {args.calls} calls x {args.tokens} tokens, "
          f"{args.tokens_per_message} per message ({messages} messages per hop) in "
          f"{wall:.1f} s, step {args.step_ms:g} ms")
    print(f"relay (receive + send per token): {used['relay']:.2f} s CPU, "
          f"{used['relay'] / tokens * 1e6:.0f} us per token")
    timers = "one timer per step" if args.engine_steps else "plus a timer per message"
    print(f"source (send per token, {timers}): {used['source']:.2f} s CPU, "
          f"{used['source'] / tokens * 1e6:.0f} us per token")


if __name__ == "__main__":
    main()
