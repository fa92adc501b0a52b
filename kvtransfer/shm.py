"""Same-host KV transport through shared memory, with one copy in all.

The producer engine's paged KV cache itself lives in shared memory: its connector places
vLLM's one KV allocation in a file in /dev/shm (``kv_cache_in_shm``). Publishing a prompt
therefore copies nothing: ``send`` writes a small lease file naming the prompt's blocks and
the cache's geometry, and the producer engine keeps those blocks (vLLM's delayed free) for
as long as the lease file exists. The consumer maps the producer's cache once, reads the
lease, and copies the blocks straight out of the producer's cache into its own.

A lease ends in one of three ways, each removing the lease file:
  - the consumer claims it (an atomic rename, so an expiring lease cannot free the blocks
    under a copy in progress), copies, and unlinks the claim;
  - ``release(location)`` from any process (the gateway gave up on the request);
  - the producer's sweeper finds it older than the lease (``sweep_expired``).
The producer engine sees the file gone and frees the blocks (``lease_held``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import mmap
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from kvtransfer.layout import KVHandle, KVLayout
from kvtransfer.transport import KVTransferError, KVTransport

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"  # lease files: pdserve-kv-<producer_id>-<key>
CACHE_PREFIX = "pdserve-kvcache-"  # producer caches: pdserve-kvcache-<producer_id>-<pid>
CLAIMED = ".claimed"
ORPHAN_LEASE_S = 60.0


@dataclass(frozen=True, slots=True)
class SharedCache:
    """A KV cache allocation backed by a file in /dev/shm."""

    path: str
    inode: int
    nbytes: int


# Shared KV caches of this process, by the data pointer of their storage.
_caches: dict[int, SharedCache] = {}


def has_shared_cache(producer_id: str) -> bool:
    """Whether a live process placed this producer's KV cache in /dev/shm."""
    return any(
        _alive(int(path.name.rsplit("-", 1)[-1]))
        for path in SHM_DIR.glob(f"{CACHE_PREFIX}{producer_id}-*")
        if path.name.rsplit("-", 1)[-1].isdigit()
    )


def shared_buffer(producer_id: str, nbytes: int) -> torch.Tensor:
    """A ``(nbytes,)`` uint8 tensor backed by a new file in /dev/shm, its pages allocated.

    The file's pages are allocated up front (``posix_fallocate``) and touched once, so the
    engine's first writes to a block do not fault fresh tmpfs pages in one by one.
    """
    path = SHM_DIR / f"{CACHE_PREFIX}{producer_id}-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        inode = os.fstat(fd).st_ino
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    buffer.zero_()
    _caches[buffer.untyped_storage().data_ptr()] = SharedCache(str(path), inode, nbytes)
    atexit.register(Path(path).unlink, missing_ok=True)
    return buffer


def share(tensor: torch.Tensor, producer_id: str) -> torch.Tensor:
    """A copy of a contiguous CPU tensor in a shared KV cache file (tests, benchmarks)."""
    buffer = shared_buffer(producer_id, tensor.numel() * tensor.element_size())
    shared = buffer.view(tensor.dtype).view(tensor.shape)
    shared.copy_(tensor)
    return shared


def move_to_shared(kv_caches: dict[str, torch.Tensor], producer_id: str) -> None:
    """Re-points vLLM's per-layer KV views at a shared copy of their one backing allocation.

    vLLM allocates the whole cache as one buffer and views every layer into it; each view
    keeps its offset, shape and strides, only the memory under it changes. Called before
    vLLM binds the views to its attention layers.
    """
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in kv_caches.values()}
    assert len(storages) == 1, f"expected one KV allocation, found {len(storages)}"
    (storage,) = storages.values()
    assert storage.device.type == "cpu", "shared-memory KV needs a CPU cache"
    buffer = shared_buffer(producer_id, storage.nbytes())
    target = buffer.untyped_storage()
    for t in kv_caches.values():
        t.set_(target, t.storage_offset(), t.size(), t.stride())


