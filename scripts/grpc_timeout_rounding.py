"""How precisely a grpc.aio server learns a call's deadline: the client's timeout against
the time remaining the server sees at once (the evidence for `gateway.queue.deadline_precision_s`).

    .venv/bin/python scripts/grpc_timeout_rounding.py

gRPC sends the timeout in a header rounded up to its encoding's unit (whole seconds beyond
100 s), so two calls with the same timeout can look up to a unit apart.
"""

import asyncio

import grpc
from grpc import aio

TIMEOUTS_S = [298 + 0.25 * i for i in range(17)] + [99.95, 100.02, 50.037, 10.001, 9.999, 5.0037, 0.5004]


async def main() -> None:
    async def remaining(request: bytes, context) -> bytes:
        return repr(context.time_remaining()).encode()

    server = aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "probe.Probe", {"Remaining": grpc.unary_unary_rpc_method_handler(remaining)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/probe.Probe/Remaining")
            await call(b"", timeout=5)  # connect first: no connection time in the figures
            print(f"{'timeout (s)':>12} {'server sees (s)':>16} {'difference (s)':>15}")
            for timeout in TIMEOUTS_S:
                seen = float((await call(b"", timeout=timeout)).decode())
                print(f"{timeout:>12.4f} {seen:>16.4f} {seen - timeout:>+15.4f}")
    finally:
        await server.stop(None)


if __name__ == "__main__":
    asyncio.run(main())
