"""Tiers on different hosts: the gateway, a prefill worker and decode workers each in a
network namespace of their own, joined by veth pairs to a bridge (itself in a namespace, so
the machine's own network is untouched), each worker with a private /dev/shm (its own mount
namespace). The gateway must pick the tcp KV transport by itself; a second decode worker
joins from a fourth host and takes traffic; the first is drained with no failed request.

Needs root and iproute2 (CI runs as root); skipped otherwise, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

BOOT_TIMEOUT_S = 420
SUBNET = "10.231.17"  # inside this test's own namespaces only
GATEWAY_PORT = 50051
WORKER_PORT = 50061
METRICS_PORT = 9400


@dataclass
class Host:
    name: str  # the network namespace
    ip: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class Hosts:
    """Network namespaces on a bridge; processes started in them; all removed by close()."""

    def __init__(self, tmp: Path) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.tmp = tmp
        self.bridge = f"pdbr{self.tag}"
        self.hosts: dict[str, Host] = {}
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")

    def add(self, role: str, index: int) -> Host:
        ns, ip = f"pd{role}{self.tag}", f"{SUBNET}.{index}"
        inner, outer = f"v{self.tag}{index}", f"p{self.tag}{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "netns", self.bridge)
        _ip("-n", self.bridge, "link", "set", outer, "master", "br0")
        _ip("-n", self.bridge, "link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.hosts[role] = host = Host(ns, ip)
        return host

    def start(self, role: str, *argv: str) -> subprocess.Popen:
        """Runs ``python -m pdserve.cli ARGV`` on the host, with its own /dev/shm."""
        host = self.hosts[role]
        log = open(self.tmp / f"{role}.log", "w")
        script = 'mount -t tmpfs -o size=3g tmpfs /dev/shm && exec "$@"'
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.name, "unshare", "--mount", "--propagation", "private",
             "sh", "-c", script, "sh", sys.executable, "-m", "pdserve.cli", *argv],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        host.procs.append(proc)
        return proc

    def run(self, role: str, code: str, timeout_s: float = 300) -> dict:
        """Runs a Python snippet on the host; it prints one JSON document."""
        out = subprocess.run(["ip", "netns", "exec", self.hosts[role].name, sys.executable, "-c", textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=timeout_s, env=os.environ)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def log(self, role: str) -> str:
        return (self.tmp / f"{role}.log").read_text()

    def close(self) -> None:
        procs = [p for h in self.hosts.values() for p in h.procs]
        descendants = []
        for proc in procs:
            try:
                descendants += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(descendants, timeout=15)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.name], check=False)
        subprocess.run(["ip", "netns", "del", self.bridge], check=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def hosts(model_path, tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, iproute2 and util-linux's unshare to make network and mount namespaces")
    net = Hosts(tmp_path_factory.mktemp("hosts"))
    try:
        gw = net.add("gateway", 1)
        pf = net.add("prefill", 2)
        net.add("decode1", 3)
        net.add("decode2", 4)
        gateway = f"{gw.ip}:{GATEWAY_PORT}"
        net.start("gateway", "gateway", "--host", gw.ip, "--port", str(GATEWAY_PORT), "--model", model_path)
        common = ["--model", model_path, "--kv-cache-gib", "1", "--gateway", gateway, "--port", str(WORKER_PORT),
                  "--metrics-port", str(METRICS_PORT)]
        net.start("prefill", "prefill", "--host", pf.ip, "--kv-host", pf.ip, *common)
        net.start("decode1", "decode", "--host", net.hosts["decode1"].ip, *common)
        net.gateway, net.model = gateway, model_path
        yield net
    finally:
        net.close()


WORKERS = """
    import grpc, json
    from protos import worker_pb2, worker_pb2_grpc
    from google.protobuf import json_format
    stub = worker_pb2_grpc.RegistryStub(grpc.insecure_channel("{gateway}"))
    try:
        reply = stub.ListWorkers(worker_pb2.ListWorkersRequest(), timeout=5)
    except grpc.RpcError as e:  # the gateway is not listening yet
        print(json.dumps(None))
    else:
        print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True).get("workers", [])))
