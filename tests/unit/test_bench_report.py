"""Reports, compare summaries, CLI flag handling and server process lifecycle."""

import argparse
import json
import os
import signal
import sys
import textwrap
import time

import pytest

from pdserve.bench import cli
from pdserve.bench.compare import CompareConfig
from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.metrics import SLO, summarize_run
from pdserve.bench.record import Chunk, RequestRecord
from pdserve.bench.report import format_result, result_dict, write_plots
from pdserve.bench.runner import BenchConfig, BenchResult, RunResult
from pdserve.bench.servers import ServerError, ServerProcess, ServerSpec, free_port
from pdserve.bench.workload import LengthRange


def record(i: int, ttft_s: float, tpot_s: float, tokens: int = 3) -> RequestRecord:
    send = float(i)
    chunks = [Chunk(send + ttft_s + k * tpot_s, 1) for k in range(tokens)]
    return RequestRecord(f"r{i}", "default", 0, 10, tokens, send, chunks,
                         done_s=chunks[-1].time_s, output_tokens=tokens)


def bench_result(latencies: dict[float, list[tuple[float, float]]]) -> BenchResult:
    """One run per rate; each (ttft, tpot) pair becomes a 3-token request."""
    slo = SLO(ttft_s=1.0, tpot_s=0.5)
    cfg = BenchConfig(rates_rps=sorted(latencies), num_requests=4, slo=slo)
    runs = []
    for rate, pairs in sorted(latencies.items()):
        records = [record(i, t, p) for i, (t, p) in enumerate(pairs)]
        runs.append(RunResult(LoadConfig(rate_rps=rate, num_requests=len(records)),
                              summarize_run(records, slo), records))
    return BenchResult(cfg, runs)


FAST = [(0.5, 0.1)] * 4
HALF = [(0.5, 0.1), (0.5, 0.1), (2.0, 0.1), (0.5, 0.9)]  # attainment 0.5


def test_table_and_json_of_a_sweep():
    result = bench_result({1.0: FAST, 2.0: HALF})
    assert result.distserve_goodput_rps() == pytest.approx(1.0 + 0.1 / 0.5)
    table = format_result(result)
    assert "DistServe goodput (>= 90% of requests within SLO): 1.200 req/s" in table
    assert "open loop, 2 req/s, burstiness 1" in table
    doc = json.loads(json.dumps(result_dict(result, include_records=True)))
    assert [run["summary"]["slo_attainment"] for run in doc["runs"]] == [1.0, 0.5]
    assert doc["runs"][0]["summary"]["ttft_s"]["p50"] == 0.5
    assert len(doc["runs"][1]["records"]) == 4


