"""Every metric the Grafana dashboard (deploy/grafana) reads is exported, with a sample, by
the process its Prometheus job scrapes, once requests have been served and refused."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest

from protos import generation_pb2
from tests import dashboard
from tests.integration.conftest import token_stream

# Offsets into the token stream no other test module uses: fresh in every prefix cache.
SERVED_AT, REFUSED_AT, PROMPT_LEN = 3600, 4300, 600
OFFSETS = {"gateway": 0, "prefill": 1, "decode": 2}  # from stack.metrics_port


def request(prompt: list[int], request_id: str, ttft_ms: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=prompt, priority=generation_pb2.PRIORITY_BATCH,
        slo=generation_pb2.Slo(ttft_ms=ttft_ms),
        sampling=generation_pb2.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))


def exported(port: int) -> set[str]:
    """The names of the series with at least one sample on 127.0.0.1:port/metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return set(re.findall(r"^([a-zA-Z_:][\w:]*)[{ ]", body, re.M))


@pytest.fixture(scope="module")
def served(stack, tokenizer) -> None:
    """One request through both tiers (a prompt too long for the decode worker to prefill
    itself, so its KV moves), then one refused: its 1 ms TTFT objective cannot be met
    once the prefill rate is measured."""
    stream = token_stream(tokenizer)
    with stack.channel() as channel:
        replies = list(stack.stub(channel).Generate(
            request(stream[SERVED_AT:SERVED_AT + PROMPT_LEN], "dashboard-served", ttft_ms=600_000), timeout=300))
        assert replies[-1].usage.completion_tokens == 6
        with pytest.raises(grpc.RpcError) as refused:
            list(stack.stub(channel).Generate(
                request(stream[REFUSED_AT:REFUSED_AT + PROMPT_LEN], "dashboard-refused", ttft_ms=1), timeout=60))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_every_dashboard_metric_is_exported_where_its_job_scrapes(stack, served):
    names = {process: exported(stack.metrics_port + offset) for process, offset in OFFSETS.items()}
    missing = sorted(
        f"{sel.metric} (panels {', '.join(sorted(set(titles)))}; looked in {', '.join(sorted(sel.processes))})"
        for sel, titles in dashboard.all_selectors(dashboard.load()).items()
        if not any(sel.metric in names[p] for p in sel.processes))
    assert not missing, "not exported:\n" + "\n".join(missing)
