"""pdserve's vLLM KV connector: prompt KV moves from a prefill engine to a decode engine.

Registered out of tree: ``KVTransferConfig(kv_connector="PdConnector",
kv_connector_module_path="kvtransfer.connector", kv_role=..., kv_connector_extra_config=
{"transport": "shm", "producer_id": ...})``. A request opts in through
``SamplingParams.extra_args["kv_transfer_params"]``:

- ``{"pdserve_save": {"transport": name, "location": location}}`` on a producer (a bare
  location string means the first configured transport): when the prompt's prefill
  completes, its blocks are published under ``location`` through that transport, and the
  finished request's ``RequestOutput.kv_transfer_params`` carries
  ``{"pdserve_handle": KVHandle.to_dict()}``;
- ``{"pdserve_load": KVHandle.to_dict()}`` on a consumer: the handle's tokens are loaded into
  the request's blocks instead of being computed;
- ``{"pdserve_tpot_s": seconds}`` on a consumer: the request's TPOT objective, which bounds
  how long the engine pauses per step for a prefill engine on its cores when the decode
  yield is ``slack`` or ``pace`` (kvtransfer.step_budget).

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

Request lifecycle on the producer: the prompt's blocks are published at the step that
computes the prompt's last chunk. A transport that copies them out (tcp, nccl: a staging
copy) lets vLLM free them when the request finishes; shm publishes the engine's own blocks,
so ``request_finished`` asks vLLM to keep them, and the worker half reports them done
(``get_finished``) once their lease ends.

One engine serves several transports at once (``kv_connector_extra_config["transports"]``):
the prefill worker picks one per request, the decode side reads whichever a handle names.

Scheduler half: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
request_finished, on_new_request. Worker half: register_kv_caches (reads and checks the KV
layout, see layout.py; asks vLLM for LBHNC via get_required_kvcache_layout), handle_preemptions
(the first call of each step: with shared cores, the decode engine stamps its steps and the
prefill engine sets its thread count, kvtransfer.prefill_threads), start_load_kv,
wait_for_save, get_finished, get_block_ids_with_load_errors. The CPU engine runs layers one after another
on the same cores, so per-layer hooks (save_kv_layer, wait_for_layer_load) have no copy to
overlap with and do nothing; the transports copy whole prompts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtransfer import metrics
from kvtransfer.coreshare import StepYield
from kvtransfer.engine_waits import bound_engine_spin, quiet_engine_waits
from kvtransfer.layout import REQUIRED_KV_CACHE_LAYOUT, KVHandle, KVLayout, expected_layout
from kvtransfer.prefill_threads import DecodeBeat, PrefillThreads
from kvtransfer.step_budget import StepBudget
from kvtransfer.transport import KVTransferError, KVTransport, transport_class

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SAVE_KEY = "pdserve_save"
LOAD_KEY = "pdserve_load"
# In RequestOutput.kv_transfer_params of a producer's finished request: the saved KV's handle.
HANDLE_KEY = "pdserve_handle"
# With PDSERVE_ENGINE_QUIET the engine's processes (this module is imported in each) wait
# for each other without spinning (kvtransfer.engine_waits).
quiet_engine_waits()
# A wait spins at most PDSERVE_ENGINE_SPIN_S, then sleeps (kvtransfer.engine_waits).
bound_engine_spin()

# On a consumer: the request's TPOT objective in seconds, for `--decode-yield slack|pace`.
TPOT_KEY = "pdserve_tpot_s"


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
    transport: str = "shm"


@dataclass
class PdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # The step computes nothing: the engine runs it only to learn which leases ended.
    idle: bool = False
    # `--decode-yield slack|pace`: what the running requests' TPOT objectives let this step
    # pause for (coreshare.pause_budget_s, pace_budget_s).
    yield_budget_s: float = 0.0


# A producer holding leases keeps its engine stepping (vLLM polls get_finished each step);
# an idle step waits this long so that polling costs no core.
IDLE_POLL_S = 0.002


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
        names = extra.get("transports") or [extra.get("transport", "shm")]
        self._transport_classes = {name: transport_class(name) for name in names}
        self._default_transport = names[0]
        self._extra_config = dict(extra)
        self._producer_id = str(extra.get("producer_id", self._kv_transfer_config.engine_id))
        self._layout = expected_layout(vllm_config)
        for name, cls in self._transport_classes.items():
            if self._layout.device not in cls.devices:
                raise ValueError(
                    f"the {name} KV transport moves {'/'.join(cls.devices)} KV caches; this "
                    f"engine keeps its KV on {self._layout.device}: configure other transports"
                )
        # Scheduler half.
        self._pending_saves: dict[str, tuple[Request, dict[str, str]]] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._num_external_tokens: dict[str, int] = {}
        self._saved: dict[str, KVHandle] = {}
        # Blocks a load is filling, until the request finishes: a failed load means the
        # engine recomputed those tokens, and the request reports no external tokens.
        self._loading_blocks: dict[str, set[int]] = {}
        # Worker half. Block views of the engine's per-layer caches (layout.block_view).
        self._layers: list[torch.Tensor] = []
        self._transports: dict[str, KVTransport] = {}
        self._failed_block_ids: set[int] = set()
        # Producer requests whose blocks stay held under a lease: id -> location.
        self._held: dict[str, str] = {}
        self._held_finished: set[str] = set()
        # A decode engine sharing its cores with a prefill engine yields it a slice per step
        # while that has prompts in hand (kvtransfer.coreshare; off unless configured).
        self._step_yield = (None if self._kv_transfer_config.is_kv_producer
                            or role != KVConnectorRole.WORKER else StepYield.from_env())
        # Slack or pace mode, scheduler half: how long each step may pause (None: neither).
        self._budget = (StepBudget.from_env() if role == KVConnectorRole.SCHEDULER
                        and not self._kv_transfer_config.is_kv_producer else None)
        # `--prefill-threads solo`: the decode engine stamps its steps, and the prefill engine
        # computes on one thread while decode steps (kvtransfer.prefill_threads); worker halves.
        worker = role == KVConnectorRole.WORKER
        producer = self._kv_transfer_config.is_kv_producer
        self._beat = DecodeBeat.from_env() if worker and not producer else None
        self._threads = PrefillThreads.from_env() if worker and producer else None

    # ==============================
    # Scheduler half
    # ==============================

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        if self._budget is not None and params.get(TPOT_KEY):
            self._budget.add(request, float(params[TPOT_KEY]))
        if SAVE_KEY in params:
            assert self._kv_transfer_config.is_kv_producer, "save asked of a consumer engine"
            save = params[SAVE_KEY]
            if isinstance(save, str):
                save = {"transport": self._default_transport, "location": save}
            assert save["transport"] in self._transport_classes, (
                f"transport {save['transport']!r} not served here: {list(self._transport_classes)}"
            )
            self._pending_saves[request.request_id] = (request, save)

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
        self._loading_blocks[request.request_id] = set(self._pending_loads[request.request_id].block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdConnectorMetadata:
        meta = PdConnectorMetadata(
            loads=list(self._pending_loads.values()),
            idle=not any(scheduler_output.num_scheduled_tokens.values()),
        )
        if self._budget is not None:
            meta.yield_budget_s = self._budget.budget_s(scheduler_output)
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, (request, save) in list(self._pending_saves.items()):
            num_scheduled = scheduled.get(request_id, 0)
            if num_scheduled == 0:
                continue
            if request.num_computed_tokens + num_scheduled < request.num_prompt_tokens:
                continue  # a later chunk of the prompt completes it
            assert self._kv_cache_manager is not None, "kv cache manager not bound"
            num_blocks = -(-request.num_prompt_tokens // self._block_size)
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0][:num_blocks]
            meta.saves.append(
                SaveSpec(
                    request_id,
                    save["location"],
                    list(block_ids),
                    request.num_prompt_tokens,
                    save["transport"],
                )
            )
            self._saved[request_id] = KVHandle(
                transport=save["transport"],
                location=save["location"],
                num_tokens=request.num_prompt_tokens,
                layout=self._layout,
                producer_id=self._producer_id,
            )
            del self._pending_saves[request_id]
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = connector_output.invalid_block_ids
        if not failed:
            return
        for request_id, blocks in self._loading_blocks.items():
            if blocks & failed:
                self._num_external_tokens[request_id] = 0

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._loading_blocks.pop(request.request_id, None)
        if self._budget is not None:
            self._budget.forget(request.request_id)
        self._pending_saves.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        num_external = self._num_external_tokens.pop(request.request_id, 0)
        saved = self._saved.pop(request.request_id, None)
        if saved is not None:
            # shm publishes the engine's own blocks: vLLM keeps them until the lease ends.
            holds = getattr(self._transport_classes[saved.transport], "holds_blocks", False)
            return holds, {HANDLE_KEY: saved.to_dict()}
        handle = _load_handle(request)
        if handle is None:
            return False, None
        # The worker frees the handle after loading it; a request aborted or finished before
        # its load ran (or one that needed none of it) would otherwise hold it until its lease ends.
        transport_class(handle.transport).release(handle.location)
        return False, {"num_external_tokens": num_external}

    def _loadable_tokens(self, request: Request, handle: KVHandle) -> int:
        # The last prompt token is always computed here: its logits give the next token.
        return min(handle.num_tokens, request.num_prompt_tokens - 1)

    # ==============================
    # Worker half
    # ==============================

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # One known layout on every backend: the handshake announces it before allocation.
        return REQUIRED_KV_CACHE_LAYOUT

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Reads the layout off the engine's tensors; refuses to start on any it cannot copy
        or that differs from the one this worker announced (handles, WorkerInfo)."""
        layers = list(kv_caches.values())
        layout = KVLayout.from_kv_caches(layers)
        diffs = layout.differences(self._layout, here="allocated", there="announced")
        if diffs:
            raise ValueError(
                "PdConnector: the engine's KV cache is not laid out as this worker announced ("
                + "; ".join(diffs) + "); VLLM_KV_CACHE_LAYOUT, the attention backend or the "
                "KV cache dtype moved it"
            )
        self._layers = [layout.block_view(layer) for layer in layers]
        if self._kv_transfer_config.is_kv_producer:
            for name, cls in self._transport_classes.items():
                self._transports[name] = cls(layout, self._producer_id, self._extra_config)
        logger.info(
            "PdConnector ready: role=%s transports=%s layout=%s",
            self._kv_transfer_config.kv_role, ",".join(self._transport_classes), layout,
        )

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        # A producer serving shm keeps its whole KV cache in shared memory, so a consumer
        # on this host copies blocks straight out of it.
        if self._kv_transfer_config.is_kv_producer and "shm" in self._transport_classes:
            from kvtransfer.shm import kv_cache_in_shm

            return kv_cache_in_shm(self._producer_id)
        return None

    def _transport(self, name: str) -> KVTransport:
        transport = self._transports.get(name)
        if transport is None:  # a consumer reads any transport a handle names
            transport = transport_class(name)(self._layout, self._producer_id, self._extra_config)
            self._transports[name] = transport
        return transport

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # The first call of a step in the model runner, before it builds the step's inputs:
        # vLLM's CPU attention metadata records the thread count, which must then not change.
        super().handle_preemptions(kv_connector_metadata)
        if getattr(kv_connector_metadata, "idle", False):
            return
        if self._beat is not None:
            self._beat.step_started()
        if self._threads is not None:
            self._threads.step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdConnectorMetadata)
        if self._step_yield is not None and (slept := self._step_yield.pause(meta.yield_budget_s)):
            metrics.DECODE_YIELD_SECONDS.inc(slept)
        for load in meta.loads:
            self._load(load)

    def _load(self, load: LoadSpec) -> None:
        name = load.handle.transport
        started = time.perf_counter()
        block_ids = torch.tensor(load.block_ids, dtype=torch.long)
        try:
            transport = self._transport(name)
            transport.recv(load.handle, self._layers, block_ids, load.first_block)
        except (KVTransferError, ValueError) as e:
            reason = getattr(e, "reason", "layout")
            logger.warning("KV load failed for %s (%s): %s", load.request_id, reason, e)
            metrics.record_failure(name, reason)
            self._failed_block_ids.update(load.block_ids)
            return
        finally:
            with contextlib.suppress(ValueError):
                transport_class(name).release(load.handle.location)
        metrics.record_transfer(
            name,
            "recv",
            load.num_tokens,
            len(load.block_ids) * self._layout.block_nbytes * len(self._layers),
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
        for save in meta.saves:
            started = time.perf_counter()
            block_ids = torch.tensor(save.block_ids, dtype=torch.long)
            transport = self._transports[save.transport]
            if getattr(transport, "holds_blocks", False):
                # vLLM keeps the blocks until get_finished reports them: tracked even when the
                # send fails (no lease then, so they are freed as soon as the request finishes).
                self._held[save.request_id] = save.location
            try:
                transport.send(save.location, self._layers, block_ids)
            except KVTransferError as e:
                # The consumer finds no KV there and its load-failure policy decides.
                logger.warning("KV save failed for %s (%s): %s", save.request_id, e.reason, e)
                metrics.record_failure(save.transport, e.reason)
                continue
            metrics.record_transfer(
                save.transport,
                "send",
                save.num_tokens,
                len(save.block_ids) * self._layout.block_nbytes * len(self._layers),
                time.perf_counter() - started,
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Producer: requests whose held blocks may be freed (their shm lease ended).

        Only requests the scheduler has finished count (vLLM frees a request's blocks once
        and only after it finished); one finished before its lease ended waits here.
        """
        if self._beat is not None:
            self._beat.step_ended()  # called after each step's forward
        if not self._held:
            return None, None
        from kvtransfer.shm import ShmTransport

        self._held_finished.update(finished_req_ids & self._held.keys())
        done = {r for r in self._held_finished if not ShmTransport.lease_held(self._held[r])}
        for request_id in done:
            del self._held[request_id]
        self._held_finished -= done
        metrics.set_leases("shm", len(self._held))
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not done and getattr(meta, "idle", False):
            time.sleep(IDLE_POLL_S)
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        for transport in self._transports.values():
            transport.close()
        if self._beat is not None:
            self._beat.close()


def _load_handle(request: Request) -> KVHandle | None:
    params = request.kv_transfer_params or {}
    raw = params.get(LOAD_KEY)
    return KVHandle.from_dict(raw) if raw else None
