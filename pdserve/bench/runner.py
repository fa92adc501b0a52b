"""One benchmark, from a `BenchConfig`: warm up, then run each rate (or the closed loop).

Every rate of a sweep replays the same seeded lengths and arrival schedule, so rates
differ in load alone; the synthetic prompts' token ids are fresh per rate (content seed =
seed + rate index), so no rate finds the previous rate's prompts in the prefix cache.
Warmup requests come from a separate seed and run before the measured clock starts, so
changing `warmup` does not change the measured workload. With `gateway_metrics`, each run
also reads the gateway's CPU counters before and after it (`gateway_cpu`).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field

from pdserve.bench.gateway_cpu import GatewayCpu, gateway_cpu, scrape
from pdserve.bench.backends import Backend, GrpcBackend, OpenAIBackend, SamplingConfig
from pdserve.bench.loadgen import LoadConfig, Progress, drive
from pdserve.bench.machine import STEAL_WARNING_CORES, MachineMeter, MachineUse
from pdserve.bench.metrics import (
    SLO,
    Objective,
    Summary,
    SweepPoint,
    distserve_goodput,
    summarize_run,
)
from pdserve.bench.record import RequestRecord
from pdserve.bench.workload import RequestSpec, WorkloadConfig, build_workload, take

BACKENDS = ("grpc", "openai")
WARMUP_SEED_OFFSET = 1_000_003  # any constant: keeps warmup prompts apart from measured ones


@dataclass(slots=True)
class BenchConfig:
    backend: str = "grpc"
    target: str = "127.0.0.1:50051"  # grpc: host:port
    base_url: str = "http://127.0.0.1:8000"  # openai
    model_name: str | None = None  # openai: unset asks /v1/models
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    # Open loop at each of these rates; empty: closed loop at `concurrency`.
    rates_rps: list[float] = field(default_factory=list)
    concurrency: int | None = None
    burstiness: float = 1.0
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 2
    seed: int = 0
    # Added to the prompts' content seed (`compare.rate_content_seed`): other token ids,
    # the same lengths and arrival times.
    content_salt: int = 0
    # One SLO for all, or one per class (SLOTable); the gRPC backend sends each request's.
    slo: Objective = field(default_factory=SLO)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # HOST:PORT of pdserve's gateway metrics: report its CPU per generated token.
    gateway_metrics: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: want one of {', '.join(BACKENDS)}")
        if any(r <= 0 for r in self.rates_rps):
            raise ValueError(f"request rates must be > 0, got {self.rates_rps}")
        # Validates the rate/concurrency/length combination once, before any server work.
        self.loads()

    def loads(self) -> list[LoadConfig]:
        rates: list[float | None] = list(self.rates_rps) or [None]
        return [LoadConfig(rate, self.concurrency, self.burstiness, self.num_requests,
                           self.duration_s, self.seed) for rate in rates]


@dataclass(slots=True)
class RunResult:
    load: LoadConfig
    summary: Summary
    records: list[RequestRecord]
    gateway_cpu: GatewayCpu | None = None
    machine: MachineUse | None = None  # what the machine did meanwhile (bench.machine)


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    runs: list[RunResult]

    @property
    def is_sweep(self) -> bool:
        return len(self.runs) > 1 and all(r.load.rate_rps is not None for r in self.runs)

    def distserve_goodput_rps(self) -> float | None:
        if not all(r.load.rate_rps is not None for r in self.runs):
            return None
        return distserve_goodput([SweepPoint(r.load.rate_rps, r.summary.slo_attainment)
                                  for r in self.runs])


def make_backend(cfg: BenchConfig) -> Backend:
    if cfg.backend == "grpc":
        return GrpcBackend(cfg.target, cfg.sampling, cfg.slo)
    return OpenAIBackend(cfg.base_url, cfg.sampling, cfg.model_name)


async def warm_up(backend: Backend, cfg: BenchConfig) -> None:
    """Sends `cfg.warmup` requests at once and drops their records (errors included:
    a server that fails them will fail the measured ones visibly)."""
    if cfg.warmup <= 0:
        return
    specs = take(build_workload(cfg.workload, cfg.seed + WARMUP_SEED_OFFSET, "warmup-"),
                 cfg.warmup)
    await drive(backend, iter(specs), LoadConfig(concurrency=len(specs),
                                                 num_requests=len(specs)))


async def run_load(backend: Backend, cfg: BenchConfig, load: LoadConfig, id_prefix: str,
                   content_seed: int, requests: list[RequestSpec] | None = None) -> RunResult:
    """One measured run of `cfg.workload` under `load` (lengths from `cfg.seed`), or of
    ``requests`` where given; the requests carry `cfg.slo`, the objectives they are judged
    by (a compare's backend is made before its unloaded run sets them: in the interleaved
    compares of 2026-11-30 pdserve's requests carried none, so its admission never acted)."""
    backend.use_slo(cfg.slo)
    if requests is None:
        specs = build_workload(cfg.workload, cfg.seed, id_prefix=id_prefix,
                               content_seed=content_seed)
    else:
        specs = iter(requests)
    before = (await asyncio.to_thread(scrape, cfg.gateway_metrics)
              if cfg.gateway_metrics else None)
    progress = Progress(load.num_requests, load.describe())
    meter = MachineMeter()
    records = await drive(backend, specs, load, progress)
    machine = meter.stop()
    progress.close()
    if machine is not None and machine.steal_cores > STEAL_WARNING_CORES:
        print(f"[bench] warning: the hypervisor took {machine.steal_cores:.2f} cores from this "
              f"machine during {load.describe()}; that measurement ran on less than the machine",
              file=sys.stderr, flush=True)
    summary = summarize_run(records, cfg.slo)
    cpu = None
    if before is not None:
        after = await asyncio.to_thread(scrape, cfg.gateway_metrics)
        cpu = gateway_cpu(before, after, summary.output_tokens)
    return RunResult(load, summary, records, cpu, machine)


async def run_bench(cfg: BenchConfig) -> BenchResult:
    runs = []
    async with make_backend(cfg) as backend:
        await warm_up(backend, cfg)
        for i, load in enumerate(cfg.loads()):
            runs.append(await run_load(backend, cfg, load, f"run{i}-", cfg.seed + i))
    return BenchResult(cfg, runs)

