"""A worker's /metrics: the engine processes' multiprocess files and vLLM's in-memory
metrics of the worker process, each family once."""

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily

from pdserve.worker import MetricsCollector


class Files:
    """Stands in for the multiprocess directory's collector."""

    def __init__(self, *families) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def samples(text: str, name: str) -> list[str]:
    return [line.split()[1] for line in text.splitlines() if line.startswith(name + " ")]


def exposition(files, in_process) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(files, in_process))
    return generate_latest(registry).decode()


def test_serves_engine_files_and_in_process_vllm_families():
    in_process = CollectorRegistry()
    Counter("vllm:generation_tokens", "tokens", registry=in_process).inc(7)
    # Our KV transfer metric exists (unused) in the worker's memory too: only the engine
    # processes' files count for it.
    Counter("pdserve_kv_handoffs", "handoffs", registry=in_process).inc(1)
    files = Files(CounterMetricFamily("pdserve_kv_handoffs", "handoffs", value=3))
    text = exposition(files, in_process)
    assert "vllm:generation_tokens_total 7.0" in text
    assert "pdserve_kv_handoffs_total 3.0" in text
    assert samples(text, "pdserve_kv_handoffs_total") == ["3.0"]


def test_a_family_the_files_hold_is_not_repeated_from_memory():
    in_process = CollectorRegistry()
    Counter("vllm:prompt_tokens", "tokens", registry=in_process).inc(2)
    files = Files(CounterMetricFamily("vllm:prompt_tokens", "tokens", value=5))
    text = exposition(files, in_process)
    assert "vllm:prompt_tokens_total 5.0" in text
    assert samples(text, "vllm:prompt_tokens_total") == ["5.0"]
