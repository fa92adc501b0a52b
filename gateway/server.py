"""pdserve.v1.Generation: a Generate call's path through the gateway (the process that
serves it, its health and its stop: gateway/serving.py).

A Generate call:
  1. Validate: parse_request (INVALID_ARGUMENT names the field); at most max_inflight calls.
  2. Tokenize in the process pool (chat template for messages); check the model's limits.
  3. Admit: the class's objectives, the forecast from measured rates; refused at once with
     RESOURCE_EXHAUSTED and a retry hint when they cannot be met (gateway/dispatch.py).
  4. Queue until placed (priority classes, EDF, aging; gateway/queue.py); a deadline that
     passes in the queue ends the call with DEADLINE_EXCEEDED before any worker sees it.
  5. Placed remote: Prefill on the chosen prefill worker gives the first token and a KV
     handle; stream the first token, take a decode seat, Decode with the handle.
     Placed local: Decode without a handle on the chosen decode worker, which prefills the
     prompt itself (short prompts, busy prefill tier). A short prompt's remote prefill that
     stalls (twice its predicted time) is cancelled and moved to a decode worker.
  6. Stream detokenized text, cutting at stop strings, until a finish reason. A call that
     completes carries where it ran in its trailing metadata (`Route`).
A call that ends before its decode completes releases the handle, so the prefill side frees
the blocks now rather than at lease expiry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from gateway import metrics
from gateway.decode_stream import DecodeStreams
from gateway.dispatch import ClassObjectives, Dispatcher, Grant, predicted_s
from gateway.placement import PlacementConfig, Where
from gateway.queue import ClassPolicy, Priority, RequestQueue, Ticket, deadline_precision_s
from gateway.request import Job, check_prompt_fits, parse_request
from gateway.stream import ClassObserver, Stream
from gateway.tokenizer_pool import TokenizerPool
from gateway.workers import Seat, Worker, WorkerPool
from pdserve import rpc
from pdserve.config import GatewayConfig
from protos import generation_pb2, generation_pb2_grpc, worker_pb2

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"
# A stalled remote prefill that no decode worker could take yet is offered again this often.
STALL_RECHECK_S = 0.1


@dataclass(slots=True)
class Route:
    """Where a call ran, for its caller: trailing metadata ``pdserve-prefill`` (local: the
    decode worker prefilled the prompt; remote: the prefill tier did; moved: the prefill
    tier stalled and a decode worker took the prompt over) and the workers' addresses."""

    prefill: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((key, value) for key, value in (
            ("pdserve-prefill", self.prefill), ("pdserve-prefill-worker", self.prefill_worker),
            ("pdserve-decode-worker", self.decode_worker)) if value)


