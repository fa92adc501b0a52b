"""The layout of a paged KV cache, read off the tensors an engine registers, and the handle
that names one prompt's blocks.

An engine hands the connector one tensor per layer. Which axis holds the blocks, where K and
V sit and in what order the axes lie in memory depends on the vLLM version, the attention
backend and the cache layout it resolved. A ``KVLayout`` names all of it, one letter per axis:
B blocks, N tokens in a block, H KV heads, C K and V side by side (2 x head size), K the K/V
pair (size 2), D head size. ``axes`` is the tensor's logical order, ``memory_order`` the same
letters outermost first (read from the strides). The known layouts:

  axes   memory_order  who allocates it
  BHNC   BHNC          vLLM 0.32 per-layer views, HND (LBHNC, BLHNC, BHLNC): CPU_ATTN, and
                       FLASH_ATTN / FLASHINFER / TRITON_ATTN under this connector (it asks
                       vLLM for LBHNC, see REQUIRED_KV_CACHE_LAYOUT)
  BHNC   BNHC          vLLM 0.32, NHD (LBNHC, BLNHC): FLASH_ATTN's default without a connector
  BHNC   HBNC          vLLM 0.32, LHBNC
  KBNHD  KBNHD         FlashAttention's [2, num_blocks, block_size, kv_heads, head_size]
  KBNHD  KBHND         the same with the HND stride order
  BKNHD  BKNHD         FlashInfer's [num_blocks, 2, block_size, kv_heads, head_size]
  BKNHD  BKHND         the same with the HND stride order

Copies depend on the layout through ``block_view`` only: every transport moves whole blocks
of the ``(num_blocks, *block_shape)`` view, whose block axis comes first and whose other
axes are in memory order, so a block's bytes leave and land in the order they lie in. Two
engines exchange blocks only when every field agrees (``check_compatible``): a mismatch
caught here is a clear error, a mismatch missed here is garbage attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

# Logical axes -> the memory orders known for them, the canonical one first.
MEMORY_ORDERS: dict[str, tuple[str, ...]] = {
    "BHNC": ("BHNC", "BNHC", "HBNC"),
    "KBNHD": ("KBNHD", "KBHND"),
    "BKNHD": ("BKNHD", "BKHND"),
}
# vLLM's KVCacheLayout this connector asks for: layer-major and block-contiguous, so each
# block of a layer is one run of bytes (NIXL asks for the same, for the same reason).
REQUIRED_KV_CACHE_LAYOUT = "LBHNC"
_VLLM_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


class LayoutMismatchError(ValueError):
    """The producer's and the consumer's KV layouts differ; blocks cannot be exchanged."""


class UnknownLayoutError(ValueError):
    """The engine's KV cache tensors match no layout this connector can copy."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_size: int  # tokens per block (N)
    num_kv_heads: int  # H
    entry_size: int  # K and V elements per token and head: 2 x head size
    dtype: str  # torch dtype name
    axes: str = "BHNC"
    memory_order: str = "BHNC"
    device: str = "cpu"  # device type of the cache: cpu, cuda

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "entry_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.entry_size % 2:
            raise ValueError(f"KVLayout.entry_size {self.entry_size} must be even (K and V)")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not a torch dtype name")
        if self.axes not in MEMORY_ORDERS:
            raise UnknownLayoutError(
                f"KVLayout.axes {self.axes!r} is not a known KV layout; known: "
                f"{', '.join(MEMORY_ORDERS)}"
            )
        if not self.device:
            raise ValueError("KVLayout.device must name a device type (cpu, cuda)")
        # A size-1 axis may sit anywhere without moving a byte: name such layouts one way.
        object.__setattr__(self, "memory_order", self._canonical_order(self.memory_order))

    def _canonical_order(self, order: str) -> str:
        if sorted(order) != sorted(self.axes):
            raise UnknownLayoutError(
                f"memory order {order!r} is not an order of axes {self.axes!r}"
            )
        singleton = {a for a, n in self.axis_sizes(num_blocks=2).items() if n == 1}

        def significant(o: str) -> str:
            return "".join(a for a in o if a not in singleton)

        for known in MEMORY_ORDERS[self.axes]:
            if significant(known) == significant(order):
                return known
        raise UnknownLayoutError(
            f"memory order {order!r} of axes {self.axes!r} is not one this connector copies; "
            f"known: {', '.join(MEMORY_ORDERS[self.axes])}"
        )

    @property
    def head_size(self) -> int:
        return self.entry_size // 2

    def axis_sizes(self, num_blocks: int) -> dict[str, int]:
        return {"B": num_blocks, "N": self.block_size, "H": self.num_kv_heads,
                "C": self.entry_size, "K": 2, "D": self.head_size}

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The logical shape of one registered per-layer tensor."""
        sizes = self.axis_sizes(num_blocks)
        return tuple(sizes[a] for a in self.axes)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer, its axes in memory order."""
        sizes = self.axis_sizes(num_blocks=1)
        return tuple(sizes[a] for a in self.memory_order if a != "B")

    def block_view(self, layer: torch.Tensor) -> torch.Tensor:
        """``(num_blocks, *block_shape)``: the layer's blocks on dim 0, a view, no copy."""
        perm = [self.axes.index("B")] + [self.axes.index(a) for a in self.memory_order if a != "B"]
        return layer.permute(perm)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in one layer."""
        return math.prod(self.block_shape) * self.torch_dtype.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes of KV one token occupies across all layers."""
        return self.num_layers * self.block_nbytes // self.block_size

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of the whole blocks that hold num_tokens tokens, all layers."""
        return self.num_layers * self.num_blocks(num_tokens) * self.block_nbytes

    def differences(self, other: KVLayout, here: str = "here", there: str = "there") -> list[str]:
        """``"field: mine here vs theirs there"`` for every field that differs."""
        return [
            f"{f.name}: {getattr(self, f.name)} {here} vs {getattr(other, f.name)} {there}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def check_compatible(self, other: KVLayout) -> None:
        diffs = self.differences(other)
        if diffs:
            raise LayoutMismatchError(
                "KV layouts differ (" + "; ".join(diffs) + "); run both tiers with the same "
                "model, dtype, --block-size, device and attention backend"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**d)

    @classmethod
    def from_kv_caches(cls, layers: Sequence[torch.Tensor], axes: str | None = None) -> KVLayout:
        """Reads the layout off the engine's per-layer paged KV tensors.

        ``axes`` names the logical axes when the caller knows them (the backend's shape);
        otherwise they are told apart by rank and by where the size-2 K/V axis sits. Raises
        UnknownLayoutError for anything it cannot name exactly.
        """
        if not layers:
            raise UnknownLayoutError("no KV cache layers registered")
        first = layers[0]
        for layer in layers:
            if (layer.shape, layer.stride(), layer.dtype, layer.device) != (
                first.shape, first.stride(), first.dtype, first.device
            ):
                raise UnknownLayoutError(
                    f"KV cache layers differ: {tuple(first.shape)} {first.stride()} "
                    f"{first.dtype} vs {tuple(layer.shape)} {layer.stride()} {layer.dtype} "
                    "(a hybrid or multi-group cache, which this connector does not copy)"
                )
        axes = axes or _guess_axes(first)
        sizes = dict(zip(axes, first.shape, strict=True))
        if "K" in axes and sizes["K"] != 2:
            raise UnknownLayoutError(f"axis K of {tuple(first.shape)} ({axes}) is not the K/V pair")
        entry_size = sizes["C"] if "C" in sizes else 2 * sizes["D"]
        return cls(
            num_layers=len(layers),
            block_size=sizes["N"],
            num_kv_heads=sizes["H"],
            entry_size=entry_size,
            dtype=str(first.dtype).removeprefix("torch."),
            axes=axes,
            memory_order=_memory_order(first, axes),
            device=first.device.type,
        )


def _guess_axes(tensor: torch.Tensor) -> str:
    shape = tuple(tensor.shape)
    if tensor.dim() == 4:
        return "BHNC"
    if tensor.dim() == 5:
        kv_first, kv_second = shape[0] == 2, shape[1] == 2
        if kv_first != kv_second:
            return "KBNHD" if kv_first else "BKNHD"
        why = "both" if kv_first else "neither"
        raise UnknownLayoutError(
            f"KV cache tensor {shape}: {why} of its first two axes has size 2, so which one "
            "holds K/V (FlashAttention's [2, blocks, ...] or FlashInfer's [blocks, 2, ...]) is "
            "unknown; pass the backend's axes"
        )
    raise UnknownLayoutError(
        f"KV cache tensor {shape} matches no known layout ({', '.join(MEMORY_ORDERS)}); "
        "this connector copies vLLM's per-layer paged attention caches only"
    )


def _memory_order(tensor: torch.Tensor, axes: str) -> str:
    """The axes outermost first, from the strides; size-1 axes other than the blocks go last
    (they move no byte).
    Refuses overlapping or broadcast strides: blocks there are not whole runs of memory."""
    dims = [i for i in range(tensor.dim()) if tensor.shape[i] > 1 or axes[i] == "B"]
    dims.sort(key=lambda i: -tensor.stride(i))
    for outer, inner in zip(dims, [*dims[1:], None]):
        inner_extent = 1 if inner is None else tensor.stride(inner) * tensor.shape[inner]
        if tensor.shape[outer] > 1 and tensor.stride(outer) < inner_extent:
            raise UnknownLayoutError(
                f"KV cache tensor {tuple(tensor.shape)} with strides {tensor.stride()} overlaps "
                "itself; it is no paged cache this connector can copy"
            )
    singles = [i for i in range(tensor.dim()) if i not in dims]
    return "".join(axes[i] for i in dims + singles)


def new_kv_caches(
    layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Zeroed per-layer tensors laid out as ``layout``'s engine allocates them (tests,
    benchmarks)."""
    sizes = layout.axis_sizes(num_blocks)
    physical = (layout.num_layers, *(sizes[a] for a in layout.memory_order))
    return layer_views(layout, torch.zeros(physical, dtype=layout.torch_dtype, device=device))


def layer_views(layout: KVLayout, physical: torch.Tensor) -> list[torch.Tensor]:
    """The per-layer tensors, in logical axis order, of one layer-major allocation shaped
    ``(num_layers, *axis sizes in memory order)``."""
    to_logical = [layout.memory_order.index(a) for a in layout.axes]
    return [layer.permute(to_logical) for layer in physical.unbind(0)]


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Names the KV of a prompt's first ``num_tokens`` tokens, held by a producer.

    ``location`` is the transport's own address of the blocks; the handle is what a
    prefill worker returns and a decode worker passes back to its engine's connector.
    """

    transport: str
    location: str
    num_tokens: int
    layout: KVLayout
    producer_id: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVHandle:
        return cls(**{**d, "layout": KVLayout.from_dict(d["layout"])})


def expected_layout(vllm_config: Any) -> KVLayout:
    """The layout an engine with this config allocates, known before it allocates it.

    vLLM 0.32 hands every attention backend per-layer ``[blocks, heads, block_size, K|V]``
    views; their memory order is the KVCacheLayout vLLM resolves: VLLM_KV_CACHE_LAYOUT when
    set, else the one this connector asks for. The connector's worker half checks this
    against the tensors it is handed, and refuses to start when they differ.
    """
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = model_config.dtype if cache_dtype in (None, "auto") else cache_dtype
    return KVLayout(
        num_layers=model_config.get_num_layers(parallel_config),
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        entry_size=2 * model_config.get_head_size(),
        dtype=str(dtype).removeprefix("torch."),
        axes="BHNC",
        memory_order=vllm_cache_layout().replace("L", ""),
        device=vllm_config.device_config.device_type,
    )


def vllm_cache_layout() -> str:
    """The KVCacheLayout name vLLM resolves for an engine running this connector."""
    from vllm import envs

    # vLLM lets the environment override a connector's preference.
    name = envs.VLLM_KV_CACHE_LAYOUT or REQUIRED_KV_CACHE_LAYOUT
    return _VLLM_LAYOUT_ALIASES.get(name, name)
