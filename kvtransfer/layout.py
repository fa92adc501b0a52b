"""The shape of a paged KV block, and the handle that names one prompt's blocks.

vLLM's CPU attention keeps one tensor per layer, shaped
``(num_blocks, num_kv_heads, block_size, entry_size)`` (the "LBHNC" layout, K and V side by
side in ``entry_size``); blocks are indexed on dim 0. Two engines can exchange blocks only
when every one of those dimensions and the dtype agree: a mismatch caught here is a clear
error, a mismatch missed here is garbage attention.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


class LayoutMismatchError(ValueError):
    """The producer's and the consumer's KV layouts differ; blocks cannot be exchanged."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    entry_size: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "entry_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not a torch dtype name")

    @classmethod
    def from_kv_caches(cls, layers: list[torch.Tensor]) -> KVLayout:
        """Reads the layout off the engine's per-layer paged KV tensors."""
        assert layers, "no KV cache layers registered"
        first = layers[0]
        assert first.dim() == 4, f"expected (blocks, heads, block_size, entry) got {first.shape}"
        for layer in layers:
            assert layer.shape == first.shape and layer.dtype == first.dtype
        _, num_kv_heads, block_size, entry_size = first.shape
        return cls(
            num_layers=len(layers),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            entry_size=entry_size,
            dtype=str(first.dtype).removeprefix("torch."),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.num_kv_heads, self.block_size, self.entry_size)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in one layer."""
        heads, tokens, entry = self.block_shape
        return heads * tokens * entry * self.torch_dtype.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes of KV one token occupies across all layers."""
        return self.num_layers * self.block_nbytes // self.block_size

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of the whole blocks that hold num_tokens tokens, all layers."""
        return self.num_layers * self.num_blocks(num_tokens) * self.block_nbytes

    def check_compatible(self, other: KVLayout) -> None:
        if self != other:
            diffs = [
                f"{name}: {getattr(self, name)} here vs {getattr(other, name)} there"
                for name in ("num_layers", "block_size", "num_kv_heads", "entry_size", "dtype")
                if getattr(self, name) != getattr(other, name)
            ]
            raise LayoutMismatchError(
                "KV layouts differ (" + "; ".join(diffs) + "); run both tiers with the same "
                "model, dtype and --block-size"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**d)


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

    The CPU attention backend stores K and V side by side per token (entry = 2 x head size).
    The connector's worker half checks this against the tensors it is handed.
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
    )
