"""The decode worker's gRPC servicer.

Decode(prompt + first token, kv handle) streams the rest of the answer. The handle's prompt
KV is loaded into this engine's blocks by our connector; only the first generated token's
position is computed here before decoding continues. Without a handle the engine prefills
the prompt itself (short prompts, or a prefill worker that could not be reached).
"""

from __future__ import annotations

import logging
import uuid

from kvtransfer.connector import LOAD_KEY, TPOT_KEY
from kvtransfer.layout import KVHandle, LayoutMismatchError, expected_layout
from pdserve.config import WorkerConfig
from pdserve.engine import layout_from_proto, sampling_params, worker_info
from pdserve.rpc import FailedPrecondition, InvalidArgument, Unavailable, rpc_errors
from protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.worker.v1.DecodeWorker"


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine, cfg: WorkerConfig) -> None:
        self._engine = engine
        self._cfg = cfg
        self._info = worker_info(engine, cfg)
        self._layout = expected_layout(engine.vllm_config)

    @rpc_errors
    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        from vllm.inputs import TokensPrompt

        token_ids = list(request.token_ids)
        if not token_ids:
            raise InvalidArgument("token_ids is empty")
        if len(token_ids) >= self._info.max_model_len:
            raise InvalidArgument(
                f"{len(token_ids)} tokens do not leave room to decode in a context of "
                f"{self._info.max_model_len}"
            )
        max_tokens = min(request.sampling.max_tokens, self._info.max_model_len - len(token_ids))
        if max_tokens < 1:
            raise InvalidArgument("sampling.max_tokens must be >= 1")
        kv_params = None
        if request.HasField("kv"):
            handle = handle_from_proto(request.kv)
            if handle.transport not in self._cfg.kv_transports:
                raise FailedPrecondition(
                    f"KV handoff refused: handle uses transport {handle.transport!r}, this "
                    f"decode worker reads {', '.join(self._cfg.kv_transports)}"
                )
            try:
                self._layout.check_compatible(handle.layout)
            except LayoutMismatchError as e:
                raise FailedPrecondition(f"KV handoff refused: {e}") from e
            if handle.num_tokens >= len(token_ids):
                raise InvalidArgument(
                    f"KV handle covers {handle.num_tokens} tokens of a {len(token_ids)}-token "
                    "prompt; it must cover a strict prefix"
                )
            kv_params = {LOAD_KEY: handle.to_dict()}
        if request.tpot_objective_ms:
            kv_params = {**(kv_params or {}), TPOT_KEY: request.tpot_objective_ms / 1000}
        params = sampling_params(request.sampling, max_tokens, kv_params)
        request_id = request.request_id or uuid.uuid4().hex
        async for out in self._engine.generate(TokensPrompt(prompt_token_ids=token_ids), params, request_id):
            completion = out.outputs[0]
            reply = worker_pb2.DecodeResponse(token_ids=completion.token_ids)
            if out.finished:
                if completion.finish_reason == "error":
                    raise Unavailable(f"request {request_id}: KV load failed and the policy is 'fail'")
                reply.finish_reason = completion.finish_reason or "stop"
                reply.num_external_tokens = (out.kv_transfer_params or {}).get("num_external_tokens", 0)
                reply.num_cached_tokens = out.num_cached_tokens or 0
            yield reply

    @property
    def info(self) -> worker_pb2.WorkerInfo:
        return self._info

    @rpc_errors
    async def Info(self, request, context) -> worker_pb2.WorkerInfo:
        return self._info


def handle_from_proto(msg: worker_pb2.KvHandle) -> KVHandle:
    try:
        layout = layout_from_proto(msg.layout)
    except ValueError as e:
        raise InvalidArgument(f"kv.layout: {e}") from e
    return KVHandle(
        transport=msg.transport,
        location=msg.location,
        num_tokens=msg.num_tokens,
        layout=layout,
        producer_id=msg.producer_id,
    )


def add_servicer(server, engine, cfg: WorkerConfig) -> tuple[str, worker_pb2.WorkerInfo]:
    servicer = DecodeServicer(engine, cfg)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    return SERVICE_NAME, servicer.info


def main(cfg: WorkerConfig) -> int:
    from pdserve.worker import run_worker

    return run_worker(cfg, add_servicer)