class WorkerGone(rpc.Unavailable):
    """A worker did not answer (process gone, connection refused or reset)."""

    @staticmethod
    def wrap(worker: Worker, e: grpc.aio.AioRpcError) -> Exception:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return WorkerGone(f"{worker.role} worker {worker.address} is unavailable: {e.details()}")
        return e


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: GatewayConfig, workers: WorkerPool, tokenizers: TokenizerPool,
                 tokenizer: Tokenizer) -> None:
        self._cfg = cfg
        self._workers = workers
        self._tokenizers = tokenizers
        self._tokenizer = tokenizer  # incremental detokenization, in this process
        self._dispatcher = build_dispatcher(cfg, workers)
        self._num_inflight = 0
        self.idle = asyncio.Event()  # set while no call is in flight (a stop waits for it)
        self.idle.set()
        self._stopping = False  # set by a stop: new calls are refused, those in flight go on
        self._releases: set[asyncio.Task] = set()  # referenced until done, so none is collected

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    def stop_taking_calls(self) -> None:
        self._stopping = True

    async def Generate(self, request, context) -> AsyncIterator[generation_pb2.GenerateResponse]:
        code = grpc.StatusCode.OK
        try:
            async for reply in self._generate(request, context):
                yield reply
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if code == grpc.StatusCode.OK and context.code() is not None:
                code = context.code()
            metrics.REQUESTS.labels(code.name).inc()

    @rpc.rpc_errors
    async def _generate(self, request, context):
        if self._stopping:
            raise rpc.Unavailable("this gateway is stopping (its calls in flight finish first); "
                                  "send the call to another gateway or retry once it is back")
        job = parse_request(request)
        if self._num_inflight >= self._cfg.max_inflight:
            raise rpc.ResourceExhausted(
                f"{self._num_inflight} requests in flight, the limit is {self._cfg.max_inflight}; retry with backoff"
            )
        self._num_inflight += 1
        self.idle.clear()
        metrics.INFLIGHT.set(self._num_inflight)
        route = Route()
        try:
            async for reply in self._run(job, context.time_remaining(), route):
                yield reply
            context.set_trailing_metadata(route.metadata())
        finally:
            self._num_inflight -= 1
            if not self._num_inflight:
                self.idle.set()
            metrics.INFLIGHT.set(self._num_inflight)

    async def _run(self, job: Job, time_remaining_s: float | None,
                   route: Route) -> AsyncIterator[generation_pb2.GenerateResponse]:
        arrival_s = time.monotonic()
        info = self._workers.model_info()
        if info is None or not self._workers.ready():
            raise rpc.Unavailable("no decode worker is ready; retry shortly")
        prompt_ids = await self._tokenize(job)
        check_prompt_fits(prompt_ids, job.sampling, info.max_model_len, info.vocab_size)
        ticket = self._ticket(job, prompt_ids, arrival_s, time_remaining_s)
        self._dispatcher.admit(ticket)
        stream = Stream(job, len(prompt_ids), self._tokenizer, started=arrival_s,
                        observer=ClassObserver(job.priority.label, ticket.ttft_slo_s, ticket.tpot_slo_s))
        for attempt in range(1, self._cfg.max_attempts + 1):
            grant = await self._dispatcher.acquire(ticket)
            worker = self._workers.by_address(grant.placement.worker)
            route.prefill, route.prefill_worker = grant.placement.where.value, ""
            try:
                if grant.placement.where is Where.REMOTE:
                    route.prefill_worker = worker.address
                    outcome = await self._call_prefill(job, ticket, worker, prompt_ids, grant)
                    if isinstance(outcome, worker_pb2.PrefillResponse):
                        prefill = outcome
                        break
                    grant, worker = outcome, self._workers.by_address(outcome.placement.worker)
                    route.prefill = "moved"
                assert grant.seat is not None
                route.decode_worker = worker.address
                async for reply in self._decode(job, stream, ticket, worker, grant.seat, prompt_ids, None):
                    yield reply
                return
            except WorkerGone as e:
                # Nothing streamed yet: the request may run elsewhere.
                self._workers.mark_down(worker, str(e))
                if stream.last_sent is not None or attempt == self._cfg.max_attempts:
                    raise rpc.Unavailable(f"{e}; the request was not completed") from e
                logger.warning("request %s: %s; retrying elsewhere (attempt %d)", job.request_id, e, attempt + 1)
        first = prefill.first_token_id
        if prefill.finish_reason or job.sampling.max_tokens == 1:
            yield stream.reply([first], prefill.finish_reason or "length")
            return
        reply = stream.reply([first], "")
        decoded = False
        try:
            yield reply
            if stream.stopped:
                return
            worker, seat = await self._dispatcher.decode_seat(ticket)
            route.decode_worker = worker.address
            self._dispatcher.first_token(worker, seat, 1, 0)
            async for reply in self._decode(job, stream, ticket, worker, seat, prompt_ids + [first], prefill.kv):
                yield reply
            decoded = True
        finally:
            # A call that ends any other way (stopped at the first token, cancelled, a decode
            # worker that failed before loading) may leave the handoff uncollected. Releasing
            # is idempotent: after a load the decode side has already freed it.
            if not decoded:
                self._release(prefill.kv)

    def _ticket(self, job: Job, prompt_ids: list[int], arrival_s: float, time_remaining_s: float | None) -> Ticket:
        ttft_s, tpot_s = self._dispatcher.objectives_for(job.priority, job.slo_ttft_ms, job.slo_tpot_ms)
        return Ticket(
            request_id=job.request_id,
            priority=job.priority,
            num_prompt_tokens=len(prompt_ids),
            max_tokens=job.sampling.max_tokens,
            arrival_s=arrival_s,
            deadline_s=None if time_remaining_s is None else arrival_s + time_remaining_s,
            deadline_precision_s=0.0 if time_remaining_s is None else deadline_precision_s(time_remaining_s),
            ttft_slo_s=ttft_s,
            tpot_slo_s=tpot_s,
            prompt_token_ids=tuple(prompt_ids),
        )

    async def _tokenize(self, job: Job) -> list[int]:
        if job.token_ids is not None:
            return list(job.token_ids)
        try:
            if job.messages is not None:
                return await self._tokenizers.encode_chat(job.messages)
            return await self._tokenizers.encode_text(job.prompt)
        except (ValueError, TypeError) as e:  # template errors: the caller's input
            raise rpc.InvalidArgument(f"cannot tokenize the input: {e}") from e

    async def _call_prefill(self, job: Job, ticket: Ticket, worker: Worker, prompt_ids: list[int],
                            grant: Grant) -> worker_pb2.PrefillResponse | Grant:
        """The prompt's prefill on ``worker``: its reply, or a local grant when the call
        stalled and a decode worker took the prompt instead (the call is then cancelled)."""
        num_cached: int | None = None
        try:
            kv_transport = self._workers.kv_transport(worker, self._cfg.kv_transport)
        except LookupError as e:
            self._dispatcher.prefill_done(worker, ticket, None)
            raise rpc.Unavailable(str(e)) from e
        sent_s = time.monotonic()
        call = worker.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id=job.request_id,
                token_ids=prompt_ids,
                sampling=job.sampling.to_engine(job.sampling.max_tokens),
                kv_transport=kv_transport,
                # Offline prompts must not slow the decoding of others (kvtransfer.coreshare).
                yield_decode=ticket.priority is not Priority.OFFLINE,
                ttft_left_ms=_ttft_left_ms(ticket, sent_s),
            )
        )
        answer = asyncio.ensure_future(call)
        # Set by the dispatcher when a newer prompt would be rescued on a decode worker
        # first: this one is offered the move before its stall time.
        asked = self._dispatcher.remote_started(worker, ticket)
        offer = asyncio.ensure_future(asked.wait())
        moved = False
        try:
            stall_s = wait_s = self._dispatcher.stalled_after_s(ticket, grant.placement)
            while wait_s is not None and not answer.done():
                await asyncio.wait({answer, offer}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                if answer.done():
                    break
                offered = offer.done()
                waited_s = time.monotonic() - sent_s
                local = self._dispatcher.move_stalled(worker, ticket, waited_s, offered=offered)
                if local is not None:
                    moved = True
                    logger.info("request %s: prefill worker %s did not answer in %.2f s (predicted %s%s); "
                                "prefilling on decode worker %s (predicted %s)", job.request_id, worker.address,
                                waited_s, predicted_s(grant.placement.predicted_ttft_s),
                                ", offered ahead of a newer prompt's rescue" if offered else "",
                                local.placement.worker, predicted_s(local.placement.predicted_ttft_s))
                    return local
                if offered:
                    asked.clear()
                    offer = asyncio.ensure_future(asked.wait())
                wait_s = STALL_RECHECK_S if waited_s >= stall_s else stall_s - waited_s
            reply = await answer
            num_cached = reply.num_cached_tokens
            return reply
        except grpc.aio.AioRpcError as e:
            raise WorkerGone.wrap(worker, e) from e
        finally:
            offer.cancel()
            self._dispatcher.remote_ended(ticket)
            if not answer.done():
                call.cancel()  # moved, or this call was cancelled: the prefill worker aborts it
                answer.cancel()
            if not moved:
                self._dispatcher.prefill_done(worker, ticket, num_cached)

    async def _decode(self, job: Job, stream: Stream, ticket: Ticket, worker: Worker, seat: Seat,
                      token_ids: list[int], kv: worker_pb2.KvHandle | None):
        request = worker_pb2.DecodeRequest(
            request_id=job.request_id,
            token_ids=token_ids,
            # A local prefill samples the first token here too.
            sampling=job.sampling.to_engine(job.sampling.max_tokens - (0 if kv is None else 1)),
        )
        request.sampling.stream_interval = self._cfg.stream_intervals[job.priority]
        if ticket.tpot_slo_s:
            request.tpot_objective_ms = max(round(ticket.tpot_slo_s * 1000), 1)
        if kv is not None:
            request.kv.CopyFrom(kv)
        if self._cfg.decode_stream == "per-request":
            call = worker.stub.Decode(request)
        else:
            if worker.decode_streams is None:
                worker.decode_streams = DecodeStreams(worker.stub, worker.address)
            call = worker.decode_streams.start(request)
        last_s: float | None = None  # the first chunk's wait is a prefill or a KV load, not a step
        finished = False
        try:
            async for chunk in call:
                now = time.monotonic()
                if seat.first_token_s is None:
                    self._dispatcher.first_token(worker, seat, len(chunk.token_ids), chunk.num_cached_tokens)
                elif last_s is not None:
                    self._dispatcher.tokens(worker, seat, len(chunk.token_ids), now - last_s)
                else:
                    seat.num_generated += len(chunk.token_ids)
                last_s = now
                reply = stream.reply(list(chunk.token_ids), chunk.finish_reason)
                if chunk.finish_reason:
                    metrics.KV_HANDOFF_TOKENS.inc(chunk.num_external_tokens)
                finished = bool(chunk.finish_reason)
                yield reply
                if reply.finish_reason:
                    return
            raise rpc.Unavailable(f"decode worker {worker.address} ended the stream without finishing")
        except grpc.aio.AioRpcError as e:
            raise WorkerGone.wrap(worker, e) from e
        finally:
            call.cancel()
            self._dispatcher.release(worker, seat, finished)

    def _release(self, kv: worker_pb2.KvHandle) -> None:
        """Frees an unused handoff now rather than at lease expiry (best effort)."""
        for worker in self._workers.tier("prefill"):
            if worker.info is not None and worker.info.worker_id == kv.producer_id:
                task = asyncio.ensure_future(_quiet(worker.stub.Release(worker_pb2.ReleaseRequest(kv=kv), timeout=5)))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)


