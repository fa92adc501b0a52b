"""The tokenizer pool's CPU accounting and its export on /metrics."""

import asyncio
import subprocess
import sys
import time

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from gateway.metrics import register_tokenizer_pool_cpu
from gateway.tokenizer_pool import ProcessCpu, TokenizerPool
from pdserve.model import default_model_path

BURN = """
import time
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print("done", flush=True)
time.sleep(60)
"""


def test_cpu_of_a_process_is_kept_after_it_exits():
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "done\n"
        cpu = ProcessCpu()
        burnt = cpu.read([child.pid])
        assert 0.3 <= burnt < 5.0
    finally:
        child.kill()
        child.wait()
    assert cpu.read([child.pid]) == burnt  # gone: its last reading stays in the sum
    assert cpu.read([]) == burnt


def test_pool_cpu_counts_its_processes_and_survives_close():
    model = default_model_path()
    if not (model / "tokenizer.json").exists():
        pytest.skip("default model not prepared (make test prepares it)")
    pool = TokenizerPool(str(model), num_workers=1)
    try:
        assert pool.cpu_seconds() == 0.0  # no process before the first task
        asyncio.run(pool.start())
        loaded = pool.cpu_seconds()
        assert loaded > 0.2  # the process imported transformers and loaded the tokenizer
    finally:
        pool.close()
    assert pool.cpu_seconds() >= loaded


def test_pool_cpu_is_exported_as_a_counter():
    registry = CollectorRegistry()
    readings = iter([2.5, 3.25])
    collector = register_tokenizer_pool_cpu(lambda: next(readings), registry)
    assert "pdserve_tokenizer_pool_cpu_seconds_total 2.5\n" in generate_latest(registry).decode()
    assert "pdserve_tokenizer_pool_cpu_seconds_total 3.25\n" in generate_latest(registry).decode()
    registry.unregister(collector)
    assert "pdserve_tokenizer_pool" not in generate_latest(registry).decode()


def test_the_gateway_process_cpu_is_exported_by_default():
    before = REGISTRY.get_sample_value("process_cpu_seconds_total")
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    # /proc counts CPU in clock ticks (10 ms): allow two ticks of rounding.
    assert REGISTRY.get_sample_value("process_cpu_seconds_total") >= before + 0.28
