"""Gateway CPU per generated token from fixed /metrics texts."""

import pytest

from pdserve.bench.gateway_cpu import (
    GatewayMetricsError,
    cpu_sample,
    gateway_cpu,
    scrape,
)
from pdserve.prom import samples_sum

BEFORE = """# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
# TYPE pdserve_tokenizer_pool_cpu_seconds_total counter
pdserve_tokenizer_pool_cpu_seconds_total{worker="0"} 3.0
pdserve_tokenizer_pool_cpu_seconds_total{worker="1"} 1.0
"""
AFTER = """process_cpu_seconds_total 14.0
pdserve_tokenizer_pool_cpu_seconds_total{worker="0"} 3.25
pdserve_tokenizer_pool_cpu_seconds_total{worker="1"} 1.25
"""


def test_gateway_and_pool_cpu_per_output_token():
    cpu = gateway_cpu(cpu_sample(BEFORE), cpu_sample(AFTER), output_tokens=8000)
    assert cpu.gateway_cpu_s == pytest.approx(1.5)
    assert cpu.pool_cpu_s == pytest.approx(0.5)
    assert cpu.us_per_token == pytest.approx(1e6 * 2.0 / 8000)  # 250 us
    assert cpu.note == "gateway process + tokenizer pool"


def test_a_missing_pool_counter_reports_the_gateway_alone_and_says_so():
    no_pool = "process_cpu_seconds_total 14.0\n"
    cpu = gateway_cpu(cpu_sample(BEFORE), cpu_sample(no_pool), output_tokens=1000)
    assert cpu.pool_cpu_s is None
    assert cpu.us_per_token == pytest.approx(1500.0)
    assert "pdserve_tokenizer_pool_cpu_seconds_total is missing" in cpu.note


def test_a_missing_process_counter_fails_rather_than_reading_zero():
    with pytest.raises(GatewayMetricsError, match="has no process_cpu_seconds_total"):
        cpu_sample("pdserve_tokenizer_pool_cpu_seconds_total 3.0\n")
    # A metric whose name only starts the same is not it.
    with pytest.raises(GatewayMetricsError):
        cpu_sample("process_cpu_seconds_total_other 3.0\n")


def test_no_output_tokens_gives_no_per_token_figure():
    assert gateway_cpu(cpu_sample(BEFORE), cpu_sample(AFTER), 0).us_per_token is None


def test_samples_sum_distinguishes_absent_from_zero():
    assert samples_sum(BEFORE, "pdserve_tokenizer_pool_cpu_seconds_total") == 4.0
    assert samples_sum(BEFORE, "pdserve_tokenizer_pool_cpu_seconds_total", 'worker="1"') == 1.0
    assert samples_sum("x_total 0\n", "x_total") == 0.0
    assert samples_sum(BEFORE, "x_total") is None


def test_scrape_errors_are_actionable():
    with pytest.raises(GatewayMetricsError, match="want HOST:PORT"):
        scrape("localhost")
    with pytest.raises(GatewayMetricsError, match="cannot read http://127.0.0.1:1/metrics"):
        scrape("127.0.0.1:1")
