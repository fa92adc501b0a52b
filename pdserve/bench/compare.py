"""pdserve against colocated vLLM on one machine, one seeded workload, SLOs from the run:
the configuration, one measurement, and the sequential driver (the systems' servers:
`pdserve.bench.systems`).

By default the systems are measured interleaved (`pdserve.bench.interleave`): all of them
are booted first (vLLM, pdserve-fifo, pdserve, whichever `systems` selects), each idle
while another is measured, and the rates of their goodput searches alternate. A shared
machine's speed drifts over minutes (a VM's neighbours); one system measured after the
other puts that drift into the ratio, alternating puts it into both sides. `sequential`
(`run_sequential`, here) boots, measures and stops one system after the other instead (for
a machine that cannot hold all of them).

1. Boot the systems (or use given addresses); warm each up (`BenchConfig.warmup` requests).
2. The first system only (vLLM unless deselected): the unloaded run, a few requests per
   class one at a time at the class's length quantiles, gives the SLOs (3x TTFT p50,
   1.5x TPOT p50 per class, see `calibration`) and the search's start rate (1 / unloaded
   mean E2E) and floor (start / factor). Flags override any of them.
3. The goodput search (`search.RateSearch`), one per system: each measured rate is
   `num_requests` Poisson arrivals, or as many as arrive in `min_duration_s` when that is
   more (`requests_at`), of the same seeded lengths and schedule, so both systems face
   identical requests at a rate; token ids are fresh per rate (no prefix-cache hits
   across rates). pdserve's requests carry their class priority and their class's SLO.
4. Extra rates: pdserve (policy slo) is also measured where pdserve-fifo's interactive
   attainment first fell below 90%, so the two policies compare at the same rate
   (interleaved: on pdserve's next turn after fifo's miss).
5. Interleaved: the unloaded run again on the first system, the same lengths with other
   token ids (`recheck_on`): how far the machine's speed moved during the searches, the
   objectives it would have set, and every measured rate judged again by them.
6. Stop the systems; check nothing is left running.

Time: the whole compare has `budget_s`. Each system gets an equal share of what is left
after the calibration (sequential: of what is left when it starts); a measurement is
started only if its estimated time, its schedule's last arrival plus twice the unloaded E2E
for the drain (`Budget`), fits in the system's share. The recheck (interleaved) runs in what
the searches leave, up to a minute past the budget. A search cut short still reports a value when it has a
bracket (with fewer bisections).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.arrivals import arrival_offsets_s
from pdserve.bench.calibration import Calibration, CalibrationError, calibrate
from pdserve.bench.compare_report import policy_rate
from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.metrics import SLO
from pdserve.bench.presets import class_weights, single_class
from pdserve.bench.recheck import describe_recheck
from pdserve.bench.record import RequestRecord
from pdserve.bench.runner import BenchConfig, RunResult, make_backend, run_load, warm_up
from pdserve.bench.search import RateSearch, SearchConfig, SearchOutcome, round_rate
from pdserve.bench.servers import ServerError, ServerProcess, free_port
from pdserve.bench.systems import bench_config_for, pdserve_spec, vllm_spec
from pdserve.bench.variants import BUILTIN_VARIANTS, Variant
from pdserve.bench.workload import stratified_requests

# The order systems run in: vLLM calibrates; fifo before slo so that pdserve (slo) can be
# measured at the rate where fifo failed its interactive class. Variants (`Variant`,
# pdserve-NAME) run after them, in the order given.
SYSTEMS = ("vllm", "pdserve-fifo", "pdserve")
DEFAULT_NUM_REQUESTS = 40
# Each measured rate lasts at least this long (more requests than `num_requests` at high
# rates): this machine's speed moves by a quarter in phases of tens of seconds, and 40
# short requests at 5-10 req/s arrived in 4-8 s, so one measurement sat in one phase. In
# the sixteenth session three short compares of the same code read 0.50x, 0.996x and
# <= 0.52x; vLLM's attainment at 5 req/s was 65% in one and 100% at 5.4 in the next.
DEFAULT_MIN_DURATION_S = 60.0
DEFAULT_CALIBRATION_REQUESTS = 8
# 38 of the 40 minutes one workload may take: room for a measurement that runs over its
# estimate (an overloaded rate drains at the system's capacity, not at the offered rate)
# and for the last server's shutdown. Less would drop the `long` floor measurement of vLLM
# (about 10 of its 18 minutes), which is what bounds the goodput ratio there.
DEFAULT_BUDGET_S = 38 * 60.0
CALIBRATION_SEED_OFFSET = 2_000_003  # keeps the unloaded run's prompts apart
RECHECK_CONTENT_OFFSET = 7_000_001  # and the end-of-run recheck's from the unloaded run's


def default_systems(workload_name: str) -> tuple[str, ...]:
    return ("vllm", "pdserve-fifo", "pdserve") if workload_name == "mixed" else ("vllm", "pdserve")


@dataclass(slots=True, frozen=True)
class SearchPlan:
    """How the goodput search runs; None: derived from the unloaded run."""

    start_rps: float | None = None
    floor_rps: float | None = None
    factor: float = 2.0
    bisections: int = 2
    max_up_steps: int = 5
    budget_s: float = DEFAULT_BUDGET_S
    calibration_requests: int = DEFAULT_CALIBRATION_REQUESTS

    def __post_init__(self) -> None:
        if self.calibration_requests < 1:
            raise ValueError("the unloaded run needs at least 1 request per class")
        if self.budget_s <= 0:
            raise ValueError(f"time budget must be > 0, got {self.budget_s} s")

    def search_config(self, calibration: Calibration, weights: dict[str, float]) -> SearchConfig:
        start = self.start_rps or round_rate(1.0 / calibration.mean_e2e_s(weights))
        floor = self.floor_rps or round_rate(start / self.factor)
        return SearchConfig(max(start, floor), floor, self.factor, self.bisections,
                            self.max_up_steps)


@dataclass(slots=True)
class CompareConfig:
    # Workload, requests per rate, seed, sampling, and SLO fields given by flags; the
    # rates come from the search, so its load is the unloaded run's (concurrency 1).
    bench: BenchConfig
    model: Path
    workload_name: str = "short"
    systems: tuple[str, ...] = ("vllm", "pdserve")
    plan: SearchPlan = field(default_factory=SearchPlan)
    log_dir: Path = Path("bench-logs")
    # Cores for colocated vLLM (VLLM_CPU_OMP_THREADS_BIND) and its KV cache in GiB.
    vllm_cpus: str = "0-1"
    vllm_kv_cache_gib: int = 2
    # Benchmark servers that are already running instead of starting them.
    pdserve_target: str | None = None
    vllm_url: str | None = None
    boot_timeout_s: float = 600.0
    # One system after the other instead of all booted and their rates alternated.
    sequential: bool = False
    # Interleaved: stop (SIGSTOP) the systems not measuring; False: leave them idle.
    freeze_idle: bool = True
    # Arrivals of each measured rate span at least this long (`requests_at`).
    min_duration_s: float = DEFAULT_MIN_DURATION_S
    # Other pdserves measured beside the default one (pdserve-NAME); `systems` lists them.
    variants: tuple[Variant, ...] = ()
    # Interleaved: the unloaded run again once the searches are over (`recheck_on`).
    recheck: bool = True
    # Interleaved: pdserve-fifo's gateway serves from pdserve's workers ("shared",
    # `pdserve.bench.shared_fifo`) or runs a stack of its own ("own").
    fifo_engines: str = "shared"

    def __post_init__(self) -> None:
        if self.min_duration_s < 0:
            raise ValueError(f"minimum duration per rate must be >= 0 s, got "
                             f"{self.min_duration_s}")
        names = [v.system for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variants {', '.join(names)}: each needs its own name")
        builtin = [BUILTIN_VARIANTS[s] for s in self.systems
                   if s in BUILTIN_VARIANTS and s not in names]
        self.variants = (*self.variants, *builtin)
        self.systems = (*self.systems, *(s for s in names if s not in self.systems))
        known = (*SYSTEMS, *(v.system for v in self.variants))
        unknown = set(self.systems) - set(known)
        if unknown or not self.systems:
            raise ValueError(f"systems {','.join(self.systems)}: want some of "
                             f"{', '.join(SYSTEMS)}, or pdserve-NAME given by --variant NAME=FLAGS"
                             f" ({', '.join(BUILTIN_VARIANTS)} built in)")
        if self.bench.num_requests is None or self.bench.num_requests < 1:
            raise ValueError("compare measures each rate with --num-requests N (N >= 1)")
        if not isinstance(self.bench.slo, SLO):
            raise ValueError("compare takes one given SLO (or none); per-class SLOs are "
                             "calibrated")

    def run_order(self) -> tuple[str, ...]:
        return (*(s for s in SYSTEMS if s in self.systems),
                *(v.system for v in self.variants if v.system in self.systems))

    def fifo_shares_engines(self) -> bool:
        """Whether the compare boots pdserve-fifo as a gateway over pdserve's workers
        (`pdserve.bench.shared_fifo`): interleaved, both systems booted here."""
        return (self.fifo_engines == "shared" and not self.sequential
                and {"pdserve-fifo", "pdserve"} <= set(self.systems)
                and self.given_address("pdserve") is None)

    def variant(self, system: str) -> Variant | None:
        return next((v for v in self.variants if v.system == system), None)

    def given_address(self, system: str) -> str | None:
        """The address of a server the caller runs for this system; None: the compare boots
        it (always a variant's: its flags are what is measured)."""
        if system == "vllm":
            return self.vllm_url
        return None if self.variant(system) is not None else self.pdserve_target


@dataclass(slots=True)
class SystemResult:
    name: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    boot_s: float | None = None
    runs: list[RunResult] = field(default_factory=list)  # in the order measured
    search: SearchOutcome | None = None
    stopped_by_budget: bool = False
    skipped_rates: list[float] = field(default_factory=list)  # extra rates out of time
    error: str | None = None
    # Interleaved: per run (same order), the cores each other booted system used meanwhile.
    others_idle_cores: list[dict[str, float]] = field(default_factory=list)
    # The system whose engines this one's gateway serves from (`shared_fifo`); None: its own.
    engines_of: str | None = None


@dataclass(slots=True)
class CompareResult:
    systems: dict[str, SystemResult] = field(default_factory=dict)
    calibration: Calibration | None = None
    unloaded_records: list[RequestRecord] = field(default_factory=list)
    search: SearchConfig | None = None
    elapsed_s: float = 0.0
    mode: str = "interleaved"
    # Why the compare ran in another mode than asked (interleaved falls back to sequential
    # when the systems would not fit in memory together); None: as asked.
    mode_reason: str | None = None
    # (system, rate) in the order measured, across systems.
    measured_in_order: list[tuple[str, float]] = field(default_factory=list)
    # The unloaded run again after the searches (`recheck_on`), on the same system, and
    # why there is none when there is none.
    recheck: Calibration | None = None
    recheck_records: list[RequestRecord] = field(default_factory=list)
    recheck_note: str | None = None


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- measuring --------------


def describe_routes(records: list[RequestRecord]) -> str:
    """", prefill local 30 / remote 8 / moved 2" from the servers' own account (pdserve's
    trailing metadata); "" when none gave one (vLLM)."""
    counts = Counter(r.route["prefill"] for r in records if "prefill" in r.route)
    if not counts:
        return ""
    return ", prefill " + " / ".join(f"{where} {counts[where]}" for where in sorted(counts))


def rate_content_seed(seed: int, rate_rps: float, salt: int = 0) -> int:
    """Prompt token ids per (seed, rate): every system gets the same prompts at a rate,
    and no rate sees another's in the prefix cache; a system with another ``salt`` gets
    other ids (two systems on one set of engines, `shared_fifo`)."""
    return seed * 1_000_000_007 + round(rate_rps * 1e6) + salt * 10**15


async def unloaded_run(backend, bench: BenchConfig, num_per_class: int,
                       again: bool = False) -> list[RequestRecord]:
    """Each class alone, ``num_per_class`` requests one at a time, their lengths the class's
    length quantiles (`workload.stratified_requests`) where it has one range of lengths,
    else drawn at random. ``again`` (`recheck_on`): the same lengths with other token ids,
    so that the prefix cache holds none of the first run's prompts."""
    records: list[RequestRecord] = []
    run_name = "unloaded run again" if again else "unloaded run"
    for i, name in enumerate(class_weights(bench.workload)):
        cfg = dataclasses.replace(bench, workload=single_class(bench.workload, name))
        seed = bench.seed + CALIBRATION_SEED_OFFSET + i
        content_seed = seed + RECHECK_CONTENT_OFFSET if again else seed
        prefix = f"{'recheck' if again else 'unloaded'}-{name}-"
        requests = stratified_requests(cfg.workload, num_per_class, seed, prefix, content_seed)
        lengths = ("" if requests is None else
                   f" at the class's length quantiles (prompts {requests[0].prompt_len}-"
                   f"{requests[-1].prompt_len} tokens)")
        log(f"{run_name}: {num_per_class} '{name}' requests{lengths}, one at a time")
        load = LoadConfig(concurrency=1, num_requests=num_per_class, seed=bench.seed)
        run = await run_load(backend, cfg, load, prefix, content_seed, requests)
        records.extend(run.records)
    return records


def requests_at(num_requests: int, rate: float, min_duration_s: float) -> int:
    """Requests measured at ``rate``: ``num_requests``, or as many as arrive in
    ``min_duration_s`` on average when that is more. Every system measures the same number
    at a rate, so they still face identical requests."""
    return max(num_requests, math.ceil(rate * min_duration_s - 1e-9))


async def measure(backend, bench: BenchConfig, system: str, rate: float,
                  num_requests: int) -> RunResult:
    load = LoadConfig(rate_rps=rate, burstiness=bench.burstiness,
                      num_requests=num_requests, seed=bench.seed)
    run = await run_load(backend, bench, load, f"{rate:g}-",
                         rate_content_seed(bench.seed, rate, bench.content_salt))
    s = run.summary
    ttft = "-" if s.ttft_s is None else f"{s.ttft_s.p50:.2f}"
    tpot = "-" if s.tpot_s is None else f"{s.tpot_s.p50 * 1000:.0f}"
    log(f"{system} at {rate:g} req/s: SLO attainment {s.slo_attainment:.1%}, "
        f"TTFT p50 {ttft} s, TPOT p50 {tpot} ms, {s.duration_s:.0f} s{describe_routes(run.records)}")
    return run


async def calibrate_on(cfg: CompareConfig, system: str, backend, bench: BenchConfig,
                       out: CompareResult) -> None:
    """The unloaded run on `system`: sets out's SLOs and search; CalibrationError if not."""
    out.unloaded_records = await unloaded_run(backend, bench, cfg.plan.calibration_requests)
    out.calibration = calibrate(out.unloaded_records, system, given=cfg.bench.slo)
    out.search = cfg.plan.search_config(out.calibration, class_weights(bench.workload))
    log_calibration(out.calibration, out.search)


async def recheck_on(cfg: CompareConfig, system: str, backend, bench: BenchConfig,
                     out: CompareResult) -> None:
    """The unloaded run again on `system` once the searches are over, with the same
    lengths and other token ids: how far the machine's speed moved while the systems were
    measured against objectives set at the start. Seen on one machine on one evening, on
    the same lengths: vLLM's unloaded long TTFT p50 read 1.420 s at 15:40 and 1.167-1.256 s
    at 17:00, and two long compares an hour apart read 1.80x and 1.35x under objectives 12%
    apart. CalibrationError if the run fails."""
    bench = dataclasses.replace(bench, slo=cfg.bench.slo)  # as the first run's requests
    out.recheck_records = await unloaded_run(backend, bench, cfg.plan.calibration_requests,
                                             again=True)
    out.recheck = calibrate(out.recheck_records, system, given=cfg.bench.slo)
    assert out.calibration is not None
    for line in describe_recheck(out.calibration, out.recheck):
        log(line)


class Budget:
    """The time a system may still use: its share of the compare's budget, and how many
    requests a rate is measured with (`requests_at`).

    A rate costs the time its last request arrives, plus twice the unloaded E2E for the
    drain. With the load's ``seed`` that is the arrival the schedule will give it (the same
    for every system, `arrivals.arrival_offsets_s`), else the mean, (n - 1) / rate. Seen in a
    long compare on the default seed: 40 arrivals at 0.062 req/s took 771 s against the
    mean's 640 s estimate, so a lower rate a system went down to overran its share and the
    other system's floor measurement no longer fitted."""

    def __init__(self, end_s: float, num_requests: int, unloaded_e2e_s: float,
                 min_duration_s: float = 0.0, burstiness: float = 1.0,
                 seed: int | None = None) -> None:
        self.end_s, self._n, self._drain_s = end_s, num_requests, 2 * unloaded_e2e_s
        self._min_duration_s = min_duration_s
        self._burstiness, self._seed = burstiness, seed

    def requests(self, rate: float) -> int:
        return requests_at(self._n, rate, self._min_duration_s)

    def cost_s(self, rate: float) -> float:
        n = self.requests(rate)
        if self._seed is None or n < 1:
            return (n - 1) / rate + self._drain_s
        return arrival_offsets_s(rate, self._burstiness, self._seed, n)[-1] + self._drain_s

    def fits(self, rate: float, reserve_s: float = 0.0) -> bool:
        return time.monotonic() + self.cost_s(rate) <= self.end_s - reserve_s

    def left_s(self) -> float:
        return self.end_s - time.monotonic()


async def measure_system(cfg: CompareConfig, system: str, address: str, out: CompareResult,
                         result: SystemResult, share_end_s: float) -> None:
    bench = bench_config_for(cfg, system, address)
    warmed = False
    if out.calibration is None:
        async with make_backend(bench) as backend:
            await warm_up(backend, bench)
            warmed = True
            await calibrate_on(cfg, system, backend, bench, out)
    assert out.search is not None
    bench = dataclasses.replace(bench, slo=out.calibration.slos())
    budget = Budget(share_end_s, bench.num_requests or 0,
                    out.calibration.mean_e2e_s(class_weights(bench.workload)),
                    cfg.min_duration_s, bench.burstiness, bench.seed)
    extras = extra_rates(system, out)
    reserve_s = sum(budget.cost_s(r) for r in extras)
    async with make_backend(bench) as backend:
        if not warmed:
            await warm_up(backend, bench)
        search = RateSearch(out.search)
        while (rate := search.next_rate()) is not None:
            if not budget.fits(rate, reserve_s):
                result.stopped_by_budget = True
                log(f"{system}: {rate:g} req/s would take about {budget.cost_s(rate):.0f} s, "
                    f"{budget.left_s() - reserve_s:.0f} s left: search stopped")
                break
            run = await measure(backend, bench, system, rate, budget.requests(rate))
            result.runs.append(run)
            out.measured_in_order.append((system, rate))
            search.record(rate, run.summary.slo_attainment)
        result.search = search.outcome()
        log(f"{system} goodput: {describe_outcome(result.search)}")
        measured = {r.load.rate_rps for r in result.runs}
        for rate in (r for r in extras if r not in measured):
            if budget.fits(rate):
                result.runs.append(await measure(backend, bench, system, rate,
                                                 budget.requests(rate)))
                out.measured_in_order.append((system, rate))
            else:
                result.skipped_rates.append(rate)
                log(f"{system}: no time left for {rate:g} req/s (fifo's policy rate)")


def extra_rates(system: str, out: CompareResult) -> list[float]:
    fifo = out.systems.get("pdserve-fifo")
    if system != "pdserve" or fifo is None:
        return []
    rate = policy_rate(fifo.runs)
    return [] if rate is None else [rate]


def describe_outcome(outcome: SearchOutcome) -> str:
    if outcome.goodput_rps is not None:
        lo, hi = outcome.bracket or (None, None)
        return (f"{outcome.goodput_rps:.3g} req/s (between {lo.rate_rps:g} and {hi.rate_rps:g}"
                f", {outcome.bisections_done} bisections)")
    if outcome.bound_rps is None:
        return "not measured"
    return f"{outcome.bound_kind} {outcome.bound_rps:g} req/s ({outcome.status.value})"


def log_calibration(calibration: Calibration, search: SearchConfig) -> None:
    slos = calibration.slos()
    for name, u in calibration.unloaded.items():
        slo = slos.of(name)
        log(f"unloaded '{name}' on {calibration.source}: TTFT p50 {u.ttft_p50_s:.3f} s, TPOT p50 "
            f"{u.tpot_p50_s * 1000:.1f} ms, E2E p50 {u.e2e_p50_s:.2f} s -> SLO TTFT "
            f"{slo.ttft_s:.3f} s, TPOT {slo.tpot_s * 1000:.1f} ms")
    log(f"search: start {search.start_rps:g} req/s, floor {search.floor_rps:g}, factor "
        f"{search.factor:g}, {search.bisections} bisections, ceiling {search.ceiling_rps:g}")


# ---------------------------------------------------------------- the compare ------------


def run_system(cfg: CompareConfig, system: str, out: CompareResult,
               share_end_s: float) -> SystemResult:
    """Boots (unless given an address), measures and stops one system; never raises for a
    server that fails, so the next system still runs and the failure is reported."""
    result = SystemResult(system)
    existing = cfg.given_address(system)
    try:
        if existing is not None:
            asyncio.run(measure_system(cfg, system, existing, out, result, share_end_s))
            return result
        port = free_port()
        spec = vllm_spec(cfg, port) if system == "vllm" else pdserve_spec(cfg, port, system)
        result.command, result.env = spec.argv, spec.env
        address = f"http://127.0.0.1:{port}" if system == "vllm" else f"127.0.0.1:{port}"
        log(f"starting {system}: {' '.join(spec.argv)}")
        with ServerProcess(spec, cfg.log_dir / f"{system}.log") as server:
            result.boot_s = server.boot_s
            log(f"{system} ready in {server.boot_s:.0f} s")
            asyncio.run(measure_system(cfg, system, address, out, result, share_end_s))
    except (ServerError, OSError, CalibrationError) as e:
        result.error = str(e)
        log(f"{system} failed: {e}")
    return result


def run_sequential(cfg: CompareConfig) -> CompareResult:
    """One system after the other (`CompareConfig.sequential`); the default, all booted
    and their rates alternated, is `pdserve.bench.interleave.run_interleaved`."""
    out = CompareResult(mode="sequential")
    if cfg.recheck:
        out.recheck_note = (f"not run: one system at a time, {cfg.run_order()[0]} is stopped "
                            "before the others are measured")
    started = time.monotonic()
    deadline = started + cfg.plan.budget_s
    order = cfg.run_order()
    for k, system in enumerate(order):
        if k and out.calibration is None:
            out.systems[system] = SystemResult(system, error="no SLOs: the unloaded run on "
                                               f"{order[0]} failed")
            continue
        share_end = time.monotonic() + (deadline - time.monotonic()) / (len(order) - k)
        out.systems[system] = run_system(cfg, system, out, share_end)
    out.elapsed_s = time.monotonic() - started
    return out
