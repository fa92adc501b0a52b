"""How a benchmark sends one request: the pdserve gRPC API or an OpenAI-compatible server.

Both backends turn a `RequestSpec` into a `RequestRecord` with the same clock and the same
rules, so their numbers compare: a chunk counts when it carries at least one output token
(TTFT is the first such chunk), the output length is the server's usage count when it
reports one, and a failure is recorded under a code name rather than raised, so one bad
request never stops a run.

- `GrpcBackend`: ``pdserve.v1.Generation/Generate`` with ``token_ids`` and ``ignore_eos``,
  each request's class as its ``priority`` and its class's SLO as its ``slo``, so the
  gateway schedules and admits by the objectives the run is judged by.
- `OpenAIBackend`: ``POST /v1/completions`` with ``"stream": true``, the prompt as a token
  id list, and ``return_token_ids`` (vLLM) to count tokens per chunk; servers that ignore
  it are counted as one token per non-empty chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from pdserve.bench.metrics import SLO, Objective
from pdserve.bench.record import Chunk, RequestRecord
from pdserve.bench.workload import RequestSpec
from protos import generation_pb2, generation_pb2_grpc

Clock = Callable[[], float]


@dataclass(slots=True, frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    # Exact output lengths: the spec's output_len is what the server generates.
    ignore_eos: bool = True
    request_timeout_s: float = 600.0


class Backend(Protocol):
    """Sends requests to one server; used as an async context manager."""

    async def __aenter__(self) -> Backend: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def generate(self, spec: RequestSpec, now: Clock) -> RequestRecord: ...

    def use_slo(self, slo: Objective) -> None:
        """The objectives the next requests carry (where the API has a field for them)."""


def new_record(spec: RequestSpec, send_s: float) -> RequestRecord:
    return RequestRecord(request_id=spec.request_id, class_name=spec.class_name,
                         priority=spec.priority, prompt_len=spec.prompt_len,
                         expected_output_len=spec.output_len, send_s=send_s)


# ---------------------------------------------------------------- gRPC (pdserve) ----------


def priority_setter(request_type: type) -> Callable[[object, RequestSpec], None]:
    """Sets `priority` on a GenerateRequest (a no-op for an API without the field).

    An integer field takes the spec's number; an enum field takes the value named after
    the class (``INTERACTIVE`` or ``PRIORITY_INTERACTIVE``), else the value with the
    spec's number (the class "default" has 0: PRIORITY_UNSPECIFIED, i.e. interactive).
    """
    field = request_type.DESCRIPTOR.fields_by_name.get("priority")
    if field is None:
        return lambda request, spec: None
    if field.enum_type is None:
        return lambda request, spec: setattr(request, "priority", spec.priority)
    values = field.enum_type.values_by_name

    def set_enum(request: object, spec: RequestSpec) -> None:
        name = spec.class_name.upper()
        value = values.get(name) or values.get(f"PRIORITY_{name}")
        number = value.number if value is not None else spec.priority
        if number in field.enum_type.values_by_number:
            setattr(request, "priority", number)

    return set_enum


def slo_message(slo: SLO) -> generation_pb2.Slo | None:
    """The request's ``slo`` in whole milliseconds (at least 1: 0 means "no objective");
    None when the SLO constrains nothing, so the gateway's class defaults apply."""
    if slo.ttft_s is None and slo.tpot_s is None:
        return None
    message = generation_pb2.Slo()
    if slo.ttft_s is not None:
        message.ttft_ms = max(1, round(slo.ttft_s * 1000))
    if slo.tpot_s is not None:
        message.tpot_ms = max(1, round(slo.tpot_s * 1000))
    return message


