"""The producer-serves-staged-blocks pattern that tcp, nccl and cuda_ipc share.

A producer transport built with ``<name>_port`` in its extra config runs a control server
(port 0 picks a free one; ``extra_config`` then reports the bound port). ``send`` stages the
prompt's blocks under a lease and returns; a consumer later asks for them:

  1. Fetch: the consumer connects to the location's host:port and sends
     ``{"op": "fetch", "key", "first_block", "num_blocks", "layout"}``.
  2. Check: the producer refuses with ``missing`` (no lease), ``layout`` (the consumer's
     layout differs from its own) or ``size`` (the range overruns the staged blocks);
     otherwise it replies with its layout and the exact byte count it will move.
  3. Move: the subclass moves the bytes (a TCP stream, a gloo/NCCL send, a CUDA IPC handle).
  4. Ack: the consumer confirms it holds the blocks; the producer ends the lease.

``release(location)`` asks the producer to end the lease from any process; a producer that
is gone holds nothing, so failing to reach it is not an error.

Extra config keys: ``<name>_host`` (default 127.0.0.1), ``<name>_port`` (serve only when
set), ``kv_timeout_s`` (every socket operation and wait), ``kv_lease_s`` (unfetched staged
blocks are dropped after it), ``kv_staging_pool_bytes`` (idle staging buffers kept).
"""

from __future__ import annotations

import logging
import socket
import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.layout import KVHandle, KVLayout, LayoutMismatchError
from kvtransfer.staging import Lease, LeaseTable
from kvtransfer.transport import KVTransferError, KVTransport
from kvtransfer.wire import (
    Address,
    ControlServer,
    connect,
    refusal,
    recv_message,
    request,
    send_message,
    socket_errors,
)

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0  # release() is a classmethod: no config reaches it


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int | None = None  # None: this side only fetches
    timeout_s: float = 10.0
    lease_s: float = 120.0
    pool_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port < 65536:
            raise ValueError(f"KV transport port {self.port} is out of range")
        if self.timeout_s <= 0 or self.lease_s <= 0 or self.pool_bytes < 0:
            raise ValueError(f"KV transport timeouts and sizes must be positive: {self}")

    @classmethod
    def from_extra(cls, name: str, extra: Mapping[str, Any] | None) -> ServeConfig:
        extra = extra or {}
        keys = {
            f"{name}_host": ("host", str),
            f"{name}_port": ("port", int),
            "kv_timeout_s": ("timeout_s", float),
            "kv_lease_s": ("lease_s", float),
            "kv_staging_pool_bytes": ("pool_bytes", int),
        }
        return cls(**{
            field: convert(extra[key])
            for key, (field, convert) in keys.items()
            if extra.get(key) is not None
        })


@dataclass(frozen=True, slots=True)
class FetchRange:
    """The handle's blocks ``first_block .. first_block + num_blocks`` of every layer."""

    first_block: int
    num_blocks: int
    nbytes: int


