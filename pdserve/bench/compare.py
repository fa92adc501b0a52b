"""pdserve against colocated vLLM on one machine, with one seeded workload.

The systems run one after the other, never together: start the server, warm it up,
sweep the request rates, stop it and check that no process is left, then the next one.
Each system is summarized by DistServe's goodput (the highest rate at which >= 90% of
requests meet both SLOs, interpolated between swept rates) and by throughput and
latency percentiles at the highest rate swept; `ratios` are pdserve / vLLM. Both servers
get the same model folder, dtype (pdserve.engine.resolve_dtype: float32 on this AVX2 CPU), eager mode, block size 32 and
context length.

Defaults fit this project's 2-core AVX2 machine (no AVX512-BF16): bf16 matmuls run at
about 7 GFLOP/s per core there, so a core prefills about 30 tokens/s and one decode step
takes about 170 ms. With the issue's 64-1,536-token prompts no request can meet a 2 s TTFT
(64 tokens already take about 2 s) and a sweep with a light-load rate would take hours. So
the defaults shrink the requests to 16-64 prompt and 16-64 output tokens and sweep 0.05
(light), 0.15 and 0.4 req/s (overload) with 16 requests each: about 470 s of arrivals per
system, plus drains and two boots, about 20 minutes for the pair. Every length and rate
is a flag; `--input-len-range 64:1536 --output-len-range 32:256` gives the issue's mix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.metrics import DISTSERVE_TARGET, LatencyStats
from pdserve.bench.report import format_result, result_dict
from pdserve.bench.runner import BenchConfig, BenchResult, RunResult, run_bench
from pdserve.bench.servers import ServerError, ServerProcess, ServerSpec, free_port
from pdserve.bench.workload import LengthRange

SYSTEMS = ("pdserve", "vllm")
DEFAULT_RATES_RPS = (0.05, 0.15, 0.4)
DEFAULT_NUM_REQUESTS = 16
DEFAULT_INPUT_LEN = LengthRange(16, 64)
DEFAULT_OUTPUT_LEN = LengthRange(16, 64)
RATIO_KEYS = ("goodput_rps", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
              "tpot_p99_s")


@dataclass(slots=True)
class CompareConfig:
    bench: BenchConfig  # workload, rates, SLOs; backend and address are set per system
    model: Path
    systems: tuple[str, ...] = SYSTEMS
    log_dir: Path = Path("bench-logs")
    # Cores for colocated vLLM (VLLM_CPU_OMP_THREADS_BIND) and its KV cache in GiB.
    vllm_cpus: str = "0-1"
    vllm_kv_cache_gib: int = 2
    # Benchmark servers that are already running instead of starting them.
    pdserve_target: str | None = None
    vllm_url: str | None = None
    boot_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown or not self.systems:
            raise ValueError(f"systems {self.systems}: want some of {', '.join(SYSTEMS)}")
        if len(self.bench.rates_rps) < 1:
            raise ValueError("compare sweeps request rates: give at least one rate")


@dataclass(slots=True)
class SystemResult:
    name: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    boot_s: float | None = None
    result: BenchResult | None = None
    error: str | None = None


def pdserve_argv(port: int, model: Path, max_model_len: int) -> list[str]:
    # Metrics off: `up` would otherwise bind fixed ports that a concurrent stack may hold.
    return [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--model",
            str(model), "--max-model-len", str(max_model_len), "--metrics-port", "0"]


def source_root_env() -> dict[str, str]:
    """PYTHONPATH with this checkout first, so `-m pdserve.cli` works uninstalled too."""
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": root + (os.pathsep + rest if rest else "")}


def pdserve_spec(cfg: CompareConfig, port: int) -> ServerSpec:
    # `up` prints "pdserve ready at HOST:PORT"; the lines it relays from its processes
    # start with "[role]" (the gateway's own "[gateway] READY ..." comes before the
    # workers are up), so those are skipped, and gRPC health must then say SERVING.
    argv = pdserve_argv(port, cfg.model, cfg.bench.workload.max_model_len)
    return ServerSpec("pdserve", argv, source_root_env(),
                      ready_pattern=rf"^[^\[].*\bready\b.*:{port}\b",
                      grpc_health_target=f"127.0.0.1:{port}", boot_timeout_s=cfg.boot_timeout_s)


def vllm_dtype() -> str:
    """The dtype pdserve's workers resolve by default (pdserve.engine.resolve_dtype): both
    systems compute in the same one."""
    from pdserve.engine import resolve_dtype

    return resolve_dtype()


def vllm_spec(cfg: CompareConfig, port: int) -> ServerSpec:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(cfg.model), "--dtype", vllm_dtype(), "--block-size", "32", "--max-model-len",
            str(cfg.bench.workload.max_model_len), "--enforce-eager", "--port", str(port), "--host", "127.0.0.1"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": cfg.vllm_cpus}
    return ServerSpec("vllm", argv, env, health_url=f"http://127.0.0.1:{port}/health",
                      boot_timeout_s=cfg.boot_timeout_s)


def bench_config_for(cfg: CompareConfig, system: str, address: str) -> BenchConfig:
    if system == "pdserve":
        return dataclasses.replace(cfg.bench, backend="grpc", target=address)
    return dataclasses.replace(cfg.bench, backend="openai", base_url=address, model_name=None)


def run_system(cfg: CompareConfig, system: str) -> SystemResult:
    """Boots (unless given an address), benchmarks and stops one system; never raises for
    a server that fails, so the other system still runs and the failure is reported."""
    out = SystemResult(system)
    existing = cfg.pdserve_target if system == "pdserve" else cfg.vllm_url
    try:
        if existing is not None:
            out.result = asyncio.run(run_bench(bench_config_for(cfg, system, existing)))
            return out
        port = free_port()
        spec = pdserve_spec(cfg, port) if system == "pdserve" else vllm_spec(cfg, port)
        out.command, out.env = spec.argv, spec.env
        address = f"127.0.0.1:{port}" if system == "pdserve" else f"http://127.0.0.1:{port}"
        print(f"[bench] starting {system}: {' '.join(spec.argv)}", file=sys.stderr)
        with ServerProcess(spec, cfg.log_dir / f"{system}.log") as server:
            out.boot_s = server.boot_s
            print(f"[bench] {system} ready in {server.boot_s:.0f} s", file=sys.stderr)
            out.result = asyncio.run(run_bench(bench_config_for(cfg, system, address)))
    except (ServerError, OSError) as e:
        out.error = str(e)
        print(f"[bench] {system} failed: {e}", file=sys.stderr)
    return out


def run_compare(cfg: CompareConfig) -> dict[str, SystemResult]:
    return {system: run_system(cfg, system) for system in cfg.systems}


# ---------------------------------------------------------------- summary ----------------


def _stat(stats: LatencyStats | None, q: str) -> float | None:
    return None if stats is None else getattr(stats, q)


def sweep_entry(run: RunResult) -> dict:
    s = run.summary
    return {
        "rate_rps": run.load.rate_rps,
        "num_requests": s.num_requests,
        "num_ok": s.num_ok,
        "errors": s.errors,
        "slo_attainment": s.slo_attainment,
        "request_goodput_rps": s.request_goodput_rps,
        "request_throughput_rps": s.request_throughput_rps,
        "output_tok_s": s.output_tok_s,
        "duration_s": s.duration_s,
        **{f"{name}_{q}_s": _stat(getattr(s, f"{name}_s"), q)
           for name in ("ttft", "tpot", "itl", "e2e") for q in ("p50", "p99")},
    }


def system_dict(system: SystemResult) -> dict:
    out: dict = {"command": system.command, "env": system.env, "boot_s": system.boot_s,
                 "error": system.error}
    if system.result is None:
        return out
    sweep = [sweep_entry(r) for r in system.result.runs]
    top = max(sweep, key=lambda entry: entry["rate_rps"])
    lowest = min(sweep, key=lambda entry: entry["rate_rps"])
    out.update({
        "goodput_rps": system.result.distserve_goodput_rps(),
        # DistServe's goodput is 0 then; the true knee lies somewhere below the lowest rate.
        "goodput_below_lowest_rate": lowest["slo_attainment"] < DISTSERVE_TARGET,
        "latencies_at_rate_rps": top["rate_rps"],
        "output_tok_s": top["output_tok_s"],
        **{k: top[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")},
        "sweep": sweep,
    })
    return out


def ratios(pdserve: dict, vllm: dict) -> dict[str, float | None]:
    """pdserve / vLLM per key; None where either side has no (or a zero) value.

    When vLLM misses the target even at the lowest rate swept (goodput 0) and pdserve
    does not, `goodput_rps_lower_bound` is pdserve's goodput / that lowest rate: vLLM's
    knee is below it, so the true ratio is at least this.
    """
    def ratio(key: str) -> float | None:
        a, b = pdserve.get(key), vllm.get(key)
        return None if a is None or not b else a / b
    out = {key: ratio(key) for key in RATIO_KEYS}
    if vllm.get("goodput_below_lowest_rate") and pdserve.get("goodput_rps"):
        lowest_rate = min(entry["rate_rps"] for entry in vllm["sweep"])
        out["goodput_rps_lower_bound"] = pdserve["goodput_rps"] / lowest_rate
    return out


def compare_dict(cfg: CompareConfig, results: dict[str, SystemResult]) -> dict:
    out = {name: system_dict(r) for name, r in results.items()}
    if "pdserve" in out and "vllm" in out:
        out["ratios"] = ratios(out["pdserve"], out["vllm"])
    bench = cfg.bench
    out["config"] = {
        "model": str(cfg.model), "rates_rps": bench.rates_rps,
        "num_requests_per_rate": bench.num_requests, "duration_s_per_rate": bench.duration_s,
        "burstiness": bench.burstiness, "warmup": bench.warmup, "seed": bench.seed,
        "slo": dataclasses.asdict(bench.slo), "sampling": dataclasses.asdict(bench.sampling),
        "workload": {k: (str(v) if isinstance(v, Path) else v)
                     for k, v in dataclasses.asdict(bench.workload).items()},
        "goodput": "DistServe: highest rate with >= 90% of requests meeting both SLOs",
        "latencies": "at the highest rate swept",
        "cpu_count": os.cpu_count(),
    }
    return out


def format_compare(doc: dict, results: dict[str, SystemResult]) -> str:
    parts = []
    for name, system in results.items():
        if system.result is not None:
            parts.append(f"######## {name} ########\n{format_result(system.result)}")
        else:
            parts.append(f"######## {name} ########\nfailed: {system.error}")
    if "ratios" in doc:
        rows = [f"{'metric':<14}{'pdserve':>12}{'vllm':>12}{'ratio':>10}"]
        for key in RATIO_KEYS:
            a, b, r = doc["pdserve"].get(key), doc["vllm"].get(key), doc["ratios"][key]
            fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
            rows.append(f"{key:<14}{fmt(a):>12}{fmt(b):>12}{fmt(r):>10}")
        bound = doc["ratios"].get("goodput_rps_lower_bound")
        if bound is not None:
            rows.append(f"goodput_rps ratio >= {bound:.3g}: vLLM missed the 90% target even "
                        "at the lowest rate swept")
        rate = max(doc["config"]["rates_rps"])
        parts.append(f"######## pdserve / vllm (latencies and tok/s at {rate:g} req/s) "
                     "########\n" + "\n".join(rows))
    return "\n\n".join(parts)


def detail_dict(results: dict[str, SystemResult]) -> dict:
    """Each system's full result with every request's timeline (`--save-records`)."""
    return {name: result_dict(r.result, include_records=True)
            for name, r in results.items() if r.result is not None}
