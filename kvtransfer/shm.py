"""Same-host KV transport through files in /dev/shm (tmpfs: RAM, no disk).

The producer gathers the prompt's blocks straight from its paged KV tensors into a
memory-mapped file (one copy), laid out ``(num_layers, num_blocks, heads, block_size,
entry)``, and renames it into place so a reader never sees half a file. The consumer maps
the file and scatters the blocks straight into its own paged tensors (one copy), then
unlinks it. A file nobody collects is swept by its producer when its lease ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtransfer.layout import KVHandle
from kvtransfer.transport import KVTransferError, KVTransport

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"


class ShmTransport(KVTransport):
    name = "shm"

    @classmethod
    def location_for(cls, key: str, extra_config: Mapping[str, Any] | None = None) -> str:
        assert "/" not in key, key
        return str(SHM_DIR / f"{PREFIX}{key}")

    def send(self, location: str, layers: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
        num_blocks = block_ids.numel()
        shape = (len(layers), num_blocks, *self.layout.block_shape)
        tmp = f"{location}.tmp"
        dst = _map(tmp, shape, self.layout.torch_dtype, create=True)
        for layer, out in zip(layers, dst, strict=True):
            torch.index_select(layer, 0, block_ids, out=out)  # (num_blocks, H, N, C)
        del dst
        os.replace(tmp, location)

    def recv(
        self,
        handle: KVHandle,
        layers: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        first_block: int,
    ) -> None:
        self.layout.check_compatible(handle.layout)
        num_src_blocks = self.layout.num_blocks(handle.num_tokens)
        if first_block + block_ids.numel() > num_src_blocks:
            raise KVTransferError(
                "size",
                f"asked for blocks {first_block}..{first_block + block_ids.numel()} of a handle "
                f"holding {num_src_blocks}",
            )
        shape = (len(layers), num_src_blocks, *self.layout.block_shape)
        src = _map(handle.location, shape, self.layout.torch_dtype, create=False)
        last_block = first_block + block_ids.numel()
        for layer, blocks in zip(layers, src, strict=True):
            layer.index_copy_(0, block_ids, blocks[first_block:last_block])

    @classmethod
    def release(cls, location: str) -> None:
        Path(location).unlink(missing_ok=True)


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * dtype.itemsize
    if create:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    else:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise KVTransferError("missing", f"KV file {path} is gone (lease expired?)") from None
        if size != nbytes:
            raise KVTransferError("size", f"KV file {path} holds {size} bytes, expected {nbytes}")
    flat = torch.from_file(path, shared=create, size=nbytes, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def sweep_expired(producer_id: str, lease_s: float, now: float | None = None) -> list[str]:
    """Unlinks this producer's files older than the lease; returns their paths."""
    now = time.time() if now is None else now
    swept = []
    for path in SHM_DIR.glob(f"{PREFIX}{producer_id}-*"):
        try:
            if now - path.stat().st_mtime > lease_s:
                path.unlink(missing_ok=True)
                swept.append(str(path))
        except FileNotFoundError:
            continue
    return swept