class ServedTransport(KVTransport):
    staging_device: torch.device | None = None  # None: stage on the KV cache's device

    def __init__(
        self, layout: KVLayout, producer_id: str, extra_config: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(layout, producer_id, extra_config)
        self.config = ServeConfig.from_extra(self.name, extra_config)
        self._leases = LeaseTable(self.name, layout, self.config.lease_s, self.config.pool_bytes)
        self._server: ControlServer | None = None
        self._closed = threading.Event()
        if self.config.port is not None:
            self._server = ControlServer(
                self.config.host, self.config.port, self._handle, self.config.timeout_s
            )
            # Leases also end on time when no new send comes along to sweep them.
            threading.Thread(target=self._sweep_loop, name=f"kv-{self.name}-leases", daemon=True).start()

    def _sweep_loop(self) -> None:
        interval_s = max(self.config.lease_s / 4, 0.25)
        while not self._closed.wait(interval_s):
            expired = self._leases.sweep()
            if expired:
                logger.info("%s: lease expired for %d uncollected KV handoffs", self.name, len(expired))

    @property
    def extra_config(self) -> dict[str, Any]:
        """This transport's settings, with the port it actually bound (port 0 picks one)."""
        port = self._server.port if self._server is not None else self.config.port
        return {
            f"{self.name}_host": self.config.host,
            f"{self.name}_port": port,
            "kv_timeout_s": self.config.timeout_s,
            "kv_lease_s": self.config.lease_s,
            "kv_staging_pool_bytes": self.config.pool_bytes,
        }

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @classmethod
    def location_for(cls, key: str, extra_config: Mapping[str, Any] | None = None) -> str:
        config = ServeConfig.from_extra(cls.name, extra_config)
        if not config.port:
            raise ValueError(
                f"{cls.name} KV locations need a fixed {cls.name}_port in the extra config "
                f"(got {config.port}); with port 0 use the producer transport's extra_config"
            )
        if "/" in key:
            raise ValueError(f"KV key {key!r} must not contain '/'")
        return str(Address(cls.name, config.host, config.port, key))

    # ------------------------------ producer ------------------------------

    def send(self, location: str, layers: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
        if self._server is None:
            raise ValueError(f"{self.name} transport has no {self.name}_port: it cannot serve KV")
        address = Address.parse(location, self.name)
        if address.port != self._server.port:
            raise ValueError(f"{location} names port {address.port}; this producer serves on "
                             f"{self._server.port}")
        self._leases.stage(address.key, layers, block_ids, self.staging_device)

    @classmethod
    def release(cls, location: str) -> None:
        address = Address.parse(location, cls.name)
        try:
            with connect(address, RELEASE_TIMEOUT_S) as sock, socket_errors("releasing KV"):
                request(sock, {"op": "release", "key": address.key})
        except KVTransferError as e:
            logger.debug("release of %s: producer unreachable (%s); nothing to free", location, e)

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
        self._leases.clear()

    def _handle(self, conn: socket.socket, message: dict[str, Any]) -> None:
        key = str(message.get("key", ""))
        if message.get("op") == "release":
            self._leases.drop(key)
            send_message(conn, {"ok": True})
            return
        if message.get("op") != "fetch":
            self._handle_other(conn, message)
            return
        with self._leases.reading(key) as lease:
            if lease is None:
                send_message(conn, refusal("missing", f"no staged KV under {key!r} (fetched, "
                                                      "released or expired)"))
                return
            fetch = self._refuse(message) or self._check_fetch(lease, message)
            if isinstance(fetch, dict):
                send_message(conn, fetch)
                return
            send_message(conn, {"ok": True, "layout": self.layout.to_dict(), **_asdict(fetch)})
            self._serve(conn, lease, fetch, message)
            if recv_message(conn).get("op") == "ack":
                self._leases.drop(key)
                send_message(conn, {"ok": True})

    def _handle_other(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """Operations beyond fetch and release (a subclass's own setup)."""
        send_message(conn, refusal("peer", f"unknown operation {message.get('op')!r}"))

    def _refuse(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """A subclass's reason to refuse a fetch before any byte moves; None to proceed."""
        return None

    def _check_fetch(self, lease: Lease, message: dict[str, Any]) -> FetchRange | dict[str, Any]:
        try:
            self.layout.check_compatible(KVLayout.from_dict(message["layout"]))
        except LayoutMismatchError as e:
            return refusal("layout", f"producer {self.producer_id}: {e}")
        first, num = int(message["first_block"]), int(message["num_blocks"])
        if first < 0 or num <= 0 or first + num > lease.num_blocks:
            return refusal("size", f"blocks {first}..{first + num} asked of {lease.num_blocks} "
                                   f"staged under {lease.key!r}")
        return FetchRange(first, num, self.layout.num_layers * num * self.layout.block_nbytes)

    @abstractmethod
    def _serve(
        self, conn: socket.socket, lease: Lease, fetch: FetchRange, message: dict[str, Any]
    ) -> None:
        """Moves the fetched range to the consumer on the other end of ``conn``."""

    # ------------------------------ consumer ------------------------------

    def _open_fetch(
        self, handle: KVHandle, block_ids: torch.Tensor, first_block: int, **extra: Any
    ) -> tuple[socket.socket, FetchRange]:
        """Steps 1-2 of a fetch: returns the open connection and the agreed range."""
        self.layout.check_compatible(handle.layout)
        address = Address.parse(handle.location, self.name)
        num_blocks = block_ids.numel()
        message = {
            "op": "fetch",
            "key": address.key,
            "first_block": first_block,
            "num_blocks": num_blocks,
            "layout": self.layout.to_dict(),
            **extra,
        }
        sock = connect(address, self.config.timeout_s)
        try:
            with socket_errors(f"fetching KV from {address.host}:{address.port}"):
                header = request(sock, message)
            # The producer checked our layout; checking its own too rejects an old or
            # foreign producer before a single byte lands in our blocks.
            self.layout.check_compatible(KVLayout.from_dict(header["layout"]))
            nbytes = self.layout.num_layers * num_blocks * self.layout.block_nbytes
            fetch = FetchRange(first_block, num_blocks, nbytes)
            if header.get("nbytes") != fetch.nbytes or header.get("num_blocks") != num_blocks:
                raise KVTransferError("size", f"producer offers {header.get('nbytes')} bytes in "
                                              f"{header.get('num_blocks')} blocks, expected "
                                              f"{fetch.nbytes} in {num_blocks}")
        except BaseException:
            sock.close()
            raise
        return sock, fetch

    def _finish_fetch(self, sock: socket.socket) -> None:
        """Step 4: the blocks are ours; the producer may end the lease."""
        with socket_errors("acknowledging KV"):
            request(sock, {"op": "ack"})


def _asdict(fetch: FetchRange) -> dict[str, int]:
    return {"first_block": fetch.first_block, "num_blocks": fetch.num_blocks, "nbytes": fetch.nbytes}


def check_block_ids(layers: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """Destination ids must be in range: a bad one would desynchronise a byte stream."""
    if block_ids.numel() and not 0 <= int(block_ids.min()) <= int(block_ids.max()) < len(layers[0]):
        raise ValueError(f"block ids {block_ids.tolist()} out of range for {len(layers[0])} blocks")
