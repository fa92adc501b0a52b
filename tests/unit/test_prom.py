import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from pdserve.prom import MetricAbsent, body_sum, sample_sum

BODY = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# TYPE pdserve_kv_transfer_tokens counter
pdserve_kv_transfer_tokens_total{direction="send",transport="shm"} 96.0
pdserve_kv_transfer_tokens_total{direction="send",transport="tcp"} 33.0
pdserve_kv_transfer_tokens_total{direction="recv",transport="shm"} 7.0
odd_total{note="a}b, \\"c\\""} 5.0
"""


def test_a_sum_covers_exactly_the_samples_with_every_wanted_label():
    assert body_sum(BODY, "pdserve_kv_transfer_tokens_total") == 136.0
    assert body_sum(BODY, "pdserve_kv_transfer_tokens_total", 'direction="send"') == 129.0
    assert body_sum(BODY, "pdserve_kv_transfer_tokens_total", 'transport="shm",direction="send"') == 96.0
    assert body_sum(BODY, "vllm:num_requests_running") == 2.0
    assert body_sum(BODY, "odd_total") == 5.0


def test_an_absent_metric_raises_instead_of_reading_zero():
    with pytest.raises(MetricAbsent, match=r"vllm:kv_cache_usage_perc.*vllm names there: vllm:num_requests_running"):
        body_sum(BODY, "vllm:kv_cache_usage_perc")
    with pytest.raises(MetricAbsent):  # the name exists, but no sample has these labels
        body_sum(BODY, "pdserve_kv_transfer_tokens_total", 'transport="nccl"')
    with pytest.raises(MetricAbsent):  # a prefix of a present name is not that name
        body_sum(BODY, "vllm:num_requests")
    with pytest.raises(MetricAbsent):  # a label must match whole, not as a substring
        body_sum(BODY, "pdserve_kv_transfer_tokens_total", 'transport="sh"')


def test_a_default_is_returned_only_when_asked_for():
    assert body_sum(BODY, "pdserve_kv_transfer_tokens_total", 'transport="nccl"', default=0.0) == 0.0
    assert body_sum(BODY, "pdserve_kv_transfer_tokens_total", 'transport="tcp"', default=0.0) == 33.0


def test_sample_sum_reads_a_live_page_and_raises_for_a_metric_it_lacks():
    registry = CollectorRegistry()
    Gauge("demo_usage_perc", "demo", registry=registry).set(0.25)
    sent = Counter("demo_sent", "demo", ["transport"], registry=registry)  # no child yet: no sample
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_port
    try:
        assert sample_sum(port, "demo_usage_perc") == 0.25
        with pytest.raises(MetricAbsent, match=f"127.0.0.1:{port}: no sample of demo_sent_total"):
            sample_sum(port, "demo_sent_total")
        assert sample_sum(port, "demo_sent_total", default=0.0) == 0.0
        sent.labels("shm").inc(3)
        assert sample_sum(port, "demo_sent_total", 'transport="shm"') == 3.0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
