"""pdserve-fifo on pdserve's engines: a second gateway, ``--policy fifo``, over the workers
of the pdserve stack the interleaved compare booted (`--fifo-engines shared`, the default).

The two pdserves of the mixed compare differ only in their gateway's flags
(`systems.PLAIN_FIFO_FLAGS`), yet each ran a stack of its own: with vLLM, five engines,
more than a 24 GiB machine holds, so the compare fell back to one system after the other,
and the ratio of turns measured half an hour apart moved with the machine's speed (the
twenty-fifth session's two mixed runs of one code: 1.21x and 0.75x, docs/benchmarks.md).
Here fifo's gateway serves from pdserve's prefill and decode workers, given to it as static
workers: three engines in all, booted together and measured in turns.

Only one of the two gateways has work at a time, so each one's account of the workers' load
(what it sent and has not seen finish) stays true: while pdserve measures, fifo's gateway is
frozen; while fifo measures, pdserve's gateway is left running, idle (its workers heartbeat
to it; a frozen registry would drop them), and the CPU it uses meanwhile is what the JSON
reports as pdserve's idle cores. Fifo's prompts get other token ids than pdserve's at the
same rate (`CONTENT_SALT`; lengths and arrival times are the same), so neither finds the
other's prompts in the engines' prefix caches.
"""

from __future__ import annotations

import sys

import grpc
import psutil

from pdserve.bench.servers import ServerSpec
from protos import worker_pb2, worker_pb2_grpc

SYSTEM = "pdserve-fifo"
HOST = "pdserve"  # the system whose workers fifo's gateway serves from
CONTENT_SALT = 1  # compare.rate_content_seed's salt for fifo's prompts
LIST_TIMEOUT_S = 10.0


class SharedFifoError(RuntimeError):
    """pdserve's stack cannot lend its workers; the message says why."""


def worker_addresses(gateway: str) -> tuple[list[str], list[str]]:
    """The ready prefill and decode workers of the gateway at ``gateway`` (HOST:PORT)."""
    try:
        with grpc.insecure_channel(gateway) as channel:
            reply = worker_pb2_grpc.RegistryStub(channel).ListWorkers(
                worker_pb2.ListWorkersRequest(), timeout=LIST_TIMEOUT_S)
    except grpc.RpcError as e:
        raise SharedFifoError(f"listing {HOST}'s workers at {gateway}: {e.code().name}: "
                              f"{e.details()}") from e
    ready = [w for w in reply.workers if w.state == "ready"]
    prefill = sorted(w.address for w in ready if w.role == "prefill")
    decode = sorted(w.address for w in ready if w.role == "decode")
    if not decode:
        states = ", ".join(f"{w.role} {w.address} {w.state}" for w in reply.workers) or "none"
        raise SharedFifoError(f"{HOST}'s gateway at {gateway} has no ready decode worker "
                              f"(workers: {states})")
    return prefill, decode


def gateway_argv(port: int, model: str, prefill: list[str], decode: list[str],
                 flags: tuple[str, ...]) -> list[str]:
    """`pdserve gateway` over the given workers with ``flags`` (fifo's policy flags); the
    rest of its flags are `pdserve up`'s defaults, as the stack's own gateway has them."""
    workers = [arg for address in prefill for arg in ("--prefill", address)]
    workers += [arg for address in decode for arg in ("--decode", address)]
    return [sys.executable, "-m", "pdserve.cli", "gateway", "--host", "127.0.0.1", "--port",
            str(port), "--model", model, *workers, *flags]


def gateway_spec(argv: list[str], port: int, env: dict[str, str],
                 boot_timeout_s: float) -> ServerSpec:
    # The gateway prints "READY HOST:PORT" once serving; gRPC health then says SERVING
    # when a decode worker is routable.
    return ServerSpec(SYSTEM, argv, env, ready_pattern=rf"^READY \S*:{port}\b",
                      grpc_health_target=f"127.0.0.1:{port}", boot_timeout_s=boot_timeout_s)


def is_gateway_cmdline(argv: list[str]) -> bool:
    """Whether ``argv`` is `pdserve.cli gateway ...` (how `pdserve up` starts its gateway)."""
    return any(a == "pdserve.cli" and argv[i + 1:i + 2] == ["gateway"]
               for i, a in enumerate(argv))


def gateway_pid(up_pid: int) -> int | None:
    """The pid of the gateway `pdserve up` (``up_pid``) runs; None if it has none now."""
    try:
        children = psutil.Process(up_pid).children()
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if is_gateway_cmdline(child.cmdline()):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    return None
