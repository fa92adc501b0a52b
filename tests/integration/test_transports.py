"""KV handoff through every CPU transport, on real engines: identity, refusals, abort, lease
expiry, a stalled producer and killed workers, with the KV usage of both engines back to idle
after each.

The stack's own workers serve the identity, refusal and abort tests. The failure tests need
workers they may stop or kill, so they get a spare pair (prefill pinned to core 0, decode to
core 1) with a short lease and a short KV timeout. The tests call the workers' gRPC services
directly, as the gateway does, choosing the transport per request.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest

from pdserve.launcher import free_port
from pdserve.prom import sample_sum
from protos import worker_pb2, worker_pb2_grpc
from tests.integration.conftest import IDENTITY_MAX_TOKENS, KV_TRANSPORTS, token_stream

SPARE_LEASE_S = 4.0
SPARE_KV_TIMEOUT_S = 3.0
READY_TIMEOUT_S = 300


def sampling(max_tokens: int) -> worker_pb2.EngineSampling:
    return worker_pb2.EngineSampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0)


def prefill(address: str, prompt: list[int], transport: str, max_tokens: int = IDENTITY_MAX_TOKENS):
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
            worker_pb2.PrefillRequest(
                request_id=uuid.uuid4().hex, token_ids=prompt, sampling=sampling(max_tokens), kv_transport=transport
            ),
            timeout=120,
        )


def decode(address: str, token_ids: list[int], kv, max_tokens: int) -> tuple[list[int], worker_pb2.DecodeResponse]:
    tokens, last = [], None
    with grpc.insecure_channel(address) as channel:
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id=uuid.uuid4().hex, token_ids=token_ids, sampling=sampling(max_tokens), kv=kv),
            timeout=120,
        )
        for last in call:
            tokens += last.token_ids
    return tokens, last


def release(address: str, kv) -> None:
    with grpc.insecure_channel(address) as channel:
        worker_pb2_grpc.PrefillWorkerStub(channel).Release(worker_pb2.ReleaseRequest(kv=kv), timeout=10)


def metric(metrics_port: int, name: str, labels: str = "", default: float | None = None,
           timeout_s: float = 5.0) -> float:
    return sample_sum(metrics_port, name, labels, default=default, timeout_s=timeout_s)


def wait_idle(*metrics_ports: int, timeout_s: float = 20.0) -> float:
    """Every engine's KV usage back to zero (its idle value: no request holds a block);
    returns how long that took."""
    started = time.monotonic()
    while True:
        usage = {port: metric(port, "vllm:kv_cache_usage_perc") for port in metrics_ports}
        if not any(usage.values()):
            waited = time.monotonic() - started
            print(f"KV usage idle after {waited:.2f} s on {list(metrics_ports)}")
            return waited
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"KV usage did not return to idle within {timeout_s:.0f} s: {usage}")
        time.sleep(0.25)


@dataclass
class Worker:
    role: str
    proc: subprocess.Popen
    metrics_port: int
    address: str = ""
    log: list[str] = field(default_factory=list)

    def pids(self) -> list[int]:
        try:
            return [self.proc.pid, *(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def signal_all(self, signum: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        procs = [psutil.Process(pid) for pid in self.pids() if psutil.pid_exists(pid)]
        self.signal_all(signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.terminate()
        _, alive = psutil.wait_procs(procs, timeout=30)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=10)


def start_worker(role: str, model_path: str, cpus: str) -> Worker:
    metrics_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", role, "--port", "0", "--cpus", cpus, "--kv-cache-gib", "1",
         "--metrics-port", str(metrics_port), "--kv-lease-s", str(SPARE_LEASE_S),
         "--kv-timeout-s", str(SPARE_KV_TIMEOUT_S), "--model", model_path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    worker = Worker(role, proc, metrics_port)

    def pump() -> None:
        for line in proc.stdout:
            worker.log.append(line)
            found = re.match(r"READY (\S+)", line)
            if found:
                worker.address = found.group(1)

    threading.Thread(target=pump, daemon=True).start()
    return worker


@pytest.fixture(scope="module")
def spare(stack, model_path):
    """A prefill and a decode worker of their own, to stall and kill."""
    workers = {role: start_worker(role, model_path, cpus) for role, cpus in (("prefill", "0"), ("decode", "1"))}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(w.address for w in workers.values()):
            for w in workers.values():
                if w.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"spare {w.role} worker did not start:\n" + "".join(w.log[-30:]))
            time.sleep(0.5)
        yield workers
    finally:
        for w in workers.values():
            w.stop()


def stack_ports(stack) -> tuple[int, int]:
    return stack.metrics_port + 1, stack.metrics_port + 2


def fresh_prompt(tokenizer, offset: int, length: int = 96) -> list[int]:
    return token_stream(tokenizer)[offset:offset + length]


# ------------------------------ the stack's workers ------------------------------


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_greedy_output_through_each_transport_is_identical_to_colocated(stack, transport, transport_prompts, references):
    prompt = transport_prompts[transport]
    prefill_port, decode_port = stack_ports(stack)
    # Baselines: a transport no request has used yet has no sample.
    sent = metric(prefill_port, "pdserve_kv_transfer_tokens_total", f'transport="{transport}",direction="send"', 0.0)
    received = metric(decode_port, "pdserve_kv_transfer_tokens_total", f'transport="{transport}",direction="recv"', 0.0)

    first = prefill(stack.worker_addrs["prefill"], prompt, transport)
    assert first.kv.transport == transport
    rest, last = decode(stack.worker_addrs["decode"], prompt + [first.first_token_id], first.kv, IDENTITY_MAX_TOKENS - 1)

    assert [first.first_token_id, *rest] == references[tuple(prompt)]
    assert last.num_external_tokens == len(prompt), "the decode engine received the whole prompt's KV"
    assert metric(prefill_port, "pdserve_kv_transfer_tokens_total", f'transport="{transport}",direction="send"') - sent == len(prompt)
    assert metric(decode_port, "pdserve_kv_transfer_tokens_total", f'transport="{transport}",direction="recv"') - received == len(prompt)
    wait_idle(prefill_port, decode_port)


def test_prefill_refuses_a_transport_it_does_not_serve(stack, tokenizer):
    with pytest.raises(grpc.RpcError) as e:
        prefill(stack.worker_addrs["prefill"], fresh_prompt(tokenizer, 5000, 40), "carrier_pigeon")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "carrier_pigeon" in e.value.details() and "shm" in e.value.details()


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_decode_refuses_a_handle_of_another_layout_before_any_transfer(stack, tokenizer, transport):
    prompt = fresh_prompt(tokenizer, 5100 + 100 * KV_TRANSPORTS.index(transport), 70)
    first = prefill(stack.worker_addrs["prefill"], prompt, transport)
    forged = worker_pb2.KvHandle()
    forged.CopyFrom(first.kv)
    forged.layout.block_size = 16
    with pytest.raises(grpc.RpcError) as e:
        decode(stack.worker_addrs["decode"], prompt + [first.first_token_id], forged, 4)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size: 32 here vs 16 there" in e.value.details()
    release(stack.worker_addrs["prefill"], first.kv)
    wait_idle(*stack_ports(stack))


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_an_aborted_handoff_frees_the_blocks_and_decode_recomputes(stack, tokenizer, transport):
    prompt = fresh_prompt(tokenizer, 5500 + 300 * KV_TRANSPORTS.index(transport))
    prefill_port, decode_port = stack_ports(stack)
    first = prefill(stack.worker_addrs["prefill"], prompt, transport)
    release(stack.worker_addrs["prefill"], first.kv)  # the gateway's abort path
    release(stack.worker_addrs["prefill"], first.kv)  # idempotent
    wait_idle(prefill_port)
    tokens, last = decode(stack.worker_addrs["decode"], prompt + [first.first_token_id], first.kv, 8)
    assert len(tokens) == 8 and last.finish_reason == "length"
    assert last.num_external_tokens == 0, "the released KV is gone: the decode engine computed the prompt"
    wait_idle(prefill_port, decode_port)


def test_a_decode_cancelled_mid_stream_frees_its_blocks(stack, tokenizer):
    prompt = fresh_prompt(tokenizer, 6500)
    first = prefill(stack.worker_addrs["prefill"], prompt, "shm")
    with grpc.insecure_channel(stack.worker_addrs["decode"]) as channel:
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id=uuid.uuid4().hex, token_ids=prompt + [first.first_token_id],
                                     sampling=sampling(400), kv=first.kv),
            timeout=120,
        )
        next(call)
        call.cancel()
    wait_idle(*stack_ports(stack))


# ------------------------------ a spare pair: leases, stalls, kills ------------------------------


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_an_uncollected_handoff_is_freed_when_its_lease_expires(spare, tokenizer, transport):
    prompt = fresh_prompt(tokenizer, 7000 + 250 * KV_TRANSPORTS.index(transport))
    producer, consumer = spare["prefill"], spare["decode"]
    first = prefill(producer.address, prompt, transport)
    assert metric(producer.metrics_port, "pdserve_kv_leases_outstanding", f'transport="{transport}"') == 1
    time.sleep(SPARE_LEASE_S + 2.5)
    assert metric(producer.metrics_port, "pdserve_kv_leases_outstanding", f'transport="{transport}"') == 0
    wait_idle(producer.metrics_port)
    started = time.monotonic()
    tokens, last = decode(consumer.address, prompt + [first.first_token_id], first.kv, 6)
    print(f"decode of an expired {transport} handle: {time.monotonic() - started:.2f} s")
    assert len(tokens) == 6 and last.num_external_tokens == 0
    failures = metric(consumer.metrics_port, "pdserve_kv_transfer_failures_total", f'transport="{transport}",reason="missing"')
    assert failures >= 1
    wait_idle(producer.metrics_port, consumer.metrics_port)


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_a_stalled_producer_times_out_and_decode_recomputes(spare, tokenizer, transport):
    prompt = fresh_prompt(tokenizer, 8000 + 250 * ("tcp", "nccl").index(transport))
    producer, consumer = spare["prefill"], spare["decode"]
    first = prefill(producer.address, prompt, transport)
    producer.signal_all(signal.SIGSTOP)
    try:
        started = time.monotonic()
        tokens, last = decode(consumer.address, prompt + [first.first_token_id], first.kv, 6)
        waited = time.monotonic() - started
    finally:
        producer.signal_all(signal.SIGCONT)
    assert len(tokens) == 6 and last.num_external_tokens == 0
    assert waited >= SPARE_KV_TIMEOUT_S * 0.9, "the load waited for the stalled producer until its timeout"
    assert metric(consumer.metrics_port, "pdserve_kv_transfer_failures_total", f'transport="{transport}",reason="timeout"') >= 1
    # The producer, resumed, ends the lease nobody collected.
    deadline = time.monotonic() + 2 * SPARE_LEASE_S + 5
    while metric(producer.metrics_port, "pdserve_kv_leases_outstanding", f'transport="{transport}"') and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(producer.metrics_port, "pdserve_kv_leases_outstanding", f'transport="{transport}"') == 0
    wait_idle(producer.metrics_port, consumer.metrics_port)


def test_a_killed_decode_worker_leaves_nothing_held_on_the_prefill_side(spare, stack, tokenizer):
    producer, consumer = spare["prefill"], spare["decode"]
    handles = {}
    for i, transport in enumerate(KV_TRANSPORTS):
        prompt = fresh_prompt(tokenizer, 8600 + 220 * i)
        handles[transport] = (prompt, prefill(producer.address, prompt, transport))
    # One load in flight when the decode worker dies.
    prompt, first = handles["shm"]
    call_done = threading.Event()

    def doomed() -> None:
        try:
            decode(consumer.address, prompt + [first.first_token_id], first.kv, 200)
        except grpc.RpcError:
            pass
        call_done.set()

    threading.Thread(target=doomed, daemon=True).start()
    time.sleep(0.2)
    consumer.signal_all(signal.SIGKILL)
    assert call_done.wait(30)
    # Every lease ends (collected, claimed by the dead consumer, or never fetched).
    deadline = time.monotonic() + 2 * SPARE_LEASE_S + 10
    while time.monotonic() < deadline:
        if not metric(producer.metrics_port, "pdserve_kv_leases_outstanding"):
            break
        time.sleep(0.5)
    assert metric(producer.metrics_port, "pdserve_kv_leases_outstanding") == 0
    wait_idle(producer.metrics_port)
    assert not list(Path("/dev/shm").glob(f"pdserve-kv-{first.kv.producer_id}-*"))


def test_a_killed_prefill_worker_fails_loads_cleanly_and_decode_recomputes(spare, stack, tokenizer, transport_prompts):
    producer = spare["prefill"]
    handles = {}
    for i, transport in enumerate(KV_TRANSPORTS):
        prompt = fresh_prompt(tokenizer, 9300 + 210 * i)
        handles[transport] = (prompt, prefill(producer.address, prompt, transport))
    producer_id = handles["shm"][1].kv.producer_id
    producer.signal_all(signal.SIGKILL)
    producer.proc.wait(30)
    prefill_port, decode_port = stack_ports(stack)
    for transport, (prompt, first) in handles.items():
        tokens, last = decode(stack.worker_addrs["decode"], prompt + [first.first_token_id], first.kv, 6)
        assert len(tokens) == 6
        if transport == "shm":
            # The dead producer's cache file still holds the finished prompt's blocks, unless
            # the surviving prefill worker already swept it (then: recomputed).
            assert last.num_external_tokens in (0, len(prompt))
        else:
            assert last.num_external_tokens == 0, f"{transport}: nothing to fetch from a dead producer"
    wait_idle(prefill_port, decode_port)
    # The surviving prefill worker on this host removes the dead one's shared KV cache.
    deadline = time.monotonic() + 30
    while list(Path("/dev/shm").glob(f"pdserve-kvcache-{producer_id}-*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not list(Path("/dev/shm").glob(f"pdserve-kvcache-{producer_id}-*"))
    assert not list(Path("/dev/shm").glob(f"pdserve-kv-{producer_id}-*"))
