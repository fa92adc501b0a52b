"""KV transport over a TCP stream: any two hosts, nothing shared but the network.

The producer stages a prompt's blocks in host memory at ``send`` (one gather copy) and
serves them from its control server (see served.py for the fetch/ack conversation). The
fetched range streams layer by layer, each layer's blocks one contiguous run of the
staging buffer, sent in bounded chunks straight from that memory.

The consumer receives straight into its paged KV tensors: every run of consecutive
destination block ids is one ``recv_into`` target, so bytes go from the socket to the
blocks with no intermediate copy. A cache whose block views are not contiguous host memory
(a GPU cache, K and V kept apart, layers interleaved) receives through a host buffer and is
scattered with ``index_copy_``.

The stream is checked by size: both ends agree on the exact byte count up front, the
consumer reads exactly that many, and a peer that closes early raises ``peer``. TCP's own
checksums cover corruption on the wire; a software checksum would cost more than the copy.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer.layout import KVHandle
from kvtransfer.served import FetchRange, ServedTransport, check_block_ids
from kvtransfer.staging import Lease
from kvtransfer.transport import KVTransferError
from kvtransfer.wire import recv_into_exact, socket_errors

CHUNK_BYTES = 4 << 20  # bounds each sendall by the socket timeout, not the whole layer
MAX_IOVECS = 1024  # IOV_MAX on Linux


class TcpTransport(ServedTransport):
    name = "tcp"
    staging_device = torch.device("cpu")

    # ------------------------------ producer ------------------------------

    def _serve(
        self, conn: socket.socket, lease: Lease, fetch: FetchRange, message: dict[str, Any]
    ) -> None:
        last_block = fetch.first_block + fetch.num_blocks
        for layer in lease.blocks:  # (num_blocks, *block_shape), contiguous
            view = _bytes_of(layer[fetch.first_block:last_block])
            for start in range(0, len(view), CHUNK_BYTES):
                conn.sendall(view[start:start + CHUNK_BYTES])

    # ------------------------------ consumer ------------------------------

    def recv(
        self,
        handle: KVHandle,
        layers: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        first_block: int,
    ) -> None:
        check_block_ids(layers, block_ids)
        sock, fetch = self._open_fetch(handle, block_ids, first_block)
        with sock, socket_errors(f"receiving KV from {handle.location}"):
            if all(_receivable_in_place(layer) for layer in layers):
                _recv_in_place(sock, layers, block_ids, self.layout.block_nbytes)
            else:
                _recv_scatter(sock, layers, block_ids, fetch)
            self._finish_fetch(sock)


def _receivable_in_place(layer: torch.Tensor) -> bool:
    return layer.device.type == "cpu" and layer.is_contiguous()


def _recv_in_place(
    sock: socket.socket, layers: Sequence[torch.Tensor], block_ids: torch.Tensor, block_nbytes: int
) -> None:
    runs = contiguous_runs(block_ids.tolist())
    for layer in layers:
        view = _bytes_of(layer)  # the whole (num_blocks, *block_shape) layer
        targets = [view[start * block_nbytes:(start + length) * block_nbytes]
                   for start, length in runs]
        # Scatter-gather receive: one recvmsg fills many blocks, however scattered they are.
        for first in range(0, len(targets), MAX_IOVECS):
            recv_into_all(sock, targets[first:first + MAX_IOVECS])


def recv_into_all(sock: socket.socket, targets: list[memoryview]) -> None:
    """Fills every view in order, as one stream; a peer that closes early is an error."""
    while targets:
        got = sock.recvmsg_into(targets)[0]
        if got == 0:
            owed = sum(len(t) for t in targets)
            raise KVTransferError("peer", f"peer closed the connection with {owed} bytes owed")
        while got and got >= len(targets[0]):
            got -= len(targets.pop(0))
        if got:
            targets[0] = targets[0][got:]


def _recv_scatter(
    sock: socket.socket, layers: Sequence[torch.Tensor], block_ids: torch.Tensor, fetch: FetchRange
) -> None:
    shape = (fetch.num_blocks, *layers[0].shape[1:])
    buffer = torch.empty(shape, dtype=layers[0].dtype)  # (num_blocks, *block_shape), host
    view = _bytes_of(buffer)
    for layer in layers:
        recv_into_exact(sock, view)
        layer.index_copy_(0, block_ids.to(layer.device), buffer.to(layer.device))


def contiguous_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """``[(first_id, length), ...]`` for each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous host tensor's memory (no copy)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())
