"""A worker, or `pdserve up`, stopped at any point of its start-up leaves no temporary file
and no /dev/shm file behind; `pdserve up` stopped while it serves finishes the requests in
flight first.

Each worker case starts a prefill worker (the tier that places its KV cache in /dev/shm)
with its own TMPDIR, waits for one stage of start-up to be visible, and stops it as `pdserve
up` stops a child: SIGTERM to it, SIGKILL to its process group after the launcher's grace
period. The stack cases press Ctrl-C (SIGINT) on `pdserve up` while its engines start, and
while it streams an answer.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from pdserve import prom
from pdserve.launcher import STOP_GRACE_S, free_port, free_port_block
from pdserve.tempdirs import METRICS_DIR_PREFIX
from protos import generation_pb2, generation_pb2_grpc

STAGE_TIMEOUT_S = 300


@pytest.fixture
def short_tmp():
    """A TMPDIR short enough for the engine's socket paths (pytest's tmp_path is not: the
    engine's directory would go to /tmp instead, out of the test's sight)."""
    path = Path(tempfile.mkdtemp(prefix="pdt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _left_in(tmp: Path) -> list[str]:
    """What is in ``tmp`` but torch's compile cache (made by importing vLLM, before a worker
    has its own directories; a cache, kept on purpose)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def _shm_files(worker_id: str) -> list[Path]:
    return [p for p in Path("/dev/shm").glob("pdserve-*") if worker_id in p.name]


# stage -> (log lines, worker id, TMPDIR) -> whether start-up has reached it
STAGES = {
    # The worker made its metrics directory; the engine is not started yet.
    "metrics-dir": lambda log, wid, tmp: any(tmp.glob(f"{METRICS_DIR_PREFIX}{wid}-*")),
    # The engine-core process has allocated its KV cache in /dev/shm; start-up goes on.
    "kv-cache": lambda log, wid, tmp: bool(_shm_files(wid)),
    "serving": lambda log, wid, tmp: any(line.startswith("READY ") for line in log),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_worker_stopped_during_start_up_leaves_no_temp_files(model_path, short_tmp, stage):
    tmp_path = short_tmp
    worker_id = "stop" + uuid.uuid4().hex[:8]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "prefill", "--port", "0", "--cpus", "0", "--kv-cache-gib", "1",
         "--kv-transport", "shm", "--worker-id", worker_id, "--model", model_path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)},
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    group = [psutil.Process(proc.pid)]
    try:
        reached = STAGES[stage]
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while not reached(log, worker_id, tmp_path):
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"start-up never reached {stage}:\n" + "".join(log[-30:])
            )
            time.sleep(0.05)
        group += group[0].children(recursive=True)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # as the launcher does once its child exited
            os.killpg(proc.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(group, timeout=5)
        took = time.monotonic() - stopped
        print(f"{stage}: {len(group)} processes stopped in {took:.1f} s")
        assert proc.returncode is not None and took < STOP_GRACE_S, (
            f"the worker still ran {STOP_GRACE_S:.0f} s after SIGTERM (the launcher killed it)")
        assert not alive, f"still running after SIGKILL: {alive}"
    finally:
        for p in group:
            if p.is_running():
                p.kill()
        proc.wait(30)
    assert _left_in(tmp_path) == [], "".join(log[-20:])
    assert _shm_files(worker_id) == [], "".join(log[-20:])


def test_pdserve_up_stopped_by_ctrl_c_during_start_up_leaves_no_temp_files(model_path, short_tmp):
    tmp_path = short_tmp
    metrics_port = free_port_block(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", str(free_port()), "--metrics-port", str(metrics_port),
         "--kv-cache-gib", "1", "--model", model_path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)},
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    up = psutil.Process(proc.pid)
    worker_ids: set[str] = set()
    try:
        # Both workers have their metrics directories; the prefill engine has placed its KV
        # cache in /dev/shm and is still starting (pdserve up is not ready).
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while True:
            pids = {str(p.pid) for p in up.children(recursive=True)}
            caches = [p for p in Path("/dev/shm").glob("pdserve-kvcache-*") if p.name.rsplit("-", 1)[-1] in pids]
            dirs = list(tmp_path.glob(f"{METRICS_DIR_PREFIX}*"))
            if caches and len(dirs) == 2:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log[-30:])
            time.sleep(0.05)
        worker_ids = {d.name.removeprefix(METRICS_DIR_PREFIX).split("-")[0] for d in dirs}
        assert not any(line.startswith("pdserve ready") for line in log), "stopped too late: the stack is up"
        group = [up, *up.children(recursive=True)]
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, alive = psutil.wait_procs(group, timeout=STOP_GRACE_S + 15)
        print(f"pdserve up: {len(group)} processes stopped in {time.monotonic() - stopped:.1f} s")
        assert not alive, f"still running after Ctrl-C: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert _left_in(tmp_path) == [], "".join(log[-20:])
    assert [p for wid in worker_ids for p in _shm_files(wid)] == [], "".join(log[-20:])


