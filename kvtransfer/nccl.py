"""KV transport through torch.distributed point-to-point: NCCL between GPUs, gloo on CPU.

One code path for both backends: a dedicated 2-rank process group per producer/consumer
pair (producer rank 0, consumer rank 1), built on a private TCPStore, never the default
group (vLLM may own that one in the engine process, and ``init_process_group`` cannot be
called twice). The producer's control server (served.py) carries everything else:

  1. Pair: a consumer with no group for this producer sends ``{"op": "pair"}``; the producer
     starts a TCPStore on a free port, replies with it and a ``pair_id``, and both sides
     build the group (the constructor is the rendezvous, bounded by ``kv_timeout_s``); the
     producer confirms once the pair is registered on its side.
  2. Fetch: as in served.py, with ``pair_id`` and a fresh ``tag``. Both sides derive every
     message size from the agreed header: gloo aborts the whole process on a size mismatch,
     so nothing reaches the group before both layouts and the range are checked.
  3. Move: the producer posts one send per layer (that layer's range of the staging
     buffer); the consumer receives each straight into its cache when the destination
     blocks are one run, else into two alternating layer buffers it scatters from.
  4. Ack, or teardown: a failed or timed-out wait tears the pair down on that side; the next
     fetch pairs afresh. ``close`` tells producers to drop their side.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroup, TCPStore

from kvtransfer.layout import KVHandle, KVLayout
from kvtransfer.served import FetchRange, ServedTransport, check_block_ids
from kvtransfer.staging import Lease
from kvtransfer.tcp import contiguous_runs
from kvtransfer.transport import KVTransferError
from kvtransfer.wire import (
    Address,
    connect,
    recv_message,
    refusal,
    reply,
    request,
    send_message,
    socket_errors,
)

logger = logging.getLogger(__name__)

PRODUCER_RANK, CONSUMER_RANK = 0, 1


@dataclass(slots=True)
class Pair:
    pair_id: str
    group: ProcessGroup
    store: TCPStore  # the rendezvous store; the producer's copy is its server
    tags: itertools.count


def make_group(store: TCPStore, pair_id: str, rank: int, device: torch.device,
               local_host: str, timeout_s: float) -> ProcessGroup:
    """A 2-rank group over ``store``; NCCL for CUDA tensors, gloo for host tensors."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = PrefixStore(f"pdserve-kv/{pair_id}", store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, 2, options)
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    # Bind gloo where the control connection already reaches the peer: the default device
    # resolves the hostname, which may name an interface the peer cannot route to.
    options._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
    options._timeout = timeout
    return ProcessGroupGloo(prefixed, rank, 2, options)


def teardown(pair: Pair) -> None:
    with contextlib.suppress(RuntimeError):
        pair.group.abort()


