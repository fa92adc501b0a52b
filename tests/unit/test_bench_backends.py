"""The gRPC and OpenAI backends against in-process fake servers, and the load drivers.

The fakes stream known tokens with known delays, so the assertions on token counts,
chunking, errors and ordering are exact and the timing ones are lower bounds.
"""

import asyncio
import json

import grpc
import pytest
from aiohttp import web

from pdserve.bench.backends import (
    GrpcBackend,
    OpenAIBackend,
    SamplingConfig,
    chunk_tokens,
    parse_sse_line,
    slo_message,
)
from pdserve.bench.loadgen import LoadConfig, drive, run_clock
from pdserve.bench.metrics import SLO, SLOTable
from pdserve.bench.record import RequestRecord
from pdserve.bench.runner import BenchConfig, run_bench
from pdserve.bench.workload import LengthRange, RequestSpec, WorkloadConfig
from protos import generation_pb2, generation_pb2_grpc

PAYLOADS = web.AppKey("payloads", list)
FIRST_DELAY_S = 0.05
TOKEN_DELAY_S = 0.01
TOKENS_PER_CHUNK = 2


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams max_tokens ids (1000, 1001, ...) in chunks of two; "-fail" ids are refused."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.request_id.endswith("-fail"):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(FIRST_DELAY_S)
            ids = list(range(1000, 1000 + request.sampling.max_tokens))
            for i in range(0, len(ids), TOKENS_PER_CHUNK):
                if i:
                    await asyncio.sleep(TOKEN_DELAY_S)
                yield generation_pb2.GenerateResponse(
                    request_id=request.request_id, token_ids=ids[i:i + TOKENS_PER_CHUNK],
                    text="x" * len(ids[i:i + TOKENS_PER_CHUNK]))
            yield generation_pb2.GenerateResponse(
                request_id=request.request_id, finish_reason="length",
                usage=generation_pb2.Usage(prompt_tokens=len(request.token_ids),
                                           completion_tokens=len(ids)))
            context.set_trailing_metadata((("pdserve-prefill", "remote"), ("other", "x"),
                                           ("pdserve-decode-worker", "127.0.0.1:1")))
        finally:
            self.in_flight -= 1


