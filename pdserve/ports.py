"""Ports picked now and bound later, by another process, seconds on.

A port the kernel hands out for ``bind(("", 0))`` comes from the ephemeral range
(net.ipv4.ip_local_port_range), the same range it draws from for every outgoing connection
and every other ``bind(0)``: vLLM picks its ZMQ and torch.distributed ports that way while an
engine starts. A stack picked its workers' and KV transports' ports like that and bound them
only after the engine had loaded (a prefill engine's KV control server, ten seconds later),
and once such a port had gone to the other engine starting beside it: the prefill engine
died with "Address already in use". Ports are picked below the ephemeral range instead, where
nothing is handed out without being asked for by number; the kernel's pick is the fallback
when that range is too small to search.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Below these no pick is made: well-known and registered ports that services ask for by number.
LOWEST = 10000
TRIES = 100

_handed_out: set[int] = set()  # one process never gets one port twice


def ephemeral_low(path: str = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 if unreadable)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None,
              range_file: str = EPHEMERAL_RANGE_FILE) -> int:
    """A port free now, outside the ephemeral range, not handed out before by this process."""
    rng = rng or random.Random()
    high = ephemeral_low(range_file)
    if high - LOWEST >= 1000:
        for _ in range(TRIES):
            port = rng.randrange(LOWEST, high)
            if port not in _handed_out and bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def free_port_block(count: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port p such that p .. p + count - 1 are all free right now."""
    for _ in range(tries):
        base = free_port(host)
        if all(bindable(host, port) for port in range(base + 1, base + count)):
            _handed_out.update(range(base, base + count))
            return base
    raise OSError(f"no block of {count} free ports found")
