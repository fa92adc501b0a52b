"""The prefill worker's gRPC servicer.

Prefill(token_ids) runs the prompt with max_tokens=1: the engine computes the prompt's KV,
samples the first token, and our connector publishes the prompt's blocks under a fresh
location; the reply carries the first token and the KV handle. The first token reaches the
client before any KV moves, so TTFT is prefill alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from kvtransfer.connector import HANDLE_KEY, SAVE_KEY
from kvtransfer.coreshare import BestRate, PrefillBusy, urgent_at
from kvtransfer.layout import KVHandle
from kvtransfer.transport import transport_class
from pdserve.config import WorkerConfig
from pdserve.engine import kv_extra_config, layout_to_proto, sampling_params, worker_info
from pdserve.rpc import InvalidArgument, rpc_errors
from protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.worker.v1.PrefillWorker"


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine, cfg: WorkerConfig) -> None:
        self._engine = engine
        self._cfg = cfg
        self._info = worker_info(engine, cfg)
        self._kv_extra = kv_extra_config(cfg)
        # Tells a decode engine on these cores when prefill has work it may yield to
        # (kvtransfer.coreshare; PrefillRequest.yield_decode).
        self._busy = PrefillBusy.from_env()
        self._best_rate = BestRate()  # prompt tokens per second on every core, for urgent_at

    @rpc_errors
    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        from vllm.inputs import TokensPrompt

        token_ids = list(request.token_ids)
        _check_prompt(token_ids, self._info)
        transport = self._transport(request.kv_transport or self._cfg.kv_transports[0])
        location = transport.location_for(f"{self._cfg.worker_id}-{uuid.uuid4().hex}", self._kv_extra)
        save = {"transport": transport.name, "location": location}
        params = sampling_params(request.sampling, max_tokens=1, kv_transfer_params={SAVE_KEY: save})
        request_id = request.request_id or uuid.uuid4().hex
        # The order the engine receives prompts in is the order the gateway chose.
        logger.info("prefill %s: %d prompt tokens", request_id, len(token_ids))
        first_token_id: int | None = None
        yielded = self._busy is not None and request.yield_decode
        if yielded:
            taken_s = time.monotonic()
            ttft_left_s = request.ttft_left_ms / 1000 if request.ttft_left_ms else None
            token = self._busy.enter(urgent_at(taken_s, ttft_left_s, len(token_ids), self._best_rate.tokens_per_s))
        try:
            async for out in self._engine.generate(TokensPrompt(prompt_token_ids=token_ids), params, request_id):
                if out.outputs[0].token_ids:
                    first_token_id = out.outputs[0].token_ids[0]
                final = out
            if yielded:
                self._best_rate.observe(len(token_ids) - (final.num_cached_tokens or 0), time.monotonic() - taken_s)
        finally:
            if yielded:
                self._busy.leave(token)
        assert final.finished and first_token_id is not None
        handle = (final.kv_transfer_params or {}).get(HANDLE_KEY)
        finish_reason = _finish_reason(final.outputs[0].finish_reason, request, len(token_ids), self._info)
        reply = worker_pb2.PrefillResponse(
            first_token_id=first_token_id,
            finish_reason=finish_reason,
            num_cached_tokens=final.num_cached_tokens or 0,
        )
        if finish_reason:
            transport.release(location)  # nothing left to decode
        elif handle is not None:
            reply.kv.CopyFrom(handle_to_proto(KVHandle.from_dict(handle)))
        return reply

    @rpc_errors
    async def Release(self, request: worker_pb2.ReleaseRequest, context) -> worker_pb2.ReleaseResponse:
        if request.kv.producer_id != self._cfg.worker_id:
            raise InvalidArgument(
                f"handle belongs to worker {request.kv.producer_id!r}, this is {self._cfg.worker_id!r}"
            )
        self._transport(request.kv.transport).release(request.kv.location)
        return worker_pb2.ReleaseResponse()

    def _transport(self, name: str):
        if name not in self._cfg.kv_transports:
            raise InvalidArgument(
                f"kv_transport {name!r} is not served by this prefill worker; it serves "
                f"{', '.join(self._cfg.kv_transports)}"
            )
        return transport_class(name)

    @property
    def info(self) -> worker_pb2.WorkerInfo:
        return self._info

    @rpc_errors
    async def Info(self, request, context) -> worker_pb2.WorkerInfo:
        return self._info


def _check_prompt(token_ids: list[int], info: worker_pb2.WorkerInfo) -> None:
    if not token_ids:
        raise InvalidArgument("token_ids is empty")
    if len(token_ids) >= info.max_model_len:
        raise InvalidArgument(
            f"prompt has {len(token_ids)} tokens; the model's context is {info.max_model_len}"
        )
    bad = [t for t in token_ids if t >= info.vocab_size]
    if bad:
        raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (size {info.vocab_size})")


def _finish_reason(engine_reason: str | None, request, num_prompt_tokens: int, info) -> str:
    """Whether the request ended at its first token, as the whole request sees it."""
    if engine_reason == "stop":
        return "stop"
    if request.sampling.max_tokens <= 1 or num_prompt_tokens + 1 >= info.max_model_len:
        return "length"
    return ""


def handle_to_proto(handle: KVHandle) -> worker_pb2.KvHandle:
    return worker_pb2.KvHandle(
        transport=handle.transport,
        location=handle.location,
        num_tokens=handle.num_tokens,
        layout=layout_to_proto(handle.layout),
        producer_id=handle.producer_id,
    )


async def sweep_leases(cfg: WorkerConfig) -> None:
    """Frees KV that no decode worker collected before its lease ended (shm; the network
    transports' staged copies expire inside the engine), and the shared KV caches of
    producers on this host that were killed."""
    from kvtransfer.shm import drop_leases, sweep_expired, sweep_orphan_caches

    if "shm" not in cfg.kv_transports:
        return
    try:
        while True:
            orphans = sweep_orphan_caches()
            if orphans:
                logger.info("removed %d shared KV caches and leases of gone workers: %s", len(orphans), orphans)
            swept = sweep_expired(cfg.worker_id, cfg.kv_lease_s)
            if swept:
                logger.info("lease expired for %d uncollected KV handoffs", len(swept))
            await asyncio.sleep(max(cfg.kv_lease_s / 4, 0.5))
    finally:
        drop_leases(cfg.worker_id)  # shutting down: the cache they name goes with this worker


def add_servicer(server, engine, cfg: WorkerConfig, inflight=None) -> tuple[str, worker_pb2.WorkerInfo]:
    from kvtransfer.shm import has_shared_cache

    if "shm" in cfg.kv_transports and not has_shared_cache(cfg.worker_id):
        # The engine could not place its KV cache in /dev/shm (logged there): serve the rest.
        served = tuple(t for t in cfg.kv_transports if t != "shm")
        logger.error("shm KV transport unavailable; serving %s", ", ".join(served) or "nothing")
        if not served:
            raise RuntimeError("no KV transport left to serve: give /dev/shm room for the KV cache")
        cfg = dataclasses.replace(cfg, kv_transports=served)
    servicer = PrefillServicer(engine, cfg)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    return SERVICE_NAME, servicer.info


def main(cfg: WorkerConfig) -> int:
    from pdserve.worker import run_worker

    return run_worker(cfg, add_servicer, background=sweep_leases)