async def with_fake_server(body):
    """Runs `body(servicer, target)` against a fake served on 127.0.0.1:<free port>."""
    server = grpc.aio.server()
    servicer = FakeGeneration()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await body(servicer, f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


def spec(request_id="a", prompt=(101, 102, 103), output_len=5, **kw) -> RequestSpec:
    return RequestSpec(request_id, tuple(prompt), output_len, **kw)


def test_grpc_backend_records_chunks_usage_and_timing():
    async def body(servicer, target):
        async with GrpcBackend(target, SamplingConfig(temperature=0.5)) as backend:
            return await backend.generate(spec(output_len=5, class_name="batch", priority=1),
                                          run_clock())

    record = asyncio.run(with_fake_server(body))
    assert record.ok and record.error is None
    assert (record.request_id, record.class_name, record.priority) == ("a", "batch", 1)
    assert (record.prompt_len, record.expected_output_len, record.output_tokens) == (3, 5, 5)
    assert [c.num_tokens for c in record.chunks] == [2, 2, 1]
    assert record.ttft_s >= FIRST_DELAY_S
    assert record.e2e_s >= FIRST_DELAY_S + 2 * TOKEN_DELAY_S
    assert len(record.itls_s()) == 3  # one per token after the first chunk
    # The server's trailing metadata about where it ran, its own keys only.
    assert record.route == {"prefill": "remote", "decode-worker": "127.0.0.1:1"}


def test_grpc_backend_sends_token_ids_and_sampling():
    backend = GrpcBackend("unused:1", SamplingConfig(temperature=0.0, ignore_eos=True))
    request = backend.build_request(spec(output_len=7))
    assert list(request.token_ids) == [101, 102, 103]
    assert request.sampling.max_tokens == 7
    assert request.sampling.temperature == 0.0 and request.sampling.HasField("temperature")
    assert request.sampling.ignore_eos is True
    assert request.request_id == "a"


def test_grpc_backend_sends_class_priority_and_the_class_slo():
    slos = SLOTable(by_class={"interactive": SLO(1.2344, 0.0655), "offline": SLO(ttft_s=13.8)})
    backend = GrpcBackend("unused:1", SamplingConfig(), slos)
    interactive = backend.build_request(spec(class_name="interactive", priority=0))
    assert interactive.priority == generation_pb2.PRIORITY_INTERACTIVE
    assert (interactive.slo.ttft_ms, interactive.slo.tpot_ms) == (1234, 66)
    offline = backend.build_request(spec(class_name="offline", priority=2))
    assert offline.priority == generation_pb2.PRIORITY_OFFLINE
    assert offline.slo.ttft_ms == 13800 and not offline.slo.HasField("tpot_ms")
    # No class and no SLO: the gateway's defaults (interactive, its default SLO) apply.
    plain = GrpcBackend("unused:1", SamplingConfig()).build_request(spec())
    assert plain.priority == generation_pb2.PRIORITY_UNSPECIFIED
    assert not plain.HasField("slo")
    assert slo_message(SLO(0.0001, None)).ttft_ms == 1  # 0 would mean "no objective"


def test_grpc_errors_are_recorded_by_status_code_name():
    async def body(servicer, target):
        async with GrpcBackend(target, SamplingConfig()) as backend:
            return await backend.generate(spec("b-fail"), run_clock())

    record = asyncio.run(with_fake_server(body))
    assert not record.ok
    assert (record.error, record.error_message) == ("RESOURCE_EXHAUSTED", "queue full")
    assert record.chunks == [] and record.output_tokens == 0 and record.done_s is not None


def test_unreachable_server_is_unavailable():
    async def body():
        async with GrpcBackend("127.0.0.1:1", SamplingConfig(request_timeout_s=5)) as backend:
            return await backend.generate(spec(), run_clock())

    assert asyncio.run(body()).error == "UNAVAILABLE"


def bench_config(target, **kw) -> BenchConfig:
    workload = WorkloadConfig(input_len=LengthRange(4, 8), output_len=LengthRange(1, 4))
    return BenchConfig(target=target, workload=workload, **kw)


def test_runner_excludes_warmup_and_sweeps_rates_with_one_workload():
    async def body(servicer, target):
        cfg = bench_config(target, rates_rps=[200.0, 400.0], num_requests=6, warmup=2,
                           slo=SLO(ttft_s=5.0))
        return servicer, await run_bench(cfg)

    servicer, result = asyncio.run(with_fake_server(body))
    sent = [r.request_id for r in servicer.requests]
    assert sorted(sent[:2]) == ["warmup-0", "warmup-1"]  # sent together, before the rest
    assert sorted(sent[2:]) == sorted([f"run0-{i}" for i in range(6)] +
                                      [f"run1-{i}" for i in range(6)])
    assert [len(run.records) for run in result.runs] == [6, 6]
    assert all(run.summary.num_ok == 6 and run.summary.slo_attainment == 1.0
               for run in result.runs)
    by_rate = [[(r.prompt_len, r.expected_output_len) for r in run.records]
               for run in result.runs]
    assert by_rate[0] == by_rate[1]  # same seed: the same requests at every rate
    assert result.distserve_goodput_rps() == 400.0


def test_closed_loop_keeps_exactly_concurrency_in_flight():
    async def body(servicer, target):
        cfg = bench_config(target, concurrency=3, num_requests=9, warmup=0)
        return servicer, await run_bench(cfg)

    servicer, result = asyncio.run(with_fake_server(body))
    assert servicer.max_in_flight == 3
    assert len(result.runs[0].records) == 9
    assert result.distserve_goodput_rps() is None  # no rates, no DistServe goodput


class SleepBackend:
    """Answers every request with one token after `delay_s`; tracks concurrency."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.in_flight, self.max_in_flight = delay_s, 0, 0

    async def generate(self, spec: RequestSpec, now) -> RequestRecord:
        record = RequestRecord(spec.request_id, spec.class_name, spec.priority,
                               spec.prompt_len, spec.output_len, send_s=now())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        record.done_s, record.output_tokens = now(), 1
        return record


def specs(n: int):
    return iter([spec(f"s{i}") for i in range(n)])


def test_open_loop_follows_the_schedule_and_honours_the_cap():
    backend = SleepBackend(0.2)
    load = LoadConfig(rate_rps=50.0, burstiness=float("inf"), num_requests=5)
    records = asyncio.run(drive(backend, specs(100), load))
    assert [r.request_id for r in records] == ["s0", "s1", "s2", "s3", "s4"]
    for i, r in enumerate(records):  # constant gaps of 20 ms: none sent early, none far late
        # (late by 55 ms once in `make test` on a 2-core VM, right after the integration tests)
        assert 0.02 * i - 0.005 <= r.send_s < 0.02 * i + 0.1, [r.send_s for r in records]
    assert backend.max_in_flight == 5  # open loop: arrivals do not wait for answers

    capped = SleepBackend(0.1)
    load = LoadConfig(rate_rps=float("inf"), concurrency=2, num_requests=4)
    records = asyncio.run(drive(capped, specs(100), load))
    assert capped.max_in_flight == 2
    # Requests held back by the cap are timed from when they were due (time 0).
    assert [r.send_s for r in records] == [0.0] * 4
    assert records[-1].e2e_s >= 0.2


def test_duration_bounds_open_and_closed_loops():
    records = asyncio.run(drive(SleepBackend(0.01), specs(1000),
                                LoadConfig(rate_rps=100.0, burstiness=float("inf"),
                                           duration_s=0.095)))
    assert len(records) == 10  # due at 0, 10, ..., 90 ms
    records = asyncio.run(drive(SleepBackend(0.05), specs(1000),
                                LoadConfig(concurrency=2, duration_s=0.075)))
    assert len(records) == 4  # each user sends at 0 and 50 ms, and not at 100 ms
    with pytest.raises(ValueError):
        LoadConfig(rate_rps=float("inf"), duration_s=1.0)
    with pytest.raises(ValueError):
        LoadConfig(num_requests=3)


# ---------------------------------------------------------------- OpenAI ------------------


async def fake_completions(request: web.Request) -> web.StreamResponse:
    payload = await request.json()
    request.app[PAYLOADS].append(payload)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(FIRST_DELAY_S)
    n = payload["max_tokens"]
    events = [{"choices": [{"index": 0, "text": "", "token_ids": []}]}]  # a role-like prelude
    events += [{"choices": [{"index": 0, "text": "tok", "token_ids": [7] * k}]}
               for k in [TOKENS_PER_CHUNK] * (n // TOKENS_PER_CHUNK) + [n % TOKENS_PER_CHUNK]
               if k]
    events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
    for event in events:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await asyncio.sleep(TOKEN_DELAY_S)
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def fake_models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "smol"}]})


async def with_fake_openai(body):
    app = web.Application()
    app[PAYLOADS] = []
    app.router.add_post("/v1/completions", fake_completions)
    app.router.add_get("/v1/models", fake_models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return app[PAYLOADS], await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_openai_backend_matches_the_grpc_record_shape():
    async def body(base_url):
        async with OpenAIBackend(base_url, SamplingConfig()) as backend:
            return await backend.generate(spec(output_len=5), run_clock())

    payloads, record = asyncio.run(with_fake_openai(body))
    assert payloads == [{"model": "smol", "prompt": [101, 102, 103], "max_tokens": 5,
                         "temperature": 0.0, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True},
                         "return_token_ids": True}]
    assert record.ok and record.output_tokens == 5
    assert [c.num_tokens for c in record.chunks] == [2, 2, 1]  # the empty prelude is no token
    assert record.ttft_s >= FIRST_DELAY_S + TOKEN_DELAY_S


def test_openai_http_errors_are_recorded():
    async def body(base_url):
        async with OpenAIBackend(base_url + "/nowhere", SamplingConfig(),
                                 model_name="smol") as backend:
            return await backend.generate(spec(), run_clock())

    _, record = asyncio.run(with_fake_openai(body))
    assert record.error == "HTTP_404" and not record.ok


def test_sse_parsing():
    assert parse_sse_line(b"data: [DONE]\n") is None
    assert parse_sse_line(b": keep-alive\n") is None
    assert parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert chunk_tokens({"choices": [{"text": "hi"}]}) == (1, None)  # no token_ids: 1 token
    assert chunk_tokens({"choices": [{"text": "", "token_ids": [1, 2]}]}) == (2, None)
    assert chunk_tokens({"choices": [], "usage": {"completion_tokens": 9}}) == (0, 9)


def test_runner_reads_gateway_cpu_before_and_after_each_run():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    texts = iter(["process_cpu_seconds_total 10.0\n",
                  "process_cpu_seconds_total 10.3\n"
                  "pdserve_tokenizer_pool_cpu_seconds_total 1.0\n"])

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = next(texts).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=http.serve_forever, daemon=True).start()

    async def body(servicer, target):
        cfg = bench_config(target, rates_rps=[200.0], num_requests=4, warmup=0,
                           gateway_metrics=f"127.0.0.1:{http.server_address[1]}")
        return await run_bench(cfg)

    try:
        run = asyncio.run(with_fake_server(body)).runs[0]
    finally:
        http.shutdown()
    cpu = run.gateway_cpu
    assert cpu.output_tokens == run.summary.output_tokens > 0
    assert cpu.gateway_cpu_s == pytest.approx(0.3)
    # The pool counter appeared only after the run: not counted, and said so.
    assert cpu.pool_cpu_s is None and "pool is not counted" in cpu.note
    assert cpu.us_per_token == pytest.approx(0.3e6 / run.summary.output_tokens)