class NcclTransport(ServedTransport):
    name = "nccl"

    def __init__(
        self, layout: KVLayout, producer_id: str, extra_config: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(layout, producer_id, extra_config)
        self._lock = threading.Lock()
        self._served_pairs: dict[str, Pair] = {}  # producer side, by pair_id
        self._fetch_pairs: dict[tuple[str, int], Pair] = {}  # consumer side, by producer
        self._recv_buffers: list[torch.Tensor] = []

    # ------------------------------ producer ------------------------------

    def _handle_other(self, conn: socket.socket, message: dict[str, Any]) -> None:
        if message.get("op") == "unpair":
            with self._lock:
                pair = self._served_pairs.pop(str(message.get("pair_id")), None)
            if pair is not None:
                teardown(pair)
            send_message(conn, {"ok": True})
        elif message.get("op") == "pair":
            self._accept_pair(conn, torch.device(str(message.get("device", "cpu"))))
        else:
            super()._handle_other(conn, message)

    def _accept_pair(self, conn: socket.socket, device: torch.device) -> None:
        local_host = conn.getsockname()[0]
        timeout = timedelta(seconds=self.config.timeout_s)
        store = TCPStore(local_host, 0, 2, True, timeout, wait_for_workers=False)
        pair_id = uuid.uuid4().hex
        send_message(conn, {"ok": True, "pair_id": pair_id, "store_port": store.port})
        group = make_group(store, pair_id, PRODUCER_RANK, device, local_host, self.config.timeout_s)
        with self._lock:
            self._served_pairs[pair_id] = Pair(pair_id, group, store, itertools.count())
        # The consumer's half of the rendezvous can return before ours: it fetches only
        # after this, or its first fetch would find no pair here.
        send_message(conn, {"ok": True})

    def _refuse(self, message: dict[str, Any]) -> dict[str, Any] | None:
        with self._lock:
            known = str(message.get("pair_id")) in self._served_pairs
        if known and isinstance(message.get("tag"), int):
            return None
        return refusal("peer", f"no pair {message.get('pair_id')} here (producer restarted?)")

    def _serve(
        self, conn: socket.socket, lease: Lease, fetch: FetchRange, message: dict[str, Any]
    ) -> None:
        with self._lock:
            pair = self._served_pairs[str(message["pair_id"])]
        tag = int(message["tag"])
        last_block = fetch.first_block + fetch.num_blocks
        works = [
            pair.group.send([layer[fetch.first_block:last_block]], CONSUMER_RANK, tag)
            for layer in lease.blocks  # (num_blocks, *block_shape) contiguous ranges
        ]
        try:
            for work in works:
                work.wait(timedelta(seconds=self.config.timeout_s))
            _synchronize(lease.blocks.device)  # NCCL waits are stream-ordered, not host-blocking
        except RuntimeError as e:
            with self._lock:
                self._served_pairs.pop(pair.pair_id, None)
            teardown(pair)
            raise KVTransferError("peer", f"sending KV on pair {pair.pair_id}: {e}") from e

    def close(self) -> None:
        with self._lock:
            pairs = [*self._served_pairs.values(), *self._fetch_pairs.values()]
            producers = list(self._fetch_pairs.items())
            self._served_pairs.clear()
            self._fetch_pairs.clear()
        for (host, port), pair in producers:
            with contextlib.suppress(KVTransferError), connect(
                Address(self.name, host, port, "-"), self.config.timeout_s
            ) as sock, socket_errors("unpairing"):
                request(sock, {"op": "unpair", "pair_id": pair.pair_id})
        for pair in pairs:
            teardown(pair)
        super().close()

    # ------------------------------ consumer ------------------------------

    def recv(
        self,
        handle: KVHandle,
        layers: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        first_block: int,
    ) -> None:
        check_block_ids(layers, block_ids)
        address = Address.parse(handle.location, self.name)
        pair = self._pair_with(address, layers[0].device)
        tag = next(pair.tags)
        try:
            sock, fetch = self._open_fetch(handle, block_ids, first_block, pair_id=pair.pair_id,
                                           tag=tag)
        except KVTransferError as e:
            if e.reason == "peer":  # the producer lost our pair, or itself: pair afresh next time
                self._drop_pair(address, pair)
            raise
        with sock:
            try:
                self._receive(pair, tag, layers, block_ids, fetch)
            except RuntimeError as e:
                self._drop_pair(address, pair)
                reason = "peer" if _closed(sock) else "timeout"
                raise KVTransferError(reason, f"receiving KV from {handle.location}: {e}") from e
            self._finish_fetch(sock)

    def _pair_with(self, address: Address, device: torch.device) -> Pair:
        with self._lock:
            pair = self._fetch_pairs.get((address.host, address.port))
        if pair is not None:
            return pair
        with connect(address, self.config.timeout_s) as sock:
            with socket_errors(f"pairing with {address.host}:{address.port}"):
                answer = request(sock, {"op": "pair", "device": device.type})
            local_host = sock.getsockname()[0]
            timeout = timedelta(seconds=self.config.timeout_s)
            try:
                store = TCPStore(address.host, int(answer["store_port"]), 2, False, timeout)
                group = make_group(store, answer["pair_id"], CONSUMER_RANK, device, local_host,
                                   self.config.timeout_s)
            except RuntimeError as e:  # DistNetworkError and rendezvous timeouts
                raise KVTransferError("peer", f"pairing with {address.host}:{address.port}: {e}") from e
            pair = Pair(answer["pair_id"], group, store, itertools.count())
            try:
                with socket_errors(f"pairing with {address.host}:{address.port}"):
                    reply(recv_message(sock))
            except KVTransferError:
                teardown(pair)
                raise
        with self._lock:
            self._fetch_pairs[(address.host, address.port)] = pair
        return pair

    def _drop_pair(self, address: Address, pair: Pair) -> None:
        with self._lock:
            if self._fetch_pairs.get((address.host, address.port)) is pair:
                del self._fetch_pairs[(address.host, address.port)]
        teardown(pair)

    def _receive(self, pair: Pair, tag: int, layers: Sequence[torch.Tensor],
                 block_ids: torch.Tensor, fetch: FetchRange) -> None:
        timeout = timedelta(seconds=self.config.timeout_s)
        runs = contiguous_runs(block_ids.tolist())
        start = runs[0][0]
        # One run of a block-contiguous cache: every layer's range lands in place (a
        # collective needs dense tensors; strided blocks go through the buffers).
        if len(runs) == 1 and all(layer[start:start + fetch.num_blocks].is_contiguous()
                                  for layer in layers):
            works = [pair.group.recv([layer[start:start + fetch.num_blocks]], PRODUCER_RANK, tag)
                     for layer in layers]
            for work in works:
                work.wait(timeout)
            _synchronize(layers[0].device)
            return
        # Scattered destination: two layer buffers, one receiving while the other scatters.
        buffers = self._buffers(fetch.num_blocks, layers[0])
        ids = block_ids.to(layers[0].device)
        pending = [pair.group.recv([buffers[i]], PRODUCER_RANK, tag) for i in range(min(2, len(layers)))]
        for i, layer in enumerate(layers):
            pending[i].wait(timeout)
            layer.index_copy_(0, ids, buffers[i % 2])
            if i + 2 < len(layers):
                pending.append(pair.group.recv([buffers[i % 2]], PRODUCER_RANK, tag))
        _synchronize(layers[0].device)

    def _buffers(self, num_blocks: int, like: torch.Tensor) -> list[torch.Tensor]:
        shape = (num_blocks, *like.shape[1:])
        if not self._recv_buffers or self._recv_buffers[0].shape[0] < num_blocks \
                or self._recv_buffers[0].device != like.device:
            self._recv_buffers = [torch.empty(shape, dtype=like.dtype, device=like.device)
                                  for _ in range(2)]
        return [b[:num_blocks] for b in self._recv_buffers]


def _closed(sock: socket.socket) -> bool:
    """Whether the producer's end of the control connection is gone (it died or gave up)."""
    try:
        sock.setblocking(False)
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