# pdserve's own warnings and errors (vLLM's logs read "(EngineCore pid=...) WARNING ...").
OWN_WARNING = re.compile(r" (WARNING|ERROR) (pdserve|gateway|kvtransfer|prefill_worker|decode_worker)[.\w]*: ")


@dataclass
class Interrupted:
    """An answer streamed from `pdserve up` with Ctrl-C pressed after its 10th token."""
    tokens: list[int]
    error: grpc.RpcError | None  # how the stream ended, if not whole
    ended_s: float  # the stream's end, after Ctrl-C
    stopped_s: float  # pdserve up's exit, after Ctrl-C
    returncode: int
    log: list[str]  # pdserve up's output from Ctrl-C on


def _start_up(model_path: str, tmp: Path, port: int, *flags: str,
              metrics_port: int = 0) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """`pdserve up` with a 1 GiB KV cache, its output collected in a list, and an event set
    at its ready line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--metrics-port", str(metrics_port),
         "--kv-cache-gib", "1", "--model", model_path, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)},
    )
    log: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("pdserve ready"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return proc, log, ready


def _interrupt_while_streaming(model_path: str, tmp: Path, max_tokens: int, *flags: str) -> Interrupted:
    port = free_port()
    proc, log, ready = _start_up(model_path, tmp, port, *flags)
    got: list[int] = []
    error = stopped = None
    try:
        assert ready.wait(STAGE_TIMEOUT_S), "".join(log[-30:])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(
                token_ids=list(range(100, 140)),
                sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
            try:
                for reply in stub.Generate(request, timeout=120):
                    got.extend(reply.token_ids)
                    if stopped is None and len(got) >= 10:
                        stopped = time.monotonic()
                        stopped_at = len(log)
                        proc.send_signal(signal.SIGINT)
            except grpc.RpcError as e:
                error = e
        assert stopped is not None, f"the stream ended after {len(got)} tokens: {error}"
        ended = time.monotonic() - stopped
        code = proc.wait(STOP_GRACE_S + 60)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return Interrupted(got, error, ended, took, code, log[stopped_at:])


def test_pdserve_up_stopped_while_it_streams_finishes_the_answer_first(model_path, short_tmp):
    """Ctrl-C with an answer half streamed: the gateway takes no new call and the decode
    worker drains on a running engine, so the answer arrives whole; then everything stops,
    says nothing alarming, and leaves no file behind. (SIGTERM to each worker's process
    group reached its engine, which stopped at once: the answer failed with UNAVAILABLE,
    "EngineDeadError".) The rest of the answer must fit the drain grace (--drain-grace-s,
    30 s): seen on an AVX2-only VM with the gateway's grace fixed at 10 s, 110 tokens after
    Ctrl-C did not (UNAVAILABLE "Cancelling all calls" at the grace's end); 50 take about 3 s
    at its 64 ms per token (vLLM's unloaded TPOT p50 in that session's long compare)."""
    run = _interrupt_while_streaming(model_path, short_tmp, 60)
    assert run.error is None and len(run.tokens) == 60, f"{len(run.tokens)} of 60 tokens, {run.error}:\n" + "".join(
        run.log[-30:])
    assert run.returncode == 0
    print(f"answer whole; pdserve up stopped {run.stopped_s:.1f} s after Ctrl-C")
    alarming = [line for line in run.log if OWN_WARNING.search(line)]
    assert alarming == [], "".join(alarming)
    assert _left_in(short_tmp) == [], "".join(run.log[-20:])


def test_an_answer_longer_than_the_drain_grace_ends_unavailable_and_the_stack_still_stops_cleanly(
        model_path, short_tmp):
    """`pdserve up --drain-grace-s 1`, Ctrl-C after 10 of 2,000 tokens: the gateway cuts
    the stream with UNAVAILABLE once its grace is over, says how many calls it cut and
    which flag lets them finish, and the stack still stops on its own (exit 0, nothing
    killed) and leaves no file behind."""
    run = _interrupt_while_streaming(model_path, short_tmp, 2000, "--drain-grace-s", "1")
    assert run.error is not None and run.error.code() == grpc.StatusCode.UNAVAILABLE, (
        f"{len(run.tokens)} tokens, {run.error}:\n" + "".join(run.log[-30:]))
    assert 10 <= len(run.tokens) < 2000
    assert 0.8 <= run.ended_s < 10, f"the stream ended {run.ended_s:.1f} s after Ctrl-C, the grace is 1 s"
    assert run.returncode == 0 and run.stopped_s < STOP_GRACE_S, (
        f"exit {run.returncode} {run.stopped_s:.1f} s after Ctrl-C:\n" + "".join(run.log[-30:]))
    cut = [line for line in run.log if "drain grace is over" in line]
    assert len(cut) == 1 and "the 1 s drain grace is over with 1 calls in flight: cancelled" in cut[0], "".join(
        run.log[-30:])
    print(f"{len(run.tokens)} tokens, UNAVAILABLE {run.ended_s:.1f} s and pdserve up stopped {run.stopped_s:.1f} s "
          f"after Ctrl-C")
    assert _left_in(short_tmp) == [], "".join(run.log[-20:])


def test_pdserve_up_stopped_with_calls_queued_at_its_gateway_serves_them_before_its_workers_stop(
        model_path, short_tmp):
    """Ctrl-C while a long prompt prefills and two more wait in the gateway's queue (one
    prompt at a time on the prefill worker, none prefilled on the decode worker): all three
    answers arrive whole, because the launcher tells the workers to stop only once the
    gateway has finished its calls. A call made during the drain is refused at once with
    UNAVAILABLE saying the gateway is stopping. (The workers stopped at the same time as
    the gateway: they left rotation, and the queued calls had nowhere to go until the
    drain grace cut them.)"""
    port, metrics_port = free_port(), free_port_block(3)
    # A grace far beyond what the three answers need on a slow machine (on a 2-core AVX2 VM a
    # 3,500-token prompt was not answered within 20 s): the test is about their order.
    proc, log, ready = _start_up(model_path, short_tmp, port, "--drain-grace-s", "90", "--prefill-queue-tokens", "1",
                                 "--local-prefill-max-tokens", "0", "--rescue-prefill-max-tokens", "0",
                                 metrics_port=metrics_port)
    answers: dict[str, list[int]] = {}
    errors: dict[str, grpc.RpcError] = {}
    try:
        assert ready.wait(STAGE_TIMEOUT_S), "".join(log[-30:])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            def generate(name: str, prompt_len: int) -> None:
                request = generation_pb2.GenerateRequest(
                    token_ids=[100 + i % 1000 for i in range(prompt_len)],
                    sampling=generation_pb2.SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
                answers[name] = []
                try:
                    for reply in stub.Generate(request, timeout=120):
                        answers[name].extend(reply.token_ids)
                except grpc.RpcError as e:
                    errors[name] = e

            calls = [threading.Thread(target=generate, args=("long", 2000))]
            calls[0].start()
            time.sleep(0.05)
            for name in ("queued-1", "queued-2"):
                calls.append(threading.Thread(target=generate, args=(name, 400)))
                calls[-1].start()
            deadline = time.monotonic() + 30
            while prom.body_sum(prom.scrape(metrics_port), "pdserve_queue_length") < 1:
                assert time.monotonic() < deadline and not answers.get("long"), (
                    f"no call waited in the gateway's queue: {answers}, {errors}")
                time.sleep(0.02)
            stopped_at = len(log)
            stopped = time.monotonic()
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            late = threading.Thread(target=generate, args=("late", 40))
            late.start()
            for call in [*calls, late]:
                call.join(120)
            answered = time.monotonic()
        code = proc.wait(2 * STOP_GRACE_S + 60)
        ended = time.monotonic()
        took, after_answers = ended - stopped, ended - answered
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    after = "".join(log[stopped_at:])
    for name in ("long", "queued-1", "queued-2"):
        assert name not in errors and len(answers[name]) == 16, f"{name}: {answers}, {errors}\n{after}"
    assert errors["late"].code() == grpc.StatusCode.UNAVAILABLE, errors["late"]
    assert "gateway is stopping" in errors["late"].details(), errors["late"].details()
    assert code == 0 and after_answers < STOP_GRACE_S, (
        f"exit {code} {took:.1f} s after Ctrl-C, {after_answers:.1f} s after the last answer:\n{after}")
    assert "stopping: no new calls; 3 in flight" in after, after
    alarming = [line for line in log[stopped_at:] if OWN_WARNING.search(line)]
    assert alarming == [], "".join(alarming)
    print(f"three answers whole, the late call refused; pdserve up stopped {took:.1f} s after Ctrl-C, "
          f"{after_answers:.1f} s after the last answer")
    assert _left_in(short_tmp) == [], after
