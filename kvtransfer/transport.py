"""The interface every KV transport implements, and the registry that picks one.

A transport moves whole paged blocks between two engines. Both sides run inside vLLM's
engine process (the connector's worker half calls them), on the per-layer KV tensors the
engine registered:

- producer: ``send(location, layers, block_ids)`` publishes the blocks of one prompt under
  ``location`` and must not return before the source blocks may be reused by the engine;
- consumer: ``recv(handle, layers, block_ids, first_block)`` copies the handle's blocks
  ``first_block, first_block + 1, ...`` into ``block_ids`` of its own engine;
- ``release(location)`` frees what ``send`` published (the consumer has it, the lease
  expired, or the request was aborted). It is a classmethod: the worker's server process
  calls it too, outside the engine.

Failures raise ``KVTransferError`` with a ``reason`` label (``missing``, ``size``,
``layout``, ``peer``, ``timeout``); the connector turns them into a failed load, never a
crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from kvtransfer.layout import KVHandle, KVLayout


class KVTransferError(RuntimeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVTransport(ABC):
    name: ClassVar[str]

    def __init__(self, layout: KVLayout, producer_id: str) -> None:
        self.layout = layout
        self.producer_id = producer_id

    @classmethod
    @abstractmethod
    def location_for(cls, key: str) -> str:
        """The address under which a producer publishes the blocks named ``key``."""

    @abstractmethod
    def send(self, location: str, layers: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
        """Publishes ``block_ids`` of every layer under ``location``."""

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
    from kvtransfer.shm import ShmTransport

    known: dict[str, type[KVTransport]] = {cls.name: cls for cls in (ShmTransport,)}
    try:
        return known[name]
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; choose one of {', '.join(sorted(known))}"
        ) from None
