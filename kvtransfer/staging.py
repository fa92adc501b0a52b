"""Staged prompt KV on the producer side: the copy a network transport serves, under a lease.

``send`` must return before the engine may reuse the source blocks, so a producer that
serves blocks later (tcp, nccl, cuda_ipc) gathers them once into a staging buffer laid out
``(num_layers, num_blocks, *layout.block_shape)`` (the block views' order, see layout.py):
for each layer the blocks of any range are contiguous, which is what lets the transports
stream a range without another copy.

A lease ends when the consumer acknowledges the fetch, when ``release`` is called, or when
it expires. Freed buffers go back to a small pool: a fresh allocation is first-touched page
by page, which on this kind of machine costs several times the copy itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtransfer import metrics
from kvtransfer.layout import KVLayout


@dataclass(slots=True)
class Lease:
    key: str
    blocks: torch.Tensor  # (num_layers, num_blocks, *block_shape), a view into a pooled buffer
    buffer: torch.Tensor  # (capacity_bytes,) uint8, returned to the pool when the lease ends
    expires_s: float  # time.monotonic() deadline
    # Server threads streaming from ``blocks``; the buffer is reused only once they finish.
    readers: int = 0
    dropped: bool = False

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[1]


class BufferPool:
    """Reuses staging buffers; keeps at most ``max_bytes`` of idle ones."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._idle if b.numel() >= nbytes and b.device == device]
            if fits:
                best = min(fits, key=torch.Tensor.numel)
                self._idle.remove(best)
                return best
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buffer)
            # Keep the largest buffers: a small one never serves a long prompt.
            self._idle.sort(key=torch.Tensor.numel, reverse=True)
            kept, total = [], 0
            for b in self._idle:
                if total + b.numel() <= self._max_bytes:
                    kept.append(b)
                    total += b.numel()
            self._idle = kept

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


class LeaseTable:
    """The prompts a producer is serving, by key; thread-safe (server threads read it)."""

    def __init__(self, transport: str, layout: KVLayout, lease_s: float, pool_bytes: int) -> None:
        self._transport = transport
        self._layout = layout
        self._lease_s = lease_s
        self._pool = BufferPool(pool_bytes)
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def stage(
        self,
        key: str,
        layers: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        device: torch.device | None = None,
    ) -> Lease:
        """Gathers ``block_ids`` of every layer's block view into a staging buffer leased
        under ``key``.

        ``device`` is where the staged copy lives (the cache's own device when None): a
        socket streams from host memory, CUDA IPC shares device memory.
        """
        self.sweep()
        num_blocks = block_ids.numel()
        shape = (len(layers), num_blocks, *self._layout.block_shape)
        nbytes = len(layers) * num_blocks * self._layout.block_nbytes
        source = layers[0].device
        device = source if device is None else device
        buffer = self._pool.acquire(nbytes, device)
        blocks = buffer[:nbytes].view(self._layout.torch_dtype).view(shape)
        ids = block_ids.to(source)
        for layer, out in zip(layers, blocks, strict=True):
            if device == source:
                torch.index_select(layer, 0, ids, out=out)  # (num_blocks, *block_shape)
            else:
                out.copy_(layer.index_select(0, ids))
        if source.type == "cuda":
            torch.cuda.current_stream(source).synchronize()  # the engine may reuse the source
        lease = Lease(key, blocks, buffer, time.monotonic() + self._lease_s)
        with self._lock:
            previous = self._leases.pop(key, None)
            self._leases[key] = lease
        if previous is None:
            metrics.LEASES_OUTSTANDING.labels(self._transport).inc()
        else:
            self._retire(previous)
        return lease

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[Lease | None]:
        """The lease on ``key`` (None when there is none), kept intact while the block runs."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is not None:
                lease.readers += 1
        try:
            yield lease
        finally:
            if lease is not None:
                with self._lock:
                    lease.readers -= 1
                    idle = lease.dropped and lease.readers == 0
                if idle:
                    self._pool.give_back(lease.buffer)

    def drop(self, key: str) -> bool:
        """Ends the lease on ``key``; False when there was none (already fetched or released)."""
        with self._lock:
            lease = self._leases.pop(key, None)
        if lease is None:
            return False
        metrics.LEASES_OUTSTANDING.labels(self._transport).dec()
        self._retire(lease)
        return True

    def _retire(self, lease: Lease) -> None:
        with self._lock:
            lease.dropped = True
            idle = lease.readers == 0
        if idle:
            self._pool.give_back(lease.buffer)

    def sweep(self, now_s: float | None = None) -> list[str]:
        """Ends the leases past their deadline; returns their keys."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            expired = [key for key, lease in self._leases.items() if lease.expires_s < now_s]
        return [key for key in expired if self.drop(key)]

    def clear(self) -> None:
        for key in self.keys():
            self.drop(key)
        self._pool.clear()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
