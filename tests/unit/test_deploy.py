"""docker-compose.yml, the Prometheus configuration and the Grafana dashboard, checked as
files (no Docker engine here): services, ports, healthchecks, scaling, volumes, the GPU
profile, and that every panel reads a metric some pdserve process defines."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve import envvars
from pdserve.cli import build_parser
from pdserve.config import STOP_GRACE_S
from tests import dashboard

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
GRAFANA = ROOT / "deploy/grafana"
WORKERS = {"prefill": "prefill", "decode": "decode", "prefill-gpu": "prefill", "decode-gpu": "decode"}
PDSERVE = {"gateway": "gateway", **WORKERS}  # service -> pdserve subcommand
# Read by pdserve.model, not a flag.
NON_FLAG_VARS = {"PDSERVE_CACHE_DIR"}


def argv(service: str) -> list[str]:
    """The service's command as `pdserve` arguments (a `sh -c "exec pdserve ..."` unwrapped)."""
    command = SERVICES[service]["command"]
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2].replace("$$HOSTNAME", "replica-host").removeprefix("exec "))
    assert command[0] == "pdserve", command
    return command[1:]


def env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[service]["environment"].items()}


# ---------------------------------------------------------------- compose -----------------


def test_services():
    assert set(SERVICES) == {"gateway", "prefill", "decode", "prefill-gpu", "decode-gpu", "prometheus", "grafana"}
    assert [argv(s)[0] for s in PDSERVE] == list(PDSERVE.values())


@pytest.mark.parametrize("service", PDSERVE)
def test_healthcheck_probes_the_services_own_grpc_port(service):
    check = SERVICES[service]["healthcheck"]
    assert check["test"] == ["CMD", "python", "-m", "pdserve.probe", f"127.0.0.1:{env(service)['PDSERVE_PORT']}"]
    assert int(check["start_period"].removesuffix("s")) >= 180  # an engine's first start