def test_plots_are_written(tmp_path):
    paths = write_plots({"grpc": bench_result({1.0: FAST, 2.0: HALF}).runs}, tmp_path)
    assert [p.name for p in paths] == ["latency_cdf.png", "sweep.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_builds_one_config_from_flags():
    args = parse(["bench", "run", "--rates", "1,0.5", "--slo-ttft-s", "2",
                  "--input-len-range", "8:16", "--workload", "classmix",
                  "--class-mix", "interactive=1", "--json", "-"])
    assert args.func is cli.cmd_run
    cfg = cli.bench_config(args)
    assert cfg.rates_rps == [0.5, 1.0] and cfg.num_requests == 100
    assert cfg.slo == SLO(ttft_s=2.0, tpot_s=None)
    assert cfg.workload.kind == "classmix" and cfg.workload.input_len.high == 16
    assert [c.name for c in cfg.workload.classes] == ["interactive"]
    assert cli.bench_config(parse(["bench", "run", "--concurrency", "2", "--duration",
                                   "30"])).num_requests is None


def test_cli_run_presets_expand_and_explicit_lengths_override():
    long = cli.bench_config(parse(["bench", "run", "--workload", "long", "--rate", "0.1"]))
    assert long.workload.kind == "random"
    assert (long.workload.input_len, long.workload.output_len) == (LengthRange(512, 2048),
                                                                   LengthRange(32, 128))
    shorter = cli.bench_config(parse(["bench", "run", "--workload", "long", "--rate", "0.1",
                                      "--input-len-range", "512:1024"]))
    assert shorter.workload.input_len == LengthRange(512, 1024)
    mixed = cli.bench_config(parse(["bench", "run", "--workload", "mixed", "--rate", "0.1",
                                    "--class-mix", "interactive=0.5,offline=0.5",
                                    "--gateway-metrics", "127.0.0.1:9400"]))
    assert [(c.name, c.weight, c.input_len) for c in mixed.workload.classes] == [
        ("interactive", 0.5, LengthRange(32, 256)), ("offline", 0.5, LengthRange(512, 2048))]
    assert mixed.gateway_metrics == "127.0.0.1:9400"
    plain = cli.bench_config(parse(["bench", "run", "--rate", "1"]))
    assert (plain.workload.input_len, plain.workload.output_len) == (LengthRange(64, 1536),
                                                                     LengthRange(32, 256))
    assert plain.gateway_metrics is None


def test_cli_kv_passthrough():
    kv = parse(["bench", "kv", "--size", "4", "--help"])
    assert kv.func is cli.cmd_kv and kv.kv_args == ["--size", "4", "--help"]


SERVER = textwrap.dedent("""
    import os, subprocess, sys, time
    # A grandchild in a session of its own: killpg alone would miss it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    print("child", child.pid, flush=True)
    print("worker ready", flush=True)  # no port: not the server's ready line
    print("pdserve ready on 127.0.0.1:" + sys.argv[1], flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def fake_server(tmp_path, stop_grace_s: float) -> ServerProcess:
    port = free_port()
    spec = ServerSpec("fake", [sys.executable, "-c", SERVER, str(port)],
                      ready_pattern=rf"\bready\b.*:{port}\b", stop_grace_s=stop_grace_s)
    return ServerProcess(spec, tmp_path / "fake.log")


def leader_and_child(server: ServerProcess) -> tuple[int, int]:
    return server._proc.pid, int(next(line.split()[1] for line in server.tail().splitlines()
                                      if line.startswith("child")))


def test_server_process_waits_for_ready_and_leaves_nothing(tmp_path):
    with fake_server(tmp_path, stop_grace_s=2) as server:
        leader, child = leader_and_child(server)
        assert _alive(leader) and _alive(child)
        assert server.boot_s is not None
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert "pdserve ready" in (tmp_path / "fake.log").read_text()


STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    print("child", child.pid, flush=True)
    print("ready", flush=True)
    time.sleep(60)
""")


def test_a_stop_interrupted_during_its_grace_kills_at_once_and_leaves_nothing(tmp_path):
    spec = ServerSpec("fake", [sys.executable, "-c", STUBBORN], ready_pattern=r"^ready$", stop_grace_s=30)
    server = ServerProcess(spec, tmp_path / "fake.log")
    server.start()
    server.wait_ready()
    leader, child = leader_and_child(server)

    def interrupt(signum, frame):
        raise KeyboardInterrupt("a second Ctrl-C")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)  # while stop waits out the 30 s grace
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            server.stop()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 10
    assert not _alive(leader) and not _alive(child)
    assert server._proc is None


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, want: bool, state: str = "T", timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while (_state(pid) == state) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return (_state(pid) == state) == want


def test_a_frozen_server_and_its_descendants_stop_until_thawed_and_still_stop_cleanly(tmp_path):
    """`--idle-systems freeze`: SIGSTOP reaches the grandchild in a session of its own
    too; thawed, all run again; a server stopped while frozen still ends at SIGTERM (a
    stopped process does not act on it until continued)."""
    with fake_server(tmp_path, stop_grace_s=10) as server:
        leader, child = leader_and_child(server)
        server.freeze()
        frozen = [_wait_state(leader, True), _wait_state(child, True)]
        server.thaw()
        thawed = [_wait_state(leader, False), _wait_state(child, False)]
        server.freeze()
        assert _wait_state(leader, True)
        stopping = time.monotonic()
    took_s = time.monotonic() - stopping
    assert frozen == [True, True] and thawed == [True, True]
    assert not _alive(leader) and not _alive(child)
    assert took_s < 5, f"stopping a frozen server took {took_s:.1f} s: it waited for SIGKILL"


# A server whose engine process holds a multiprocessing shared-memory buffer (as vLLM's
# queues are) and ignores SIGTERM, so that stopping it ends in SIGKILL to the whole group.
SHM_SERVER = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "engine":
    from multiprocessing import shared_memory
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    print("segment", shm.name, flush=True)
    time.sleep(600)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
