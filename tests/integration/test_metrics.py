"""The workers' /metrics: vLLM's engine metrics next to ours, with values that move, on the
worker that does the work; and the idle-KV wait that the transport tests rely on fails while
a block is held.
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest

from protos import worker_pb2, worker_pb2_grpc
from tests.integration.test_transports import decode, fresh_prompt, metric, prefill, release, stack_ports, wait_idle

# What an inference gateway or a dashboard reads from each worker.
ENGINE_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
)
RUNNING = "vllm:num_requests_running"


def scrape_engine_metrics(port: int) -> dict[str, float]:
    return {name: metric(port, name) for name in ENGINE_METRICS}


def test_each_worker_exports_vllm_engine_metrics_that_move(stack, tokenizer):
    prompt = fresh_prompt(tokenizer, 10400)
    assert len(prompt) == 96
    prefill_port, decode_port = stack_ports(stack)
    before = {port: scrape_engine_metrics(port) for port in (prefill_port, decode_port)}

    first = prefill(stack.worker_addrs["prefill"], prompt, "shm")
    tokens, last = decode(stack.worker_addrs["decode"], prompt + [first.first_token_id], first.kv, 6)
    assert len(tokens) == 6 and last.num_external_tokens == len(prompt)
    wait_idle(prefill_port, decode_port)

    moved = {
        port: {name: value - before[port][name] for name, value in scrape_engine_metrics(port).items()}
        for port in (prefill_port, decode_port)
    }
    print(f"moved: prefill {moved[prefill_port]}, decode {moved[decode_port]}")
    assert moved[prefill_port]["vllm:prefix_cache_queries_total"] == len(prompt)
    assert moved[prefill_port]["vllm:generation_tokens_total"] == 1
    assert moved[decode_port]["vllm:generation_tokens_total"] == 6
    for port in (prefill_port, decode_port):
        assert moved[port]["vllm:e2e_request_latency_seconds_count"] == 1
        assert moved[port]["vllm:time_to_first_token_seconds_count"] == 1
        assert moved[port]["vllm:request_queue_time_seconds_count"] == 1
    assert moved[decode_port]["vllm:inter_token_latency_seconds_count"] == 5


def test_a_request_in_flight_shows_as_running_on_its_worker_only(stack, tokenizer):
    prompt = fresh_prompt(tokenizer, 10700)
    prefill_port, decode_port = stack_ports(stack)
    first = prefill(stack.worker_addrs["prefill"], prompt, "shm")
    assert metric(prefill_port, RUNNING) == 0
    # Long enough to be running at every read below; cancelled once they are done.
    long_sampling = worker_pb2.EngineSampling(max_tokens=2000, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)
    with grpc.insecure_channel(stack.worker_addrs["decode"]) as channel:
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id=uuid.uuid4().hex, token_ids=prompt + [first.first_token_id],
                                     sampling=long_sampling, kv=first.kv),
            timeout=120,
        )
        try:
            next(call)
            deadline = time.monotonic() + 10
            while metric(decode_port, RUNNING) != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert metric(decode_port, RUNNING) == 1
            # The prefill worker runs in the background (`pdserve up`'s shared cores: its
            # session at nice 10) while this stream keeps decode busy on every core: its
            # /metrics answers, but once took over 5 s in a full suite.
            assert metric(prefill_port, RUNNING, timeout_s=30.0) == 0
            assert metric(decode_port, "vllm:kv_cache_usage_perc") > 0
            # The stream holds its blocks: waiting for idle KV must fail, and quickly.
            started = time.monotonic()
            with pytest.raises(pytest.fail.Exception, match="did not return to idle"):
                wait_idle(decode_port, timeout_s=1.0)
            assert time.monotonic() - started < 5
            assert next(call).token_ids, "still streaming after the reads"
        finally:
            call.cancel()
    wait_idle(prefill_port, decode_port)
    assert metric(decode_port, RUNNING) == 0


def test_the_idle_kv_wait_fails_while_a_handoff_holds_blocks(stack, tokenizer):
    prompt = fresh_prompt(tokenizer, 11000)
    prefill_port, _ = stack_ports(stack)
    first = prefill(stack.worker_addrs["prefill"], prompt, "shm")  # published, not collected
    try:
        assert metric(prefill_port, "vllm:kv_cache_usage_perc") > 0
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match="did not return to idle"):
            wait_idle(prefill_port, timeout_s=1.0)
        assert time.monotonic() - started < 5
    finally:
        release(stack.worker_addrs["prefill"], first.kv)
    wait_idle(prefill_port)