"""

GENERATE = """
    import grpc, json, random
    from concurrent.futures import ThreadPoolExecutor
    from protos import generation_pb2 as g, generation_pb2_grpc as gg
    stub = gg.GenerationStub(grpc.insecure_channel("{gateway}"))
    def one(i):
        ids = [random.Random(i).randrange(100, 40000) for _ in range(300)]
        req = g.GenerateRequest(token_ids=ids, sampling=g.SamplingParams(max_tokens={max_tokens}, temperature=0, ignore_eos=True))
        try:
            return [r for r in stub.Generate(req, timeout=300)][-1].usage.completion_tokens
        except grpc.RpcError as e:
            return e.code().name
    with ThreadPoolExecutor({n}) as pool:
        print(json.dumps(list(pool.map(one, range({seed}, {seed} + {n})))))
"""

RECEIVED = """
    import json, re, urllib.request
    body = urllib.request.urlopen("http://{ip}:{port}/metrics", timeout=5).read().decode()
    found = {{}}
    for m in re.finditer(r'^pdserve_kv_transfer_tokens_total\\{{([^}}]*)\\}} (\\S+)$', body, re.M):
        if 'direction="recv"' in m.group(1):
            transport = re.search(r'transport="([^"]+)"', m.group(1)).group(1)
            found[transport] = found.get(transport, 0) + float(m.group(2))
    print(json.dumps(found))
"""


def list_workers(net: Hosts) -> list[dict] | None:
    """The gateway's workers; None while the gateway does not answer."""
    return net.run("gateway", WORKERS.format(gateway=net.gateway))


def wait_ready(net: Hosts, roles: list[str], timeout_s: float = BOOT_TIMEOUT_S) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        ready = [w for w in list_workers(net) or [] if w["state"] == "ready"]
        if sorted(w["role"] for w in ready) == sorted(roles):
            return ready
        assert time.monotonic() < deadline, f"workers not ready in {timeout_s} s: {ready}\n" + net.log("gateway")[-3000:]
        time.sleep(2)


def generate(net: Hosts, n: int, seed: int, max_tokens: int = 8) -> list:
    return net.run("gateway", GENERATE.format(gateway=net.gateway, n=n, seed=seed, max_tokens=max_tokens))


def received(net: Hosts, role: str) -> dict[str, float]:
    return net.run("gateway", RECEIVED.format(ip=net.hosts[role].ip, port=METRICS_PORT))


def test_tiers_on_separate_hosts_use_tcp_join_at_runtime_and_drain_cleanly(hosts):
    net = hosts
    ready = wait_ready(net, ["prefill", "decode"])
    assert {w["address"] for w in ready} == {f"{net.hosts['prefill'].ip}:{WORKER_PORT}",
                                             f"{net.hosts['decode1'].ip}:{WORKER_PORT}"}
    # The gateway picked tcp by itself: the hosts share no /dev/shm.
    assert generate(net, 2, seed=0) == [8, 8]
    first = received(net, "decode1")
    assert first.get("tcp", 0) >= 2 * 300 and first.get("shm", 0) == 0, first

    # A second decode worker joins from a fourth host and takes traffic.
    net.start("decode2", "decode", "--host", net.hosts["decode2"].ip, "--model", net.model,
              "--kv-cache-gib", "1", "--gateway", net.gateway, "--port", str(WORKER_PORT),
              "--metrics-port", str(METRICS_PORT))
    ready = wait_ready(net, ["prefill", "decode", "decode"])
    assert generate(net, 4, seed=10) == [8] * 4
    assert received(net, "decode2").get("tcp", 0) >= 300

    # Drain the first decode worker while requests run: none fails, it leaves and exits.
    decode1 = next(w for w in ready if w["address"].startswith(net.hosts["decode1"].ip))
    load = subprocess.Popen(["ip", "netns", "exec", net.hosts["gateway"].name, sys.executable, "-c",
                             textwrap.dedent(GENERATE.format(gateway=net.gateway, n=6, seed=20, max_tokens=32))],
                            stdout=subprocess.PIPE, text=True, env=os.environ)
    time.sleep(2.0)
    drained = net.run("gateway", f"""
        import grpc, json
        from protos import worker_pb2, worker_pb2_grpc
        stub = worker_pb2_grpc.RegistryStub(grpc.insecure_channel("{net.gateway}"))
        print(json.dumps(stub.Drain(worker_pb2.DrainRequest(worker_id="{decode1['worker_id']}"), timeout=5).worker.state))
    """)
    assert drained == "draining"
    out, _ = load.communicate(timeout=300)
    assert json.loads(out.strip().splitlines()[-1]) == [32] * 6
    assert net.hosts["decode1"].procs[0].wait(timeout=120) == 0
    assert sorted(w["role"] for w in list_workers(net)) == ["decode", "prefill"]
    assert generate(net, 2, seed=40) == [8, 8]

