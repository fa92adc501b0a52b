"""What operators and tools see: health, reflection, metrics, the CLI, and no leaked KV."""

import subprocess
import sys
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def test_health_is_serving_for_the_service_and_overall(stack):
    with stack.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Generation"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service_and_its_request_fields(stack):
    with stack.channel() as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "pdserve.v1.Generation" in db.get_services()
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(db)
        request = pool.FindMessageTypeByName("pdserve.v1.GenerateRequest")
        assert {"prompt", "messages", "token_ids", "sampling", "request_id"} <= set(request.fields_by_name)


def test_generate_cli_answers_the_chat_question(stack):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--chat", "What is the capital of France?",
         "--address", stack.address],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert "Paris" in out.stdout


def test_workers_report_their_kv_layout(stack):
    from pdserve.engine import resolve_dtype

    prefill, decode = stack.worker_info("prefill"), stack.worker_info("decode")
    assert prefill.role == "prefill" and decode.role == "decode"
    assert prefill.layout == decode.layout
    # The model folder is bf16; engines compute in float32 where the CPU has no native bf16.
    dtype = "float32" if resolve_dtype() == "float32" else "bfloat16"
    assert (prefill.layout.num_layers, prefill.layout.block_size, prefill.layout.num_kv_heads,
            prefill.layout.entry_size, prefill.layout.dtype) == (30, 32, 3, 128, dtype)
    assert set(prefill.transports) == {"shm", "tcp", "nccl"} and prefill.host_id == decode.host_id


def test_no_kv_handoff_is_left_behind_once_requests_finish(stack):
    producer = stack.worker_info("prefill").worker_id
    deadline = time.monotonic() + 10
    while True:
        left = list(Path("/dev/shm").glob(f"pdserve-kv-{producer}-*"))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # a cancelled call's release is asynchronous
    assert left == []
    assert stack.metric(1, "vllm:num_requests_running") == 0
