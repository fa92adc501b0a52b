"""pdserve's vLLM KV connector: prompt KV moves from a prefill engine to a decode engine.

Registered out of tree: ``KVTransferConfig(kv_connector="PdConnector",
kv_connector_module_path="kvtransfer.connector", kv_role=..., kv_connector_extra_config=
{"transport": "shm", "producer_id": ...})``. A request opts in through
``SamplingParams.extra_args["kv_transfer_params"]``:

- ``{"pdserve_save": location}`` on a producer: when the prompt's prefill completes, its
  blocks are published under ``location``, and the finished request's
  ``RequestOutput.kv_transfer_params`` carries ``{"pdserve_handle": KVHandle.to_dict()}``;
- ``{"pdserve_load": KVHandle.to_dict()}`` on a consumer: the handle's tokens are loaded into
  the request's blocks instead of being computed.

Request lifecycle on the consumer:
  1. Waiting: the scheduler asks ``get_num_new_matched_tokens``; we answer how many prompt
     tokens the handle covers beyond the local prefix-cache hit (never the last token, so
     the engine computes at least one position and samples from it).
  2. Allocated: ``update_state_after_alloc`` records the blocks those tokens land in.
  3. Loading: ``build_connector_meta`` hands the load to the worker half, which copies the
     blocks in ``start_load_kv`` before the forward pass (a synchronous load).
  4. Failed load: the blocks are reported through ``get_block_ids_with_load_errors`` and
     vLLM applies ``kv_load_failure_policy`` (recompute them, or fail the request).
  5. Finished: ``request_finished`` returns ``{"num_external_tokens": n}``, which reaches
     the caller in ``RequestOutput.kv_transfer_params``.

Scheduler half: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
request_finished, on_new_request. Worker half: register_kv_caches, start_load_kv,
wait_for_save, get_block_ids_with_load_errors. The CPU engine runs layers one after another
on the same cores, so per-layer hooks (save_kv_layer, wait_for_layer_load) have no copy to
overlap with and do nothing; the transports copy whole prompts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtransfer import metrics
from kvtransfer.layout import KVHandle, KVLayout, expected_layout
from kvtransfer.transport import KVTransferError, KVTransport, transport_class

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SAVE_KEY = "pdserve_save"
LOAD_KEY = "pdserve_load"
# In RequestOutput.kv_transfer_params of a producer's finished request: the saved KV's handle.
HANDLE_KEY = "pdserve_handle"


@dataclass(slots=True)
class LoadSpec:
    """Copy handle blocks ``first_block..`` into ``block_ids`` of this engine."""

    request_id: str
    handle: KVHandle
    block_ids: list[int]
    first_block: int
    num_tokens: int


@dataclass(slots=True)
class SaveSpec:
    """Publish ``block_ids`` (the whole prompt) under ``location``."""

    request_id: str
    location: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class PdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class PdConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._block_size = vllm_config.cache_config.block_size
        self._transport_cls = transport_class(extra.get("transport", "shm"))
        self._extra_config = dict(extra)
        self._producer_id = str(extra.get("producer_id", self._kv_transfer_config.engine_id))
        self._layout = expected_layout(vllm_config)
        # Scheduler half.
        self._pending_saves: dict[str, tuple[Request, str]] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._num_external_tokens: dict[str, int] = {}
        self._saved: dict[str, KVHandle] = {}
        # Worker half.
        self._layers: list[torch.Tensor] = []
        self._transport: KVTransport | None = None
        self._failed_block_ids: set[int] = set()

    # ==============================
    # Scheduler half
    # ==============================

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        if SAVE_KEY in params:
            assert self._kv_transfer_config.is_kv_producer, "save asked of a consumer engine"
            self._pending_saves[request.request_id] = (request, params[SAVE_KEY])

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        handle = _load_handle(request)
        if handle is None:
            return 0, False
        return max(0, self._loadable_tokens(request, handle) - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        handle = _load_handle(request)
        assert handle is not None
        end = self._loadable_tokens(request, handle)
        start = end - num_external_tokens
        first_block, last_block = start // self._block_size, -(-end // self._block_size)
        self._pending_loads[request.request_id] = LoadSpec(
            request_id=request.request_id,
            handle=handle,
            block_ids=list(blocks.get_block_ids()[0][first_block:last_block]),
            first_block=first_block,
            num_tokens=num_external_tokens,
        )
        self._num_external_tokens[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdConnectorMetadata:
        meta = PdConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, (request, location) in list(self._pending_saves.items()):
            num_scheduled = scheduled.get(request_id, 0)
            if num_scheduled == 0:
                continue
            if request.num_computed_tokens + num_scheduled < request.num_prompt_tokens:
                continue  # a later chunk of the prompt completes it
            assert self._kv_cache_manager is not None, "kv cache manager not bound"
            num_blocks = -(-request.num_prompt_tokens // self._block_size)
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0][:num_blocks]
            meta.saves.append(
                SaveSpec(request_id, location, list(block_ids), request.num_prompt_tokens)
            )
            self._saved[request_id] = KVHandle(
                transport=self._transport_cls.name,
                location=location,
                num_tokens=request.num_prompt_tokens,
                layout=self._layout,
                producer_id=self._producer_id,
            )
            del self._pending_saves[request_id]
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pending_saves.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        num_external = self._num_external_tokens.pop(request.request_id, 0)
        saved = self._saved.pop(request.request_id, None)
        if saved is not None:
            return False, {HANDLE_KEY: saved.to_dict()}
        handle = _load_handle(request)
        if handle is None:
            return False, None
        # The worker frees the handle after loading it; a request aborted or finished before
        # its load ran (or one that needed none of it) would otherwise hold it until its lease ends.
        self._transport_cls.release(handle.location)
        return False, {"num_external_tokens": num_external}

    def _loadable_tokens(self, request: Request, handle: KVHandle) -> int:
        # The last prompt token is always computed here: its logits give the next token.
        return min(handle.num_tokens, request.num_prompt_tokens - 1)

    # ==============================
    # Worker half
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.values())
        layout = KVLayout.from_kv_caches(self._layers)
        assert layout == self._layout, f"engine allocated {layout}, expected {self._layout}"
        self._transport = self._transport_cls(layout, self._producer_id, self._extra_config)
        logger.info("PdConnector ready: transport=%s layout=%s", self._transport.name, layout)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdConnectorMetadata)
        for load in meta.loads:
            self._load(load)

    def _load(self, load: LoadSpec) -> None:
        assert self._transport is not None
        started = time.perf_counter()
        block_ids = torch.tensor(load.block_ids, dtype=torch.long)
        try:
            self._transport.recv(load.handle, self._layers, block_ids, load.first_block)
        except (KVTransferError, ValueError) as e:
            reason = getattr(e, "reason", "layout")
            logger.warning("KV load failed for %s (%s): %s", load.request_id, reason, e)
            metrics.record_failure(self._transport.name, reason)
            self._failed_block_ids.update(load.block_ids)
            return
        finally:
            self._transport_cls.release(load.handle.location)
        metrics.record_transfer(
            self._transport.name,
            "recv",
            load.num_tokens,
            len(load.block_ids) * self._transport.layout.block_nbytes * len(self._layers),
            time.perf_counter() - started,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdConnectorMetadata)
        assert self._transport is not None or not meta.saves
        for save in meta.saves:
            started = time.perf_counter()
            block_ids = torch.tensor(save.block_ids, dtype=torch.long)
            self._transport.send(save.location, self._layers, block_ids)
            metrics.record_transfer(
                self._transport.name,
                "send",
                save.num_tokens,
                len(save.block_ids) * self._transport.layout.block_nbytes * len(self._layers),
                time.perf_counter() - started,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _load_handle(request: Request) -> KVHandle | None:
    params = request.kv_transfer_params or {}
    raw = params.get(LOAD_KEY)
    return KVHandle.from_dict(raw) if raw else None
