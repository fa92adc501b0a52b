"""Fakes shared by the unit tests of `pdserve bench compare` and its interleaved driver."""

import time

import pytest

from pdserve.bench.compare import CompareConfig, SearchPlan
from pdserve.bench.metrics import SLO
from pdserve.bench.runner import BenchConfig


@pytest.fixture
def fake_pdserve():
    """An in-process gRPC Generation fake that never slows down: (address, requests seen)."""
    from concurrent import futures

    import grpc

    from protos import generation_pb2, generation_pb2_grpc

    received = []

    class Fake(generation_pb2_grpc.GenerationServicer):
        def Generate(self, request, context):
            received.append(request)
            time.sleep(0.02)
            for i in range(request.sampling.max_tokens):
                time.sleep(0.002)
                yield generation_pb2.GenerateResponse(request_id=request.request_id,
                                                      token_ids=[1000 + i])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(Fake(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", received
    finally:
        server.stop(None)


def fake_compare_config(tmp_path, target: str, systems=("pdserve",)) -> CompareConfig:
    from pdserve.bench.workload import LengthRange, WorkloadConfig

    workload = WorkloadConfig(input_len=LengthRange(4, 8), output_len=LengthRange(3, 3))
    # Given SLOs far above the fake's latencies: timing jitter cannot make a rate miss.
    bench = BenchConfig(concurrency=1, num_requests=3, warmup=1, workload=workload,
                        slo=SLO(10.0, 1.0))
    return CompareConfig(bench=bench, model=tmp_path, systems=systems, pdserve_target=target,
                         plan=SearchPlan(max_up_steps=1, calibration_requests=2, budget_s=60),
                         log_dir=tmp_path / "logs", min_duration_s=0.0)
