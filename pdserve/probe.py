"""A server's gRPC health, for containers and for clients that wait for a stack.

``python -m pdserve.probe HOST:PORT`` exits 0 while the server there is SERVING and 1
otherwise (the two codes a Docker healthcheck knows), printing the state on one line. Every
pdserve server (gateway, prefill, decode) serves ``grpc.health.v1.Health``; the gateway is
SERVING only while each tier has a ready worker.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

UNREACHABLE = "UNREACHABLE"


@dataclass(frozen=True)
class Health:
    # SERVING, NOT_SERVING, SERVICE_UNKNOWN (no such service there), or UNREACHABLE
    status: str
    detail: str = ""

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"

    def __str__(self) -> str:
        return f"{self.status} ({self.detail})" if self.detail else self.status


def check(address: str, timeout_s: float = 2.0, service: str = "") -> Health:
    """One health check of ``service`` ('' is the server as a whole) at ``address``."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return Health("SERVICE_UNKNOWN", f"no service {service!r} at {address}")
            return Health(UNREACHABLE, unreachable_reason(e))
    return Health(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def unreachable_reason(e: grpc.RpcError) -> str:
    """A short reason a call found no server to talk to."""
    details = e.details() or ""
    if "refused" in details.lower():
        return "connection refused"
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time"
    return f"{e.code().name}: {details}"


def wait_serving(address: str, timeout_s: float, poll_s: float = 1.0,
                 on_change: Callable[[Health], None] | None = None) -> Health:
    """Checks until the server is SERVING or ``timeout_s`` has passed; the last state.
    ``on_change`` hears each state that differs from the one before."""
    deadline = time.monotonic() + timeout_s
    last: Health | None = None
    while True:
        health = check(address, timeout_s=max(0.1, min(2.0, deadline - time.monotonic())))
        if health.serving or time.monotonic() >= deadline:
            return health
        if on_change is not None and health != last:
            on_change(health)
        last = health
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="HOST:PORT of a pdserve gateway or worker")
    parser.add_argument("--service", default="", help="one service's health ('' : the server's)")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    health = check(args.address, args.timeout_s, args.service)
    print(f"{args.address}: {health}")
    return 0 if health.serving else 1


if __name__ == "__main__":
    sys.exit(main())