@pytest.mark.parametrize("service", PDSERVE)
def test_pdserve_services_share_shm_and_the_model_cache(service):
    spec = SERVICES[service]
    assert spec["ipc"] == "host"
    assert "pdserve-cache:/root/.cache/pdserve" in spec["volumes"]
    assert env(service)["PDSERVE_CACHE_DIR"] == "/root/.cache/pdserve"
    assert env(service)["PDSERVE_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("service", PDSERVE)
def test_docker_waits_for_the_drain_before_it_kills(service):
    """Docker's own 10 s would SIGKILL an answer that the server's drain grace lets finish."""
    parser = build_parser()
    args = envvars.parse_args(parser, [*argv(service), "--model", "/m"], env(service))
    wait_s = int(SERVICES[service]["stop_grace_period"].removesuffix("s"))
    assert wait_s >= args.drain_grace_s + STOP_GRACE_S


@pytest.mark.parametrize("service", WORKERS)
def test_workers_scale_register_and_pin_no_host_port(service):
    spec = SERVICES[service]
    assert "ports" not in spec and "container_name" not in spec and "hostname" not in spec
    args = argv(service)
    assert args[args.index("--gateway") + 1] == "gateway:50051"
    assert {env(service)["PDSERVE_PORT"], env(service)["PDSERVE_METRICS_PORT"]} <= set(spec["expose"])
    assert "gateway" in spec["depends_on"]


def test_prefill_replicas_advertise_their_own_kv_address():
    for service in ("prefill", "prefill-gpu"):
        args = argv(service)
        assert args[args.index("--kv-host") + 1] == "replica-host"  # $HOSTNAME, per replica
        assert {env(service)["PDSERVE_KV_TCP_PORT"], env(service)["PDSERVE_KV_NCCL_PORT"]} <= set(
            SERVICES[service]["expose"])


def test_published_ports():
    published = {s: spec.get("ports", []) for s, spec in SERVICES.items() if spec.get("ports")}
    assert published == {"gateway": ["${PDSERVE_GATEWAY_PORT:-50051}:50051"],
                         "prometheus": ["${PROMETHEUS_PORT:-9090}:9090"],
                         "grafana": ["${GRAFANA_PORT:-3000}:3000"]}
    assert env("gateway")["PDSERVE_PORT"] == "50051"


@pytest.mark.parametrize("service", PDSERVE)
def test_every_variable_is_a_flag_of_its_command_with_a_valid_value(service):
    parser = build_parser()
    command = PDSERVE[service]
    variables = {k: v for k, v in env(service).items() if k.startswith("PDSERVE_") and k not in NON_FLAG_VARS}
    # Flags required today that registration may make optional: a placeholder, so the
    # variables' values are what is checked here.
    sub = next(p for p in envvars.parsers(parser) if p.prog == f"pdserve {command}")
    required = {envvars.env_var(a): "placeholder:1" for a in sub._actions if a.required}
    args = envvars.parse_args(parser, [command], {**required, **variables})
    assert set(variables) <= envvars.command_vars(parser, args)
    assert args.host == "0.0.0.0" and args.port == int(variables["PDSERVE_PORT"])


@pytest.mark.parametrize("service", PDSERVE)
def test_commands_parse(service):
    """Each service's whole command line with its variables, as the container runs it."""
    parser = build_parser()
    sub = next(p for p in envvars.parsers(parser) if p.prog == f"pdserve {PDSERVE[service]}")
    known = {s for a in sub._actions for s in a.option_strings}
    unknown = [a for a in argv(service) if a.startswith("--") and a not in known]
    if unknown:
        pytest.skip(f"pdserve {PDSERVE[service]} has no {', '.join(unknown)} yet (worker registration, issue #9)")
    missing = [a.option_strings[0] for a in sub._actions
               if a.required and envvars.env_var(a) not in env(service)]
    if missing:
        pytest.skip(f"pdserve {PDSERVE[service]} still requires {', '.join(missing)} (worker registration, issue #9)")
    envvars.parse_args(parser, argv(service), env(service))


def test_gpu_profile():
    for service, tier in WORKERS.items():
        spec = SERVICES[service]
        if not service.endswith("-gpu"):
            assert "profiles" not in spec and "deploy" not in spec
            continue
        assert spec["profiles"] == ["gpu"]
        assert spec["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert spec["build"] == {"context": ".", "args": {"EXTRA": "gpu"}} and spec["image"] == "pdserve:gpu"
        # Found by Prometheus (and by anyone resolving the tier's name) with the CPU replicas.
        assert spec["networks"]["default"]["aliases"] == [tier]
        assert "cuda_ipc" in env(service)["PDSERVE_KV_TRANSPORT"].split(",")
    assert "ARG EXTRA=cpu" in (ROOT / "Dockerfile").read_text()


def test_volumes_are_declared_and_bind_mounts_exist():
    declared = set(COMPOSE["volumes"])
    used = set()
    for service, spec in SERVICES.items():
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{service}: {source} is not in the repository"
            else:
                used.add(source)
    assert used == declared == {"pdserve-cache", "prometheus-data", "grafana-data"}


def test_docker_compose_accepts_the_file():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` here (the Docker client has no compose plugin); checked as YAML above")
    done = subprocess.run([docker, "compose", "-f", str(ROOT / "docker-compose.yml"), "--profile", "gpu",
                           "config", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- prometheus --------------


def test_prometheus_finds_every_replica_of_each_tier_by_dns():
    jobs = {job["job_name"]: job for job in PROMETHEUS["scrape_configs"]}
    for job_name, process in dashboard.JOBS.items():
        (sd,) = jobs[job_name]["dns_sd_configs"]
        assert sd["type"] == "A" and sd["names"] == [process]
        assert str(sd["port"]) == env(process)["PDSERVE_METRICS_PORT"]
    assert env("prefill-gpu")["PDSERVE_METRICS_PORT"] == env("prefill")["PDSERVE_METRICS_PORT"]
    assert env("decode-gpu")["PDSERVE_METRICS_PORT"] == env("decode")["PDSERVE_METRICS_PORT"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in SERVICES["prometheus"]["volumes"]


# ---------------------------------------------------------------- grafana -----------------


def test_grafana_provisions_the_datasource_and_the_dashboard():
    mounts = dict(v.split(":")[:2] for v in SERVICES["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (source,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert (source["type"], source["url"]) == ("prometheus", "http://prometheus:9090")
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/pdserve.yml").read_text())["providers"]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + dashboard.DASHBOARD.name
    for panel in dashboard.panels(dashboard.load()):
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]


def test_every_panel_queries_prometheus():
    board = dashboard.load()
    assert (board["uid"], board["title"]) == ("pdserve", "pdserve")
    shown = dashboard.panels(board)
    ids = [p["id"] for p in board["panels"]] + [q["id"] for p in board["panels"] for q in p.get("panels", [])]
    assert len(set(ids)) == len(ids) and len(shown) == 18
    for panel in shown:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert dashboard.selectors(target["expr"]), (panel["title"], target["expr"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_the_dashboard_shows_what_operators_asked_for():
    metrics = {s.metric for s in dashboard.all_selectors(dashboard.load())}
    assert {
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:generation_tokens_total", "pdserve_queue_length", "pdserve_refusals_total",
        "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "pdserve_kv_transfer_bytes_total",
        "pdserve_tpot_forecast_ratio_bucket", "pdserve_queue_wait_seconds_bucket", "process_cpu_seconds_total",
        "pdserve_tokenizer_pool_cpu_seconds_total",
    } <= metrics


def test_selectors_of_a_promql_expression():
    expr = ('histogram_quantile(0.95, sum by (le, priority) (rate(x:ttft_bucket{job="pdserve-gateway", '
            'priority="batch"}[$__rate_interval]))) / on (job) group_left sum(up{job=~"pdserve-prefill|pdserve-decode"})'
            ' > bool 0 and offset_total offset 5m')
    assert dashboard.selectors(expr) == [
        dashboard.Selector("x:ttft_bucket", frozenset({"gateway"})),
        dashboard.Selector("up", frozenset({"prefill", "decode"})),
        dashboard.Selector("offset_total", frozenset({"gateway", "prefill", "decode"})),
    ]


def test_every_dashboard_metric_is_defined_where_its_job_scrapes():
    """Gateway names from gateway.metrics, KV transfer names from kvtransfer.metrics (the
    workers), engine names from vLLM's own loggers (the workers): defined, if not yet
    exported; tests/integration/test_dashboard.py checks a running stack."""
    defined = {"gateway": _series(["gateway.metrics"]) | _collected_gateway_series(), "prefill": set(), "decode": set()}
    for worker in ("prefill", "decode"):
        defined[worker] = _series(["kvtransfer.metrics"]) | _vllm_series()
    for selector, titles in dashboard.all_selectors(dashboard.load()).items():
        assert selector.processes, f"{titles}: no pdserve job matches {selector.metric}"
        where = [p for p in selector.processes if selector.metric in defined[p]]
        assert where, f"{titles}: {selector.metric} is defined by none of {sorted(selector.processes)}"


def _series(modules: list[str]) -> set[str]:
    """The series names the metric objects of these modules export."""
    import prometheus_client

    names = set()
    for module in modules:
        for obj in vars(importlib.import_module(module)).values():
            if isinstance(obj, prometheus_client.metrics.MetricWrapperBase):
                names |= _suffixed(obj._name, obj._type)
    return names


def _collected_gateway_series() -> set[str]:
    """What the gateway exports through collectors rather than metric objects: its own
    process's CPU (prometheus_client's process collector) and its tokenizer pool's."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    from gateway.metrics import register_tokenizer_pool_cpu

    names = set()
    for collector in (ProcessCollector(registry=None),
                      register_tokenizer_pool_cpu(lambda: 0.0, registry=CollectorRegistry())):
        for family in collector.collect():
            names |= {sample.name for sample in family.samples}
    return names


def _vllm_series() -> set[str]:
    source = Path(importlib.util.find_spec("vllm").origin).parent / "v1/metrics/loggers.py"
    names = set()
    for kind, name in re.findall(r"_(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[\w:]+)\"", source.read_text()):
        names |= _suffixed(name, kind)
    return names


def _suffixed(name: str, kind: str) -> set[str]:
    if kind == "counter":
        return {name.removesuffix("_total") + "_total"}
    if kind == "histogram":
        return {name + "_bucket", name + "_sum", name + "_count"}
    return {name}