engine = subprocess.Popen([sys.executable, __file__, "engine"])
print("ready", flush=True)
time.sleep(600)
"""


def test_a_server_killed_at_stop_leaves_no_shared_memory_segment(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SHM_SERVER)
    spec = ServerSpec("fake", [sys.executable, str(script), "server"], ready_pattern=r"^ready$", stop_grace_s=1)
    with ServerProcess(spec, tmp_path / "fake.log") as server:
        deadline = time.monotonic() + 30
        while "segment" not in server.tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        name = next(line.split()[1] for line in server.tail().splitlines() if line.startswith("segment"))
        assert os.path.exists(f"/dev/shm/{name}")
    try:
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_a_server_given_an_engine_directory_leaves_none_of_its_files(tmp_path):
    # As vLLM does: a socket file in VLLM_RPC_BASE_PATH, a file in TMPDIR, neither removed.
    script = ("import os, socket, tempfile, time\n"
              "s = socket.socket(socket.AF_UNIX); s.bind(os.environ['VLLM_RPC_BASE_PATH'] + '/sock')\n"
              "open(tempfile.gettempdir() + '/store', 'w').close()\n"
              "print('ready', tempfile.gettempdir(), flush=True); time.sleep(600)\n")
    spec = ServerSpec("fake", [sys.executable, "-c", script], ready_pattern=r"^ready ", stop_grace_s=1,
                      engine_dir=True)
    with ServerProcess(spec, tmp_path / "fake.log") as server:
        where = server.tail().split()[-1]
        assert os.path.basename(where).startswith("pdserve-engine-")
        assert sorted(os.listdir(where)) == ["sock", "store"]
    assert not os.path.exists(where)


# A bench command holding a server, as `pdserve bench compare` does while it measures.
HOLDER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from pdserve.bench.cli import stop_on_sigterm
    from pdserve.bench.servers import ServerProcess, ServerSpec
    stop_on_sigterm()
    port, script, log = sys.argv[1:4]
    spec = ServerSpec("fake", [sys.executable, "-c", script, port],
                      ready_pattern=r"ready.*:" + port, stop_grace_s=2)
    with ServerProcess(spec, Path(log)) as server:
        print("up", server.pid, flush=True)
        asyncio.run(asyncio.sleep(600))
""")


def _threads_of(pid: int) -> str:
    """Each thread's state, signal masks and kernel wait channel, for a process that did not
    act on a signal (seen once in a full `make test` on a 2-core AVX2 VM, never alone)."""
    lines = []
    for task in sorted(os.listdir(f"/proc/{pid}/task")):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            fields = {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
        with open(f"/proc/{pid}/task/{task}/wchan") as f:
            wchan = f.read()
        lines.append(f"thread {task} {fields.get('Name')}: {fields.get('State')}, wchan {wchan}, SigBlk "
                     f"{fields.get('SigBlk')}, SigPnd {fields.get('SigPnd')}, ShdPnd {fields.get('ShdPnd')}, "
                     f"SigCgt {fields.get('SigCgt')}, SigIgn {fields.get('SigIgn')}")
    return "\n".join(lines)


@pytest.mark.parametrize("taken_by", ["main thread", "output pump"])
def test_sigterm_to_a_bench_command_stops_the_servers_it_started(tmp_path, taken_by):
    """The kernel hands a process's signal to any thread that does not block it (the one
    named by kill(2) first): one taken by the server's output pump, blocked in a read, must
    still stop the command, whose main thread sleeps in epoll."""
    import subprocess

    log = tmp_path / "fake.log"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(free_port()), SERVER, str(log)],
                              stdout=subprocess.PIPE, text=True)
    try:
        leader = int(holder.stdout.readline().split()[1])
        child = int(next(line.split()[1] for line in log.read_text().splitlines() if line.startswith("child")))
        assert _alive(leader) and _alive(child)
        helpers = [int(t) for t in os.listdir(f"/proc/{holder.pid}/task") if int(t) != holder.pid]
        assert len(helpers) == 1, helpers  # the pump
        os.kill(holder.pid if taken_by == "main thread" else helpers[0], signal.SIGTERM)
        try:
            code = holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the bench command still ran 30 s after SIGTERM:\n" + _threads_of(holder.pid))
        assert code != 0
        assert not _alive(leader) and not _alive(child)
    finally:
        holder.kill()
        holder.wait()


def test_server_that_exits_early_is_an_error_with_its_output(tmp_path):
    spec = ServerSpec("broken", [sys.executable, "-c", "print('no model'); raise SystemExit(3)"],
                      ready_pattern="ready", boot_timeout_s=10)
    with pytest.raises(ServerError, match="exited with 3(.|\n)*no model"):
        with ServerProcess(spec, tmp_path / "broken.log"):
            pass
    with pytest.raises(ValueError):
        ServerSpec("both", ["x"], ready_pattern="r", health_url="http://h")


