"""One shared stack for the integration tests: `pdserve up` started once per session.

The colocated reference engine runs first, alone, so that no more than two engines share
this machine's cores at any time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest

from pdserve import tempdirs
from pdserve.launcher import core_split, free_port, free_port_block
from pdserve.prom import sample_sum
from pdserve.model import resolve_model
from protos import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 420
REFERENCE_TIMEOUT_S = 420
IDENTITY_MAX_TOKENS = 24
# On and one past block boundaries (32 tokens a block), short, and one long prompt.
IDENTITY_PROMPT_LENS = (5, 31, 32, 33, 64, 65, 300, 1600)
KV_TRANSPORTS = ("shm", "tcp", "nccl")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def no_engine_segments_left():
    """The vLLM shared-memory segments (/dev/shm/psm_*, sem.mp-*) that engines these tests
    kill with SIGKILL leave behind are removed at the end, and named: a full run left seven
    on this machine (four buffers of 160-240 MB, three semaphores), none held by a process.
    Only names that appeared during the run and that no process holds are touched."""
    from pdserve import segments

    before = set(os.listdir(segments.SHM_DIR))
    yield
    removed = segments.sweep(set(os.listdir(segments.SHM_DIR)) - before)
    if removed:
        print(f"\nremoved {len(removed)} shared-memory segments killed engines left in "
              f"{segments.SHM_DIR}: {' '.join(removed)}")


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(resolve_model(None))


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def token_stream(tokenizer) -> list[int]:
    """A long deterministic text, tokenized: prompts are slices of it at distinct offsets,
    so no two share a prefix block (neither engine's prefix cache may blur the comparison)."""
    animals = ["fox", "owl", "lynx", "heron", "otter", "badger", "wren", "seal"]
    places = ["river", "forest", "harbour", "valley", "meadow", "glacier", "desert", "market"]
    text = " ".join(
        f"Entry {i}: the {animals[i % 8]} crossed the {places[(i * 3) % 8]} at dawn, counting {i * 7} steps."
        for i in range(700)
    )
    return tokenizer.encode(text)


@pytest.fixture(scope="session")
def identity_prompts(tokenizer) -> list[list[int]]:
    stream = token_stream(tokenizer)
    return [stream[1 + 13 * i: 1 + 13 * i + n] for i, n in enumerate(IDENTITY_PROMPT_LENS)]


@pytest.fixture(scope="session")
def transport_prompts(tokenizer) -> dict[str, list[int]]:
    """One prompt per KV transport, at offsets no other test uses (fresh in every cache)."""
    stream = token_stream(tokenizer)
    return {name: stream[2000 + 600 * i: 2000 + 600 * i + 333] for i, name in enumerate(KV_TRANSPORTS)}


@pytest.fixture(scope="session")
def reference_outputs(references, identity_prompts) -> list[list[int]]:
    return [references[tuple(p)] for p in identity_prompts]


@pytest.fixture(scope="session")
def references(model_path, identity_prompts, transport_prompts, tmp_path_factory) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of one colocated engine, by prompt: run once, before any stack starts."""
    tmp = tmp_path_factory.mktemp("reference")
    prompts, out = tmp / "prompts.json", tmp / "outputs.json"
    all_prompts = [*identity_prompts, *transport_prompts.values()]
    prompts.write_text(json.dumps(all_prompts))
    # The cores each worker engine has (`pdserve up --cores shared`): the same thread count
    # gives the same arithmetic.
    cores, _ = core_split("shared")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with tempdirs.engine_dir() as engine_dir:  # for the socket files vLLM leaves behind
        subprocess.run(
            [sys.executable, str(ROOT / "tests/integration/colocated.py"), model_path, str(prompts),
             str(IDENTITY_MAX_TOKENS), str(out)],
            env=env | tempdirs.engine_env(engine_dir), check=True, timeout=REFERENCE_TIMEOUT_S,
            stdout=subprocess.DEVNULL,
        )
    return {tuple(p): o for p, o in zip(all_prompts, json.loads(out.read_text()), strict=True)}


@dataclass
class StackHandle:
    address: str
    metrics_port: int
    proc: subprocess.Popen
    worker_addrs: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self, channel) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(channel)

    def worker_info(self, role: str) -> worker_pb2.WorkerInfo:
        stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        with grpc.insecure_channel(self.worker_addrs[role]) as ch:
            return stub_cls(ch).Info(worker_pb2.InfoRequest(), timeout=5)

    def metric(self, offset: int, name: str, labels: str = "", default: float | None = None) -> float:
        """A sample's value from a process's /metrics (gateway +0, prefill +1, decode +2);
        raises MetricAbsent when it has none, unless a ``default`` is given."""
        return sample_sum(self.metrics_port + offset, name, labels, default=default)


@pytest.fixture(scope="session")
def stack(model_path, references) -> StackHandle:
    metrics_port = free_port_block(3)  # gateway, prefill, decode
    port = free_port()
    while port in range(metrics_port, metrics_port + 3):
        port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--metrics-port", str(metrics_port),
         "--kv-cache-gib", "1", "--model", model_path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    handle = StackHandle(f"127.0.0.1:{port}", metrics_port, proc)
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            handle.log.append(line)
            found = re.match(r"\[(prefill|decode)\] READY (\S+)", line)
            if found:
                handle.worker_addrs[found.group(1)] = found.group(2)
            if line.startswith("pdserve ready"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.wait(1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail("pdserve up did not become ready:\n" + "".join(handle.log[-40:]))
    descendants = psutil.Process(proc.pid).children(recursive=True)
    yield handle
    _stop(proc)
    if os.environ.get("PDSERVE_STACK_LOG"):  # the whole stack's output, for a failure's story
        Path(os.environ["PDSERVE_STACK_LOG"]).write_text("".join(handle.log))
    # A process killed by `up` a moment ago may not have exited yet.
    _, alive = psutil.wait_procs(descendants, timeout=15)
    survivors = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in survivors:
        p.kill()
    assert not survivors, f"processes left after pdserve up stopped: {[p.pid for p in survivors]}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
