"""The gateway's serving policy on real engines: class order, admission, queue expiry and
placement, each shown by what the workers received."""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protos import generation_pb2
from tests.integration.conftest import token_stream

OFFLINE, INTERACTIVE = generation_pb2.PRIORITY_OFFLINE, generation_pb2.PRIORITY_INTERACTIVE


def request(prompt: list[int], request_id: str, priority=INTERACTIVE, max_tokens: int = 2,
            **slo) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=prompt, priority=priority,
        slo=generation_pb2.Slo(**slo),
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def call(stack, req: generation_pb2.GenerateRequest, timeout_s: float = 300):
    with stack.channel() as channel:
        return list(stack.stub(channel).Generate(req, timeout=timeout_s))


def call_routed(stack, req: generation_pb2.GenerateRequest, timeout_s: float = 300):
    """The replies and where the gateway says the call ran (its pdserve-* trailers)."""
    with stack.channel() as channel:
        responses = stack.stub(channel).Generate(req, timeout=timeout_s)
        replies = list(responses)
        return replies, {k: v for k, v in responses.trailing_metadata() if k.startswith("pdserve-")}


def prefill_order(stack, request_ids: set[str]) -> list[str]:
    """The order the prefill worker received these requests in, from its log."""
    order = []
    for line in list(stack.log):
        found = re.search(r"\[prefill\].*prefill (\S+): \d+ prompt tokens", line)
        if found and found.group(1) in request_ids:
            order.append(found.group(1))
    return order


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Fresh prompts (offsets no other test module uses), distinct from their first block."""
    stream = token_stream(tokenizer)
    return lambda i, n: stream[10_000 + 41 * i: 10_000 + 41 * i + n]


def queue_length(stack, priority: str) -> float:
    return stack.metric(0, "pdserve_queue_length", f'priority="{priority}"', default=0.0)


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_interactive_request_is_dispatched_ahead_of_queued_offline_prompts(stack, prompts):
    offline = [request(prompts(i, 1000), f"order-offline-{i}", OFFLINE) for i in range(3)]
    # Longer than --local-prefill-max-tokens, so it too must go through the prefill tier;
    # no TTFT objective, so admission cannot turn it away.
    interactive = request(prompts(3, 400), "order-interactive", INTERACTIVE, ttft_ms=0)
    with ThreadPoolExecutor(4) as pool:
        done = [pool.submit(call, stack, offline[0])]
        wait_for(lambda: prefill_order(stack, {"order-offline-0"}))  # the engine runs it
        for queued, r in enumerate(offline[1:], start=1):  # one at a time: arrival order is known
            done.append(pool.submit(call, stack, r))
            # Queued in the gateway: the worker's budget holds one such prompt at a time.
            wait_for(lambda n=queued: queue_length(stack, "offline") == n)
        done.append(pool.submit(call, stack, interactive))
        for f in done:
            assert f.result()[-1].finish_reason == "length"
    ids = {r.request_id for r in [*offline, interactive]}
    assert prefill_order(stack, ids) == ["order-offline-0", "order-interactive", "order-offline-1",
                                         "order-offline-2"]


def test_a_burst_beyond_capacity_with_a_tight_ttft_objective_is_refused_at_once(stack, prompts):
    call(stack, request(prompts(10, 600), "burst-warm", ttft_ms=0))  # the prefill rate is measured
    # Refused at admission (ttft_slo), or admitted and refused from the queue once the
    # queue ahead of it grew (ttft_slo_queued): both are TTFT refusals.
    reasons = ('reason="ttft_slo"', 'reason="ttft_slo_queued"')
    refused_before = sum(stack.metric(0, "pdserve_refusals_total", r, default=0.0) for r in reasons)
    # 12,000 prompt tokens against a 2 s objective: this machine prefills 1,000-2,000 tokens/s
    # on both tiers together (600-token prompts at 3 s let 7 of 12 through once, a thin margin).
    burst = [request(prompts(11 + i, 1000), f"burst-{i}", ttft_ms=2000) for i in range(12)]
    started = time.monotonic()
    with ThreadPoolExecutor(len(burst)) as pool:
        outcomes = list(pool.map(lambda r: _outcome(stack, r), burst))
    codes = [code for code, _, _ in outcomes]
    refusals = [(elapsed, retry) for code, elapsed, retry in outcomes if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert len(refusals) >= 6, codes  # at most half of them can prefill within 2 s here
    assert all(elapsed < 2.0 for elapsed, _ in refusals), refusals  # at once, not timed out
    assert all(retry is not None and retry > 0 for _, retry in refusals), refusals
    refused = sum(stack.metric(0, "pdserve_refusals_total", r, default=0.0) for r in reasons)
    assert refused > 0 and refused - refused_before == len(refusals)
    assert time.monotonic() - started < 120


def _outcome(stack, req) -> tuple[grpc.StatusCode, float, float | None]:
    """(status code, seconds until the call ended, RetryInfo delay if any)."""
    started = time.monotonic()
    with stack.channel() as channel:
        call_ = stack.stub(channel).Generate(req, timeout=300)
        try:
            list(call_)
            return grpc.StatusCode.OK, time.monotonic() - started, None
        except grpc.RpcError as e:
            status = rpc_status.from_call(e)
            retry = None
            for detail in status.details if status else []:
                info = error_details_pb2.RetryInfo()
                if detail.Unpack(info):
                    retry = info.retry_delay.ToNanoseconds() / 1e9
            return e.code(), time.monotonic() - started, retry


def test_a_request_whose_deadline_passes_in_the_queue_never_reaches_a_worker(stack, prompts):
    expired_before = stack.metric(0, "pdserve_queue_expired_total", 'priority="offline"', default=0.0)
    busy = [request(prompts(30 + i, 1400), f"deadline-busy-{i}", OFFLINE) for i in range(2)]
    late = request(prompts(32, 600), "deadline-late", OFFLINE)
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(call, stack, r) for r in busy]
        wait_for(lambda: prefill_order(stack, {"deadline-busy-0", "deadline-busy-1"}))
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            call(stack, late, timeout_s=1.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
        for f in running:
            f.result()
    wait_for(lambda: stack.metric(0, "pdserve_queue_expired_total", 'priority="offline"', default=0.0) > expired_before, 10)
    assert stack.metric(0, "pdserve_queue_expired_total", 'priority="offline"') - expired_before == 1
    assert prefill_order(stack, {"deadline-late"}) == []
    assert not any("deadline-late" in line for line in stack.log if line.startswith("[decode]"))


def test_a_short_prompt_is_placed_on_the_decode_worker_and_a_long_one_on_the_prefill_tier(stack, prompts):
    local_before = stack.metric(0, "pdserve_placements_total", 'where="local"', default=0.0)
    remote_before = stack.metric(0, "pdserve_placements_total", 'where="remote"', default=0.0)
    handoff_before = stack.metric(0, "pdserve_kv_handoff_tokens_total", default=0.0)
    short, short_route = call_routed(stack, request(prompts(40, 40), "place-short", max_tokens=4))
    long, long_route = call_routed(stack, request(prompts(41, 900), "place-long", max_tokens=4))
    assert [r.usage.completion_tokens for r in (short[-1], long[-1])] == [4, 4]
    # The caller is told where each ran: one decode worker, the long one via the prefill tier.
    assert short_route.keys() == {"pdserve-prefill", "pdserve-decode-worker"}
    assert short_route["pdserve-prefill"] == "local"
    assert long_route["pdserve-prefill"] == "remote"
    assert long_route["pdserve-decode-worker"] == short_route["pdserve-decode-worker"]
    assert long_route["pdserve-prefill-worker"] != long_route["pdserve-decode-worker"]
    assert stack.metric(0, "pdserve_placements_total", 'where="local"') - local_before == 1
    assert stack.metric(0, "pdserve_placements_total", 'where="remote"') - remote_before == 1
    assert prefill_order(stack, {"place-short", "place-long"}) == ["place-long"]
    # Only the long prompt's KV came through the handoff.
    assert stack.metric(0, "pdserve_kv_handoff_tokens_total") - handoff_before == 900


def test_a_short_prompt_stalled_on_the_prefill_tier_is_moved_to_the_decode_worker(stack, prompts):
    """With the prefill engine stopped (SIGSTOP: as when a busy decode engine keeps an
    idle-priority prefill engine off the cores), a short prompt sent there is cancelled
    after twice its predicted time and prefilled on the decode worker, which is busy."""
    moved_before = stack.metric(0, "pdserve_prefills_moved_total", default=0.0)
    long_prompt = prompts(50, 900)
    call(stack, request(long_prompt, "stall-long"))  # the tier's rate, and its prefix cache
    # All 8 of its blocks are in the prefill worker's cache: 1 token of work there, sooner
    # than a local prefill of 256 on a busy decode worker, so it goes to the tier.
    short = request(long_prompt[:256], "stall-short", max_tokens=4)
    busy = request(prompts(52, 40), "stall-busy", max_tokens=300)
    engine = psutil.Process(_prefill_worker_pid(stack)).children(recursive=True)
    assert engine, "the prefill worker has no engine processes"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(call, stack, busy)
        wait_for(lambda: stack.metric(2, "vllm:num_requests_running", default=0.0) >= 1 or running.done(), 30)
        assert not running.done()  # decoding
        for p in engine:
            p.suspend()
        try:
            started = time.monotonic()
            replies, route = call_routed(stack, short, timeout_s=60)
            elapsed = time.monotonic() - started
        finally:
            for p in engine:
                p.resume()
        assert running.result()[-1].usage.completion_tokens == 300
    assert replies[-1].usage.completion_tokens == 4
    assert route["pdserve-prefill"] == "moved"
    assert elapsed < 30, elapsed
    # Sent there first: the gateway's own log line below says so. The prefill worker's
    # "prefill stall-short" line is not required: the worker may not reach the call within
    # the 0.25 s the gateway waits (seen once in a full run, the line never came, when a
    # thread of its front end still ran at idle priority beside the busy decode engine).
    assert stack.metric(0, "pdserve_prefills_moved_total") - moved_before == 1
    assert any("request stall-short: prefill worker" in line and "did not answer" in line for line in stack.log)


def test_a_long_prompt_the_prefill_tier_cannot_start_in_time_is_prefilled_on_the_decode_worker(stack, prompts):
    """The prefill worker holds a 1,000-token prompt (its engine stopped, as when a busy decode
    engine keeps it off the cores): a 600-token prompt with a 5 s TTFT objective does not fit
    the tier's budget (1,024 tokens), so it would wait there past its objective; the decode
    worker, idle, prefills it itself instead (a rescue), and the prefill worker never sees it."""
    rescued_before = stack.metric(0, "pdserve_prefills_rescued_total", default=0.0)
    call(stack, request(prompts(60, 600), "rescue-warm"))  # the tier's rate with decode idle
    busy = request(prompts(61, 1000), "rescue-busy", OFFLINE)
    engine = psutil.Process(_prefill_worker_pid(stack)).children(recursive=True)
    assert engine, "the prefill worker has no engine processes"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(call, stack, busy)
        wait_for(lambda: prefill_order(stack, {"rescue-busy"}) or running.done(), 30)
        for p in engine:
            p.suspend()
        try:
            assert not running.done()
            replies, route = call_routed(stack, request(prompts(62, 600), "rescue-long", max_tokens=4,
                                                        ttft_ms=5000), timeout_s=60)
        finally:
            for p in engine:
                p.resume()
        assert running.result()[-1].usage.completion_tokens == 2
    assert replies[-1].usage.completion_tokens == 4
    assert route["pdserve-prefill"] == "local"
    assert prefill_order(stack, {"rescue-long"}) == []
    assert stack.metric(0, "pdserve_prefills_rescued_total") - rescued_before == 1


def test_a_long_prompt_stalled_on_the_prefill_tier_is_moved_to_the_decode_worker_in_time(stack, prompts):
    """With the prefill engine stopped, a 600-token prompt with an 8 s TTFT objective, sent to
    the tier (empty, and fast when last measured), is taken back after twice its predicted
    time and prefilled on the decode worker while that still meets its objective."""
    moved_before = stack.metric(0, "pdserve_prefills_moved_total", default=0.0)
    rescued_before = stack.metric(0, "pdserve_prefills_rescued_total", default=0.0)
    call(stack, request(prompts(63, 600), "stall-long-warm"))  # the tier's rate with decode idle
    engine = psutil.Process(_prefill_worker_pid(stack)).children(recursive=True)
    assert engine, "the prefill worker has no engine processes"
    for p in engine:
        p.suspend()
    try:
        replies, route = call_routed(stack, request(prompts(64, 600), "stall-long", max_tokens=4, ttft_ms=8000),
                                     timeout_s=60)
    finally:
        for p in engine:
            p.resume()
    assert replies[-1].usage.completion_tokens == 4
    assert route["pdserve-prefill"] == "moved"
    assert stack.metric(0, "pdserve_prefills_moved_total") - moved_before == 1
    assert stack.metric(0, "pdserve_prefills_rescued_total") - rescued_before == 1


def test_a_newer_long_prompt_does_not_take_the_decode_worker_ahead_of_an_older_one_on_the_tier(stack, prompts):
    """With the prefill engine stopped, a 600-token prompt sent to the tier, then a second
    one that finds the tier full (1,024 tokens of room) and would be rescued on the idle
    decode worker: the older one is offered the decode worker first and moves there before
    its stall time; the newer one takes the tier (and moves once it stalls there)."""
    call(stack, request(prompts(70, 600), "offer-warm"))  # the tier's rate with decode idle
    engine = psutil.Process(_prefill_worker_pid(stack)).children(recursive=True)
    assert engine, "the prefill worker has no engine processes"
    mark = len(stack.log)
    for p in engine:
        p.suspend()
    try:
        with ThreadPoolExecutor(2) as pool:
            old = pool.submit(call_routed, stack, request(prompts(71, 600), "offer-old", max_tokens=4, ttft_ms=8000),
                              60)
            wait_for(lambda: any("prefill offer-old:" in line for line in list(stack.log)[mark:]), 10)
            new = pool.submit(call_routed, stack, request(prompts(72, 600), "offer-new", max_tokens=4, ttft_ms=8000),
                              60)
            (old_replies, old_route), (new_replies, _) = old.result(), new.result()
    finally:
        for p in engine:
            p.resume()
    since = "".join(stack.log[mark:][-40:])
    assert old_route["pdserve-prefill"] == "moved", since
    moves = [re.search(r"did not answer in ([\d.]+) s \(predicted ([\d.]+) s, offered ahead", line)
             for line in stack.log[mark:] if "request offer-old:" in line]
    assert [m is not None for m in moves] == [True], since
    waited_s, predicted_s = float(moves[0].group(1)), float(moves[0].group(2))
    assert waited_s < 2 * predicted_s, since  # at the newer prompt's arrival, not at its stall time
    assert old_replies[-1].usage.completion_tokens == 4 and new_replies[-1].usage.completion_tokens == 4


def test_with_the_prefill_worker_down_a_long_prompt_is_prefilled_on_the_decode_worker(stack, prompts):
    """The prefill worker stopped (SIGSTOP, its engine too) leaves rotation; the gateway keeps
    serving, the decode worker prefilling every prompt, a long one too, and long prompts go
    to the tier again once the worker is back."""
    worker = psutil.Process(_prefill_worker_pid(stack))
    stopped = [worker, *worker.children(recursive=True)]
    prefill_ready = lambda: stack.metric(0, "pdserve_workers_ready", 'role="prefill"')  # noqa: E731
    mark = len(stack.log)
    for p in stopped:
        p.suspend()
    try:
        wait_for(lambda: prefill_ready() == 0, 30)
        replies, route = call_routed(stack, request(prompts(70, 600), "tierless", max_tokens=4), timeout_s=60)
    finally:
        for p in stopped:
            p.resume()
    wait_for(lambda: prefill_ready() == 1, 30)
    assert replies[-1].usage.completion_tokens == 4
    assert route["pdserve-prefill"] == "local"
    # Losing the tier to a failure is a warning (no tier at the stack's start, or after a drain, is INFO).
    assert any(re.search(r" WARNING gateway[.\w]*: no prefill worker in rotation:", line) for line in stack.log[mark:])
    replies, route = call_routed(stack, request(prompts(72, 600), "tier-again", max_tokens=4))
    assert replies[-1].usage.completion_tokens == 4
    assert route["pdserve-prefill"] == "remote"


def test_only_the_prefill_engine_runs_at_idle_priority_not_the_worker_that_answers_the_gateway(stack):
    """The engine's processes yield the cores to decode; every thread of the worker process
    itself (gRPC server, health, the engine client's threads) stays normal class, so that a
    starved thread holding the GIL cannot stall its answers to the gateway's health checks."""
    worker = psutil.Process(_prefill_worker_pid(stack))
    engine = worker.children(recursive=True)
    by_class = {p.pid: sorted({os.sched_getscheduler(t.id) for t in p.threads()}) for p in (worker, *engine)}
    assert len(by_class) >= 3, by_class  # the worker, its engine core and the engine's worker
    assert by_class.pop(worker.pid) == [os.SCHED_OTHER]
    assert all(classes == [os.SCHED_IDLE] for classes in by_class.values()), by_class


def _prefill_worker_pid(stack) -> int:
    for p in psutil.Process(stack.proc.pid).children(recursive=True):
        if "prefill" in p.cmdline() and "pdserve.cli" in p.cmdline():
            return p.pid
    raise AssertionError("no prefill worker process under pdserve up")
