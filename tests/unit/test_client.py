"""`pdserve generate` against a stack that is not ready, and the health probe, on an
in-process gRPC server whose health and Generate answers the test sets."""

from __future__ import annotations

import argparse
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import client, probe, rpc
from pdserve.launcher import free_port
from protos import generation_pb2, generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeGateway(generation_pb2_grpc.GenerationServicer):
    """UNAVAILABLE (as the gateway answers without a ready worker) until ``ready`` is set."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        if not self.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "no ready decode worker")
        self.requests.append(request)
        if request.slo.ttft_ms == 1:  # as the gateway refuses: a RetryInfo in the status details
            message = "predicted time to first token 0.20 s exceeds the request's objective of 0.001 s"
            context.set_trailing_metadata(rpc.retry_info_metadata(grpc.StatusCode.RESOURCE_EXHAUSTED, message, 2.5))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        yield generation_pb2.GenerateResponse(text="Paris", finish_reason="stop")


@pytest.fixture
def gateway():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    fake = FakeGateway()
    generation_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", NOT_SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def serve() -> None:
        health_servicer.set("", SERVING)
        fake.ready.set()

    yield f"127.0.0.1:{port}", serve, fake
    server.stop(None)


def generate_args(address: str, wait: float | None = None, **policy) -> argparse.Namespace:
    flags = {"priority": None, "slo_ttft_ms": None, "slo_tpot_ms": None} | policy
    return argparse.Namespace(prompt="Capital of France?", chat=False, address=address, max_tokens=4,
                              temperature=0.0, timeout_s=10.0, wait=wait, **flags)


def refused_address() -> str:
    return f"127.0.0.1:{free_port()}"  # bound and closed a moment ago: nothing listens


def test_probe_states(gateway):
    address, serve, _ = gateway
    assert probe.check(address) == probe.Health("NOT_SERVING")
    assert probe.main([address]) == 1
    serve()
    assert probe.check(address) == probe.Health("SERVING")
    assert probe.main([address]) == 0
    assert probe.check(address, service="pdserve.v1.Nothing").status == "SERVICE_UNKNOWN"


def test_probe_of_nothing_listening(capsys):
    address = refused_address()
    assert probe.check(address) == probe.Health(probe.UNREACHABLE, "connection refused")
    assert probe.main([address]) == 1
    assert capsys.readouterr().out == f"{address}: UNREACHABLE (connection refused)\n"


def test_generate_without_a_gateway_is_one_line_and_status_3(capsys):
    address = refused_address()
    assert client.generate(generate_args(address)) == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"pdserve generate: no gateway at {address} (connection refused); start the stack "
                   f"(`pdserve up`) or add --wait to wait for it\n")


def test_generate_before_the_workers_are_ready(capsys, gateway):
    address, _, _ = gateway
    assert client.generate(generate_args(address)) == 3
    assert capsys.readouterr().err == (
        f"pdserve generate: the stack at {address} is not ready yet (no ready decode worker); retry, or add --wait\n")


def test_generate_waits_for_serving(capsys, gateway):
    address, serve, _ = gateway
    timer = threading.Timer(0.5, serve)
    timer.start()
    try:
        assert client.generate(generate_args(address, wait=10.0)) == 0
    finally:
        timer.cancel()
    out, err = capsys.readouterr()
    assert out == "Paris\n"
    assert err.splitlines() == [f"pdserve generate: waiting for {address} to be SERVING: NOT_SERVING",
                                "[stop; 0 prompt + 0 completion tokens]"]


def test_generate_wait_gives_up(capsys, gateway):
    address, _, _ = gateway
    assert client.generate(generate_args(address, wait=0.3)) == 3
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pdserve generate: {address} was not SERVING after 0.3 s (NOT_SERVING); is the stack up? (`pdserve up`)")


def test_generate_sends_the_class_and_objectives_given(gateway):
    address, serve, fake = gateway
    serve()
    assert client.generate(generate_args(address)) == 0
    assert client.generate(generate_args(address, priority="offline", slo_ttft_ms=60000, slo_tpot_ms=0)) == 0
    default, offline = fake.requests
    assert default.priority == generation_pb2.PRIORITY_UNSPECIFIED  # the gateway's default class
    assert not default.slo.HasField("ttft_ms") and not default.slo.HasField("tpot_ms")
    assert offline.priority == generation_pb2.PRIORITY_OFFLINE
    assert offline.slo.HasField("ttft_ms") and offline.slo.ttft_ms == 60000
    assert offline.slo.HasField("tpot_ms") and offline.slo.tpot_ms == 0  # 0 sent: no objective


def test_generate_refused_prints_the_reason_and_the_retry_hint(capsys, gateway):
    address, serve, _ = gateway
    serve()
    assert client.generate(generate_args(address, slo_ttft_ms=1)) == 1
    assert capsys.readouterr().err == (
        "pdserve generate: RESOURCE_EXHAUSTED: predicted time to first token 0.20 s exceeds the "
        "request's objective of 0.001 s (the gateway suggests retrying in 2.5 s)\n")


def test_generate_refuses_a_negative_objective(capsys, gateway):
    address, serve, fake = gateway
    serve()
    assert client.generate(generate_args(address, slo_tpot_ms=-5)) == 1
    assert capsys.readouterr().err == "pdserve generate: --slo-tpot-ms must be >= 0 (0: no objective)\n"
    assert fake.requests == []