async def _quiet(call) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        logger.warning("releasing a KV handle failed: %s", e.details())


def build_dispatcher(cfg: GatewayConfig, workers: WorkerPool) -> Dispatcher:
    """The gateway's queue, admission and placement, from its configuration."""
    classes = {p: ClassPolicy(cfg.class_weights[p], cfg.queue_limits[p]) for p in Priority}
    seconds = lambda ms: ms / 1000 if ms else None  # noqa: E731 - 0 means no objective
    objectives = ClassObjectives(
        ttft_s={p: seconds(cfg.slo_ttft_ms[p]) for p in Priority},
        tpot_s={p: seconds(cfg.slo_tpot_ms[p]) for p in Priority},
    )
    return Dispatcher(
        RequestQueue(cfg.policy, classes, cfg.aging_s),
        workers,
        PlacementConfig(cfg.prefill_queue_tokens, cfg.local_prefill_max_tokens, cfg.rescue_prefill_max_tokens,
                        priority_hold_s=cfg.priority_hold_s),
        objectives,
        admission=cfg.policy == "slo",
    )


def _ttft_left_ms(ticket: Ticket, now_s: float) -> int:
    """What is left until the request's first token is due (its TTFT objective or its
    deadline, `Ticket.due_s`), for PrefillRequest.ttft_left_ms: 0 when nothing bounds it,
    at least 1 once it is due."""
    due = ticket.due_s
    if math.isinf(due):
        return 0
    return max(round((due - now_s) * 1000), 1)