def test_pdserve_ready_line_is_the_launchers_not_a_relayed_one(tmp_path):
    import re

    from pdserve.bench.systems import pdserve_spec

    spec = pdserve_spec(CompareConfig(bench=BenchConfig(rates_rps=[1.0]), model=tmp_path), 5005)
    pattern = re.compile(spec.ready_pattern)
    assert pattern.search("pdserve ready at 127.0.0.1:5005 (19 s)")
    assert not pattern.search("[gateway] READY 127.0.0.1:5005")
    assert not pattern.search("[decode] worker ready on 127.0.0.1:5005")
    assert not pattern.search("pdserve ready at 127.0.0.1:50051 (19 s)")
    assert spec.grpc_health_target == "127.0.0.1:5005"
    assert spec.argv[1:4] == ["-m", "pdserve.cli", "up"]


def test_both_systems_get_the_same_model_and_context_length(tmp_path):
    from pdserve.bench.systems import pdserve_spec, vllm_spec
    from pdserve.bench.workload import WorkloadConfig

    bench = BenchConfig(rates_rps=[1.0], workload=WorkloadConfig(max_model_len=2048))
    cfg = CompareConfig(bench=bench, model=tmp_path)

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    for spec in (pdserve_spec(cfg, 5005), vllm_spec(cfg, 5006)):
        assert flag(spec.argv, "--model") == str(tmp_path)
        assert flag(spec.argv, "--max-model-len") == "2048"
    vllm = vllm_spec(cfg, 5006).argv
    assert flag(vllm, "--block-size") == "32" and "--enable-prefix-caching" in vllm


def test_frozen_systems_get_the_same_execute_model_limit_past_a_turn(tmp_path):
    import dataclasses

    from pdserve.bench.systems import pdserve_spec, vllm_spec

    frozen = CompareConfig(bench=BenchConfig(rates_rps=[1.0]), model=tmp_path)
    assert frozen.freeze_idle
    for spec in (pdserve_spec(frozen, 5005), vllm_spec(frozen, 5006)):
        # vLLM's default is 300 s; a turn of the other system is longer than that.
        assert int(spec.env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"]) >= 3600
    running = dataclasses.replace(frozen, freeze_idle=False)
    for spec in (pdserve_spec(running, 5005), vllm_spec(running, 5006)):
        assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in spec.env


def test_only_pdserve_fifo_passes_a_policy_and_it_is_plain_fifo(tmp_path):
    from pdserve.bench.systems import pdserve_spec

    cfg = CompareConfig(bench=BenchConfig(rates_rps=[1.0]), model=tmp_path)
    slo = pdserve_spec(cfg, 5005).argv
    assert "--policy" not in slo and "--local-prefill-max-tokens" not in slo  # the defaults
    fifo = pdserve_spec(cfg, 5005, "pdserve-fifo")
    # Arrival order, no admission, and every prompt through the prefill tier.
    assert fifo.argv[-4:] == ["--policy", "fifo", "--local-prefill-max-tokens", "0"]
    assert fifo.name == "pdserve-fifo"


def test_json_has_ttft_p90_per_class_and_gateway_cpu():
    from pdserve.bench.gateway_cpu import GatewayCpu
    from pdserve.bench.machine import MachineUse

    records = [record(0, 0.5, 0.1), record(1, 2.0, 0.1)]
    records[1].class_name = "offline"
    run = RunResult(LoadConfig(rate_rps=1.0, num_requests=2),
                    summarize_run(records, SLO(1.0, 0.5)), records,
                    GatewayCpu(0.3, 0.1, 4000, 100.0, "gateway process + tokenizer pool"),
                    MachineUse(busy_cores=1.9, steal_cores=0.2, harness_cores=0.1))
    doc = json.loads(json.dumps(result_dict(BenchResult(BenchConfig(rates_rps=[1.0]), [run]))))
    assert doc["runs"][0]["machine"] == {"busy_cores": 1.9, "steal_cores": 0.2, "harness_cores": 0.1}
    from pdserve.bench.compare_report import sweep_entry

    assert sweep_entry(run)["machine"]["steal_cores"] == 0.2
    by_class = doc["runs"][0]["summary"]["by_class"]
    assert (by_class["default"]["ttft_s"]["p90"], by_class["offline"]["ttft_s"]["p90"]) == \
        (0.5, 2.0)
    assert doc["runs"][0]["gateway_cpu"]["us_per_token"] == 100.0
    assert "gateway CPU: 100 us per output token (0.30 s gateway, 0.10 s pool" in \
        format_result(BenchResult(BenchConfig(rates_rps=[1.0]), [run]))