class GrpcBackend:
    def __init__(self, target: str, sampling: SamplingConfig, slo: Objective = SLO()) -> None:
        self._target = target
        self._sampling = sampling
        self._slo = slo
        self._set_priority = priority_setter(generation_pb2.GenerateRequest)
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None

    async def __aenter__(self) -> GrpcBackend:
        # One channel: HTTP/2 multiplexes every concurrent request over it.
        self._channel = grpc.aio.insecure_channel(self._target)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    def use_slo(self, slo: Objective) -> None:
        self._slo = slo

    def build_request(self, spec: RequestSpec) -> generation_pb2.GenerateRequest:
        request = generation_pb2.GenerateRequest(
            request_id=spec.request_id,
            token_ids=spec.prompt_token_ids,
            sampling=generation_pb2.SamplingParams(
                max_tokens=spec.output_len, temperature=self._sampling.temperature,
                ignore_eos=self._sampling.ignore_eos))
        self._set_priority(request, spec)
        slo = slo_message(self._slo.of(spec.class_name))
        if slo is not None:
            request.slo.CopyFrom(slo)
        return request

    async def generate(self, spec: RequestSpec, now: Clock) -> RequestRecord:
        assert self._stub is not None, "use the backend as an async context manager"
        request = self.build_request(spec)
        record = new_record(spec, now())
        streamed, reported = 0, None
        try:
            call = self._stub.Generate(request, timeout=self._sampling.request_timeout_s)
            async for response in call:
                t = now()
                if response.token_ids:
                    record.chunks.append(Chunk(t, len(response.token_ids)))
                    streamed += len(response.token_ids)
                if response.HasField("usage"):
                    reported = response.usage.completion_tokens
            record.done_s = now()
            record.route = route_of(await call.trailing_metadata())
        except grpc.aio.AioRpcError as e:
            record.error, record.error_message = e.code().name, e.details() or ""
            record.done_s = now()
        record.output_tokens = reported if reported is not None else streamed
        return record


ROUTE_PREFIX = "pdserve-"


def route_of(metadata) -> dict[str, str]:
    """pdserve's trailing metadata about where a call ran (gateway.server.Route), without
    the prefix: {"prefill": "local", "decode-worker": "127.0.0.1:..."}."""
    return {key[len(ROUTE_PREFIX):]: value for key, value in (metadata or ())
            if key.startswith(ROUTE_PREFIX) and isinstance(value, str)}


# ---------------------------------------------------------------- OpenAI HTTP ------------


class OpenAIBackend:
    def __init__(self, base_url: str, sampling: SamplingConfig,
                 model_name: str | None = None) -> None:
        self._base_url = base_url.rstrip("/")
        self._sampling = sampling
        self._model_name = model_name
        self._session = None

    def use_slo(self, slo: Objective) -> None:
        """vLLM's completions API has no objectives: the server never sees them."""

    async def __aenter__(self) -> OpenAIBackend:
        import aiohttp  # only this backend needs it

        # No connection cap: an open-loop client must not queue requests itself.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self._sampling.request_timeout_s))
        if self._model_name is None:
            async with self._session.get(f"{self._base_url}/v1/models") as resp:
                resp.raise_for_status()
                self._model_name = (await resp.json())["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def build_payload(self, spec: RequestSpec) -> dict:
        return {
            "model": self._model_name,
            "prompt": list(spec.prompt_token_ids),
            "max_tokens": spec.output_len,
            "temperature": self._sampling.temperature,
            "ignore_eos": self._sampling.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }

    async def generate(self, spec: RequestSpec, now: Clock) -> RequestRecord:
        import aiohttp

        assert self._session is not None, "use the backend as an async context manager"
        payload = self.build_payload(spec)
        record = new_record(spec, now())
        streamed, reported = 0, None
        try:
            async with self._session.post(f"{self._base_url}/v1/completions",
                                          json=payload) as resp:
                if resp.status != 200:
                    record.error = f"HTTP_{resp.status}"
                    record.error_message = (await resp.text())[:500]
                else:
                    async for line in resp.content:
                        event = parse_sse_line(line)
                        if event is None:
                            continue
                        t = now()
                        num_tokens, usage = chunk_tokens(event)
                        if num_tokens:
                            record.chunks.append(Chunk(t, num_tokens))
                            streamed += num_tokens
                        if usage is not None:
                            reported = usage
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            record.error = "TIMEOUT" if isinstance(e, asyncio.TimeoutError) else type(e).__name__
            record.error_message = str(e)
        record.done_s = now()
        record.output_tokens = reported if reported is not None else streamed
        return record


def parse_sse_line(line: bytes) -> dict | None:
    """The JSON of one server-sent-event ``data:`` line; None for anything else."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[len(b"data:"):].strip()
    if not data or data == b"[DONE]":
        return None
    return json.loads(data)


def chunk_tokens(event: dict) -> tuple[int, int | None]:
    """(output tokens in this chunk, completion_tokens if the chunk reports usage)."""
    num_tokens = 0
    for choice in event.get("choices") or []:
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            num_tokens += len(token_ids)
        elif choice.get("text"):
            num_tokens += 1
    usage = event.get("usage")
    return num_tokens, (usage.get("completion_tokens") if usage else None)
