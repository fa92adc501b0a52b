"""Same-host GPU KV transport through CUDA IPC: device to device, no host copy, no socket data.

The producer stages a prompt's blocks in device memory at ``send`` (one gather on the GPU,
synchronised before returning so the engine may reuse the source blocks). A consumer fetches
as in served.py; instead of bytes the producer answers with a CUDA IPC handle of the staging
buffer, the consumer maps it (torch caches mapped handles, so a pooled buffer is mapped once),
copies its range device to device into its own blocks, synchronises, and acknowledges; only
then does the producer end the lease and reuse the buffer.

Limits: both processes must see the same GPUs under the same ordinals (the handle names the
producer's device index), and CUDA IPC does not cross hosts or containers without a shared
IPC namespace. Imports cleanly without CUDA; using it without CUDA raises at construction.
"""

from __future__ import annotations

import base64
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from kvtransfer.layout import KVHandle, KVLayout
from kvtransfer.served import FetchRange, ServedTransport, check_block_ids
from kvtransfer.staging import Lease
from kvtransfer.transport import KVTransferError
from kvtransfer.wire import recv_message, send_message, socket_errors


class CudaIpcTransport(ServedTransport):
    name = "cuda_ipc"
    devices = ("cuda",)

    def __init__(
        self, layout: KVLayout, producer_id: str, extra_config: Mapping[str, Any] | None = None
    ) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the cuda_ipc KV transport needs CUDA; use shm or tcp on CPU")
        super().__init__(layout, producer_id, extra_config)

    # ------------------------------ producer ------------------------------

    def _serve(
        self, conn: socket.socket, lease: Lease, fetch: FetchRange, message: dict[str, Any]
    ) -> None:
        if lease.blocks.device.type != "cuda":
            raise KVTransferError("peer", "cuda_ipc producer staged host memory (CPU KV cache?)")
        send_message(conn, share(lease.blocks))

    # ------------------------------ consumer ------------------------------

    def recv(
        self,
        handle: KVHandle,
        layers: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        first_block: int,
    ) -> None:
        check_block_ids(layers, block_ids)
        device = layers[0].device
        sock, fetch = self._open_fetch(handle, block_ids, first_block)
        with sock:
            with socket_errors(f"receiving a CUDA IPC handle from {handle.location}"):
                shared = recv_message(sock)
            staged = open_shared(shared)  # (num_layers, num_staged_blocks, *block_shape)
            expected = (len(layers), *self.layout.block_shape)
            if (staged.shape[0], *staged.shape[2:]) != expected or staged.dtype != layers[0].dtype:
                raise KVTransferError("size", f"shared KV is {tuple(staged.shape)} "
                                              f"{staged.dtype}, expected {expected}")
            ids = block_ids.to(device)
            last_block = first_block + fetch.num_blocks
            for layer, source in zip(layers, staged, strict=True):
                layer.index_copy_(0, ids, source[first_block:last_block].to(device))
            # The producer reuses its buffer after our ack: the copies must have finished.
            torch.cuda.current_stream(device).synchronize()
            del staged
            self._finish_fetch(sock)


def share(tensor: torch.Tensor) -> dict[str, Any]:
    """A JSON message that lets another process on this host map ``tensor``'s memory."""
    _, args = torch.multiprocessing.reductions.reduce_tensor(tensor)
    (_, size, stride, offset, _, dtype, device, storage_handle, storage_size_bytes,
     storage_offset_bytes, _, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return {
        "ok": True,
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "storage_handle": _b64(storage_handle),
        "storage_size_bytes": storage_size_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": _b64(event_handle),
        "event_sync_required": event_sync_required,
    }


def open_shared(message: dict[str, Any]) -> torch.Tensor:
    """Maps the tensor ``share`` described; torch reuses a mapping it already holds."""
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(message["size"]),
        tuple(message["stride"]),
        message["offset"],
        torch.storage.TypedStorage,
        getattr(torch, message["dtype"]),
        message["device"],
        _unb64(message["storage_handle"]),
        message["storage_size_bytes"],
        message["storage_offset_bytes"],
        False,
        _unb64(message["ref_counter_handle"]),
        message["ref_counter_offset"],
        _unb64(message["event_handle"]),
        message["event_sync_required"],
    )


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
