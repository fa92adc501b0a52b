"""The interface every KV transport implements, and the registry that picks one.

A transport moves whole paged blocks between two engines. Both sides run inside vLLM's
engine process (the connector's worker half calls them), on block views of the per-layer KV
tensors the engine registered: ``layout.block_view(layer)``, shaped
``(num_blocks, *layout.block_shape)``, whatever axis the engine keeps its blocks on:

- producer: ``send(location, layers, block_ids)`` publishes the blocks of one prompt under
  ``location`` and must not return before the source blocks may be reused by the engine;
- consumer: ``recv(handle, layers, block_ids, first_block)`` copies the handle's blocks
  ``first_block, first_block + 1, ...`` into ``block_ids`` of its own engine;
- ``release(location)`` frees what ``send`` published (the consumer has it, the lease
  expired, or the request was aborted). It is a classmethod: the worker's server process
  calls it too, outside the engine.

A transport is built as ``cls(layout, producer_id, extra_config)`` with the connector's
``kv_connector_extra_config`` dict; ``location_for(key, extra_config)`` reads the same dict
(the network transports take their host and port from it).

Failures raise ``KVTransferError`` with a ``reason`` label (``missing``, ``size``,
``layout``, ``peer``, ``timeout``); the connector turns them into a failed load, never a
crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from kvtransfer.layout import KVHandle, KVLayout


class KVTransferError(RuntimeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVTransport(ABC):
    name: ClassVar[str]
    # KV cache device types this transport moves blocks of.
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def __init__(
        self, layout: KVLayout, producer_id: str, extra_config: Mapping[str, Any] | None = None
    ) -> None:
        self.layout = layout
        self.producer_id = producer_id

    @classmethod
    @abstractmethod
    def location_for(cls, key: str, extra_config: Mapping[str, Any] | None = None) -> str:
        """The address under which a producer publishes the blocks named ``key``."""

    @abstractmethod
    def send(self, location: str, layers: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
        """Publishes ``block_ids`` of every layer's block view under ``location``."""

    @abstractmethod
    def recv(
        self,
        handle: KVHandle,
        layers: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        first_block: int,
    ) -> None:
        """Copies the handle's blocks from ``first_block`` on into ``block_ids``."""

    @classmethod
    @abstractmethod
    def release(cls, location: str) -> None:
        """Frees what ``send`` published under ``location``; a no-op when already gone."""

    def close(self) -> None:
        return None


def transport_class(name: str) -> type[KVTransport]:
    """The transport registered under ``name``; raises ValueError naming the known ones."""
    from kvtransfer.cuda_ipc import CudaIpcTransport
    from kvtransfer.nccl import NcclTransport
    from kvtransfer.shm import ShmTransport
    from kvtransfer.tcp import TcpTransport

    known: dict[str, type[KVTransport]] = {
        cls.name: cls for cls in (ShmTransport, TcpTransport, NcclTransport, CudaIpcTransport)
    }
    try:
        return known[name]
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; choose one of {', '.join(sorted(known))}"
        ) from None


def choose_transport(same_host: bool, device: str) -> str:
    """The transport to use when none is configured, from where the two engines run.

    ``device`` is the KV cache's device type (``cpu``, ``cuda``). Same host: shared memory
    for CPU caches, CUDA IPC for GPU caches (device to device, no host copy). Across hosts:
    NCCL between GPUs, TCP for everything else.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"no KV transport for device {device!r}; expected 'cpu' or 'cuda'")
    if same_host:
        return "shm" if device == "cpu" else "cuda_ipc"
    return "nccl" if device == "cuda" else "tcp"
