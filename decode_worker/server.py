"""The decode worker's gRPC servicer.

Decode(prompt + first token, kv handle) streams the rest of the answer. The handle's prompt
KV is loaded into this engine's blocks by our connector; only the first generated token's
position is computed here before decoding continues. Without a handle the engine prefills
the prompt itself (short prompts, or a prefill worker that could not be reached).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from kvtransfer.connector import LOAD_KEY, TPOT_KEY
from kvtransfer.layout import KVHandle, LayoutMismatchError, expected_layout
from pdserve.config import WorkerConfig
from pdserve.engine import layout_from_proto, sampling_params, worker_info
from pdserve.membership import InflightInterceptor
from pdserve.rpc import FailedPrecondition, InvalidArgument, Unavailable, rpc_errors, status_of
from protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.worker.v1.DecodeWorker"


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, engine, cfg: WorkerConfig, inflight: InflightInterceptor | None = None) -> None:
        self._engine = engine
        self._cfg = cfg
        # Counts each request of a DecodeStream as the interceptor counts a Decode call.
        self._inflight = inflight or InflightInterceptor()
        self._info = worker_info(engine, cfg)
        self._layout = expected_layout(engine.vllm_config)

    @rpc_errors
    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        async for reply in self._replies(request):
            yield reply

    async def DecodeStream(self, requests, context):
        """Many requests over one call (see worker.proto): each runs as a task of its own
        and puts its replies in one outbox; every message sent carries all that the outbox
        holds, so the requests one engine step advanced share one message."""
        outbox: asyncio.Queue = asyncio.Queue()
        running: dict[int, asyncio.Task] = {}

        async def run(stream_id: int, request: worker_pb2.DecodeRequest) -> None:
            self._inflight.enter()
            try:
                async for reply in self._replies(request):
                    outbox.put_nowait(worker_pb2.DecodeStreamChunk(stream_id=stream_id, reply=reply))
            except asyncio.CancelledError:
                pass  # cancelled by the caller, or the call ended: nothing more to send
            except Exception as e:  # noqa: BLE001 - sent as this request's status
                code, message = status_of(e, "DecodeStream")
                outbox.put_nowait(worker_pb2.DecodeStreamChunk(
                    stream_id=stream_id, error_code=code.value[0], error_message=message))
            finally:
                running.pop(stream_id, None)
                self._inflight.leave()

        async def read() -> None:
            try:
                async for message in requests:
                    action = message.WhichOneof("action")
                    if action == "start":
                        if message.stream_id in running:
                            outbox.put_nowait(worker_pb2.DecodeStreamChunk(
                                stream_id=message.stream_id, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                error_message=f"stream_id {message.stream_id} is already running on this call"))
                            continue
                        running[message.stream_id] = asyncio.create_task(run(message.stream_id, message.start))
                    elif action == "cancel" and message.stream_id in running:
                        running[message.stream_id].cancel()
                # The caller is done sending: finish what runs, then end the call.
                while running:
                    await asyncio.wait(list(running.values()))
            finally:
                outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                batch = [await outbox.get()]
                while not outbox.empty():
                    batch.append(outbox.get_nowait())
                end = batch[-1] is None
                chunks = [c for c in batch if c is not None]
                if chunks:
                    yield worker_pb2.DecodeStreamResponse(chunks=chunks)
                if end:
                    return
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    async def _replies(self, request: worker_pb2.DecodeRequest):
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


def add_servicer(server, engine, cfg: WorkerConfig,
                 inflight: InflightInterceptor | None = None) -> tuple[str, worker_pb2.WorkerInfo]:
    servicer = DecodeServicer(engine, cfg, inflight)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    return SERVICE_NAME, servicer.info


def main(cfg: WorkerConfig) -> int:
    from pdserve.worker import run_worker

    return run_worker(cfg, add_servicer)
