"""Workers joining and leaving the shared stack at runtime: a decode worker started by hand
registers and serves, is drained with no failed request, and a SIGKILLed worker under
`pdserve up` leaves rotation, is restarted and serves again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest

from pdserve.launcher import free_port
from protos import generation_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import token_stream

JOIN_TIMEOUT_S = 300


def registry(stack) -> worker_pb2_grpc.RegistryStub:
    return worker_pb2_grpc.RegistryStub(grpc.insecure_channel(stack.address))


def workers(stack) -> list[worker_pb2.WorkerStatus]:
    return list(registry(stack).ListWorkers(worker_pb2.ListWorkersRequest(), timeout=5).workers)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(interval_s)


def generate(stack, prompt: list[int], max_tokens: int = 6) -> generation_pb2.GenerateResponse:
    request = generation_pb2.GenerateRequest(
        token_ids=prompt, sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    with stack.channel() as channel:
        return list(stack.stub(channel).Generate(request, timeout=300))[-1]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    stream = token_stream(tokenizer)
    # Longer than --local-prefill-max-tokens: each goes through both tiers.
    return lambda i: stream[12_000 + 29 * i: 12_000 + 29 * i + 300]


@pytest.fixture
def extra_decode(stack, model_path, tmp_path):
    """A decode worker started by hand, registering with the stack's gateway."""
    port = free_port()
    log = open(tmp_path / "decode-extra.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "decode", "--port", str(port), "--model", model_path,
         "--kv-cache-gib", "1", "--gateway", stack.address, "--worker-id", f"byhand{port}", "--drain-grace-s", "60"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    yield proc, f"byhand{port}", tmp_path / "decode-extra.log"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()


def test_a_decode_worker_started_by_hand_joins_serves_and_drains_without_a_failed_request(stack, extra_decode, prompts):
    proc, worker_id, log = extra_decode
    joined = wait_until(lambda: next((w for w in workers(stack) if w.worker_id == worker_id and w.state == "ready"), None),
                        JOIN_TIMEOUT_S, "the hand-started decode worker to register")
    assert (joined.role, joined.source) == ("decode", "registered")
    # Concurrent requests spread over both decode workers (fewest running first).
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: generate(stack, prompts(i)), range(4)))
    assert [r.usage.completion_tokens for r in results] == [6] * 4
    served = next(w for w in workers(stack) if w.worker_id == worker_id)
    assert served.HasField("load")  # it heartbeats its engine's load

    # Drain it while requests are in flight: none fails, and it leaves and exits by itself.
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(generate, stack, prompts(10 + i), 24) for i in range(6)]
        time.sleep(1.0)
        reply = registry(stack).Drain(worker_pb2.DrainRequest(worker_id=worker_id), timeout=5)
        assert reply.worker.state == "draining"
        outcomes = [f.result() for f in running]
    assert [r.usage.completion_tokens for r in outcomes] == [24] * 6
    assert proc.wait(timeout=120) == 0
    assert all(w.worker_id != worker_id for w in workers(stack))
    assert "deregistered from gateway" in log.read_text()


def test_an_unknown_worker_cannot_be_drained(stack):
    with pytest.raises(grpc.RpcError) as e:
        registry(stack).Drain(worker_pb2.DrainRequest(worker_id="nosuchworker"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "pdserve workers" in e.value.details()


def test_pdserve_workers_lists_both_tiers(stack):
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "workers", "--gateway", stack.address, "--json"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    listed = json.loads(out)["workers"]
    assert sorted(w["role"] for w in listed if w["state"] == "ready") == ["decode", "prefill"]
    assert all(w["source"] == "registered" and w["address"] for w in listed)


def test_a_killed_worker_leaves_rotation_is_restarted_and_serves_again(stack, prompts):
    before = next(w for w in workers(stack) if w.role == "decode" and w.state == "ready")
    port = int(before.address.rsplit(":", 1)[1])
    victim = next(p for p in psutil.Process(stack.proc.pid).children(recursive=True)
                  if p.cmdline()[3:4] == ["decode"] and str(port) in p.cmdline())
    mark = len(stack.log)
    since = lambda: "stack log since the kill:\n" + "".join(stack.log[mark:][-80:])  # noqa: E731
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    wait_until(lambda: all(w.state != "ready" for w in workers(stack) if w.role == "decode"), 15,
               "the killed decode worker to leave rotation")
    left_s = time.monotonic() - killed_at
    back = wait_until(lambda: next((w for w in workers(stack) if w.role == "decode" and w.state == "ready"), None),
                      JOIN_TIMEOUT_S, "the restarted decode worker")
    assert back.address == before.address and back.worker_id != before.worker_id, since()
    try:
        assert generate(stack, prompts(30)).usage.completion_tokens == 6
    except grpc.RpcError as e:
        pytest.fail(f"the restarted worker did not serve: {e.code().name}: {e.details()}\n{since()}")
    assert any("decode exited" in line and "restarting" in line for line in stack.log[mark:]), since()
    # Out of rotation at the first failed health check (polled every second), well within
    # the heartbeat timeout.
    assert left_s < 10.0, f"took {left_s:.1f} s to leave rotation\n{since()}"