@contextlib.contextmanager
def kv_cache_in_shm(producer_id: str) -> Iterator[None]:
    """Within it, vLLM's KV cache allocation lands in shared memory.

    vLLM enters a connector's allocation context (``get_mem_pool_context``) around its one
    call to ``allocate_kv_cache``; we wrap that call and move its result into a shared file.
    """
    from vllm.v1.worker import gpu_model_runner

    original = gpu_model_runner.allocate_kv_cache

    def allocate(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        kv_caches = original(*args, **kwargs)
        try:
            move_to_shared(kv_caches, producer_id)
        except OSError as e:  # /dev/shm too small (a container's 64 MiB default)
            logger.error(
                "cannot place the KV cache in /dev/shm (%s); the shm transport is off for this "
                "worker (give the container more /dev/shm or ipc: host)", e
            )
        return kv_caches

    gpu_model_runner.allocate_kv_cache = allocate
    try:
        yield
    finally:
        gpu_model_runner.allocate_kv_cache = original


class ShmTransport(KVTransport):
    name = "shm"
    devices = ("cpu",)
    # The producer engine holds the published blocks until the lease ends (no staging copy).
    holds_blocks = True

    def __init__(
        self, layout: KVLayout, producer_id: str, extra_config: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(layout, producer_id, extra_config)
        # Producer caches mapped by this consumer: path -> (inode, their bytes), and views of
        # their layers and of this engine's, built once.
        self._mapped: dict[str, tuple[int, torch.Tensor]] = {}
        self._sources: dict[tuple, tuple[list[torch.Tensor], list[np.ndarray] | None]] = {}
        self._targets: dict[tuple[int, ...], list[np.ndarray]] = {}

    @classmethod
    def location_for(cls, key: str, extra_config: Mapping[str, Any] | None = None) -> str:
        assert "/" not in key, key
        return str(SHM_DIR / f"{PREFIX}{key}")

    # ------------------------------ producer ------------------------------

    def send(self, location: str, layers: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
        cache = _caches.get(layers[0].untyped_storage().data_ptr())
        if cache is None or any(
            layer.untyped_storage().data_ptr() != layers[0].untyped_storage().data_ptr()
            for layer in layers
        ):
            raise KVTransferError(
                "layout", "shm sends need the producer's KV cache in one shared-memory file "
                "(kv_cache_in_shm / shared_buffer)"
            )
        stride = layers[0].stride()
        assert all(layer.stride() == stride for layer in layers)
        lease = {
            "cache": cache.path,
            "inode": cache.inode,
            "nbytes": cache.nbytes,
            "num_blocks": layers[0].shape[0],
            # Block views: (num_blocks, *layout.block_shape), whatever the engine's axes.
            "block_shape": list(layers[0].shape[1:]),
            "stride": list(stride),
            "offsets": [layer.storage_offset() for layer in layers],
            "block_ids": block_ids.tolist(),
        }
        tmp = f"{location}.tmp"
        with open(tmp, "w") as f:
            json.dump(lease, f)
        os.replace(tmp, location)

    @staticmethod
    def lease_held(location: str) -> bool:
        """Whether the producer must still keep the blocks published under ``location``."""
        return os.path.exists(location) or os.path.exists(location + CLAIMED)

    # ------------------------------ consumer ------------------------------

    def recv(
        self,
        handle: KVHandle,
        layers: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        first_block: int,
    ) -> None:
        self.layout.check_compatible(handle.layout)
        claimed = handle.location + CLAIMED
        try:
            os.rename(handle.location, claimed)
        except FileNotFoundError:
            raise KVTransferError(
                "missing", f"KV lease {handle.location} is gone (expired or released)"
            ) from None
        try:
            with open(claimed) as f:
                lease = json.load(f)
            src_ids = lease["block_ids"]
            last_block = first_block + block_ids.numel()
            if last_block > len(src_ids) or self.layout.num_blocks(handle.num_tokens) > len(src_ids):
                raise KVTransferError(
                    "size",
                    f"asked for blocks {first_block}..{last_block} of a lease holding "
                    f"{len(src_ids)}",
                )
            if tuple(lease["block_shape"]) != self.layout.block_shape:
                raise KVTransferError(
                    "layout", f"producer blocks are {tuple(lease['block_shape'])}, this "
                    f"engine's {self.layout.block_shape} ({self.layout.memory_order})"
                )
            sources, source_blocks = self._producer_layers(lease)
            if len(sources) != len(layers):
                raise KVTransferError(
                    "layout", f"producer has {len(sources)} layers, this engine {len(layers)}"
                )
            src, dst = src_ids[first_block:last_block], block_ids.tolist()
            if source_blocks is not None and _host_contiguous(layers):
                key = tuple(layer.data_ptr() for layer in layers)
                targets = self._targets.get(key)
                if targets is None:
                    targets = self._targets[key] = [_blocks(layer) for layer in layers]
                src_idx, dst_idx = np.asarray(src), np.asarray(dst)
                for target, source in zip(targets, source_blocks, strict=True):
                    target[dst_idx] = source[src_idx]  # one memcpy per block
            else:
                copy_blocks(sources, layers, src, dst)
        finally:
            Path(claimed).unlink(missing_ok=True)

    def _producer_layers(
        self, lease: dict[str, Any]
    ) -> tuple[list[torch.Tensor], list[np.ndarray] | None]:
        """The producer's per-layer paged tensors in this process's mapping of its cache,
        and the same as arrays of block-sized items when contiguous (built once)."""
        path, inode, nbytes = lease["cache"], lease["inode"], lease["nbytes"]
        for gone in [p for p in self._mapped if p != path and not os.path.exists(p)]:
            del self._mapped[gone]  # a producer that left: give its memory back
            self._sources = {k: v for k, v in self._sources.items() if k[0] != gone}
        mapped = self._mapped.get(path)
        if mapped is None or mapped[0] != inode:
            mapped = self._mapped[path] = (inode, _map_cache(path, inode, nbytes))
        key = (path, inode, lease["num_blocks"], tuple(lease["stride"]), tuple(lease["offsets"]))
        cached = self._sources.get(key)
        if cached is None:
            flat = mapped[1].view(self.layout.torch_dtype)
            shape = (lease["num_blocks"], *self.layout.block_shape)
            layers = [flat.as_strided(shape, key[3], offset) for offset in key[4]]
            blocks = [_blocks(layer) for layer in layers] if _host_contiguous(layers) else None
            cached = self._sources[key] = (layers, blocks)
        return cached

    @classmethod
    def release(cls, location: str) -> None:
        # A claimed lease belongs to the consumer copying it; only an unclaimed one is freed.
        Path(location).unlink(missing_ok=True)

    def close(self) -> None:
        self._sources.clear()
        self._targets.clear()
        self._mapped.clear()


def _map_cache(path: str, inode: int, nbytes: int) -> torch.Tensor:
    """Maps a producer's shared KV cache, its page tables filled up front (MAP_POPULATE):
    a fault per 4 KiB page on first touch would cost as much as the copy itself."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise KVTransferError("peer", f"producer KV cache {path} is gone") from None
    try:
        stat = os.fstat(fd)
        if stat.st_ino != inode or stat.st_size != nbytes:
            raise KVTransferError("peer", f"producer KV cache {path} was replaced")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about buffers it cannot resize
        return torch.frombuffer(mapping, dtype=torch.uint8)


def copy_blocks(
    sources: Sequence[torch.Tensor],
    layers: Sequence[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    """``layers[l][dst_ids[i]] = sources[l][src_ids[i]]`` for every layer's block view
    (``KVLayout.block_view``), whatever axis the engine keeps its blocks on.

    When every view is contiguous host memory (a layer-major, block-contiguous cache), each
    block is one run of bytes and the copy is a run of block-sized memcpys: numpy moves whole
    blocks as opaque items, where torch's index_copy_ goes element by element at a fraction
    of memcpy's speed. (ShmTransport.recv does the same with views it keeps.) Strided blocks
    (K and V apart, layers interleaved) and device caches take torch's strided copy.
    """
    if not _host_contiguous([*sources, *layers]):
        for layer, source in zip(layers, sources, strict=True):
            src = torch.tensor(src_ids, device=source.device)
            dst = torch.tensor(dst_ids, device=layer.device)
            layer.index_copy_(0, dst, source.index_select(0, src).to(layer.device))
        return
    src, dst = np.asarray(src_ids), np.asarray(dst_ids)
    for layer, source in zip(layers, sources, strict=True):
        _blocks(layer)[dst] = _blocks(source)[src]


def _host_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)


def _blocks(layer: torch.Tensor) -> np.ndarray:
    """A contiguous ``(num_blocks, ...)`` tensor as a 1-d array of opaque block-sized items."""
    num_blocks = layer.shape[0]
    flat = layer.view(-1).view(torch.uint8).numpy()
    return flat.view(f"V{flat.size // num_blocks}")


def sweep_expired(producer_id: str, lease_s: float, now: float | None = None) -> list[str]:
    """Ends this producer's leases older than ``lease_s``; returns their paths.

    A claim (a consumer mid-copy) gets twice as long: only a consumer that died holding it
    leaves one that old.
    """
    now = time.time() if now is None else now
    swept = []
    for path in SHM_DIR.glob(f"{PREFIX}{producer_id}-*"):
        limit = 2 * lease_s if path.name.endswith(CLAIMED) else lease_s
        try:
            if now - path.stat().st_mtime > limit:
                path.unlink(missing_ok=True)
                swept.append(str(path))
        except FileNotFoundError:
            continue
    return swept


def sweep_orphan_caches() -> list[str]:
    """Unlinks shared KV caches whose owning process is gone (a producer that was killed),
    and every lease naming blocks of a cache that no longer exists; returns what it unlinked."""
    swept = []
    live = set()
    for path in SHM_DIR.glob(f"{CACHE_PREFIX}*"):
        producer_id, _, pid = path.name.removeprefix(CACHE_PREFIX).rpartition("-")
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            swept.append(str(path))
            for lease in SHM_DIR.glob(f"{PREFIX}{producer_id}-*"):
                lease.unlink(missing_ok=True)
        else:
            live.add(producer_id)
    # A lease is written only while its producer's cache exists, so one that outlived it by
    # a minute is orphaned (the minute spares a lease being written as its cache appears).
    now = time.time()
    for lease in SHM_DIR.glob(f"{PREFIX}*"):
        if lease.name.removeprefix(PREFIX).split("-", 1)[0] in live:
            continue
        try:
            if now - lease.stat().st_mtime > ORPHAN_LEASE_S:
                lease.unlink(missing_ok=True)
                swept.append(str(lease))
        except FileNotFoundError:
            continue
    return swept


def drop_leases(producer_id: str) -> None:
    """Unlinks every lease of a producer that is shutting down (its cache goes with it)."""
    for lease in SHM_DIR.glob(f"{PREFIX}{producer_id}-*"):
        lease.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
