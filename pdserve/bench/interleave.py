"""The interleaved compare (the default): every system booted, their rates taking turns.

All systems are booted first and stay up; the first one's unloaded run sets the SLOs and
the search (`compare.calibrate_on`); then each system in turn (vLLM, pdserve-fifo,
pdserve, then the reverse, round after round) measures its search's next rate while the
others wait frozen (SIGSTOP,
`--idle-systems freeze`, the default; an idle pdserve stack took 4-8% of a core beside
vLLM's turns, an idle vLLM 1-2% beside pdserve's), so a machine whose speed drifts over
minutes slows both sides of the ratio alike and no system's idle polling slows another.
Each system's time share is counted in its own measurements only (`compare.Budget`, moved
on by the time the others take). pdserve measures pdserve-fifo's policy rate on its next
turn after fifo's miss (with time from the others' unspent shares when its own has too
little: `borrow`), and its search reuses that measurement if it asks for the same rate.
The CPU the idle systems used during each measurement is kept with it
(`SystemResult.others_idle_cores`: zero when frozen). Once every search is over, the first
system runs its unloaded run again (`recheck`) in the time they left, so the JSON says how
far the machine moved between the objectives' run and the end.

pdserve-fifo is, by default (`--fifo-engines shared`), a second gateway over pdserve's
workers (`pdserve.bench.shared_fifo`): it boots after pdserve, and pdserve's stack is not
frozen for fifo's turns (`Lane.needs`); the idle cost reported for pdserve then is its
gateway's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass

from pdserve.bench.calibration import CalibrationError
from pdserve.bench import shared_fifo
from pdserve.bench.compare import (Budget, CompareConfig, CompareResult, SystemResult,
                                   calibrate_on, describe_outcome, extra_rates, log, measure,
                                   recheck_on, run_sequential)
from pdserve.bench.presets import class_weights
from pdserve.bench.runner import BenchConfig, RunResult, make_backend, warm_up
from pdserve.bench.search import RateSearch, loans_for
from pdserve.bench.servers import ServerError, ServerProcess, ServerSpec, free_port, tree_cpu_s
from pdserve.bench.shared_fifo import SharedFifoError
from pdserve.bench.systems import bench_config_for, pdserve_spec, shared_fifo_spec, vllm_spec

# After a frozen system is thawed, time for its timers to run (pdserve's gateway re-reads
# its workers' heartbeats, every second) before its readiness is checked and it is measured.
THAW_SETTLE_S = 3.0

# The unloaded run again at the end may start this long after the compare's deadline (of
# the budget's 2 minutes kept for a measurement that runs over and the last shutdown).
RECHECK_OVERRUN_S = 60.0

# An idle system using more than this (cores, averaged over another's measurement) is
# logged: that measurement did not have the machine to itself.
IDLE_CORES_WARNING = 0.05


def engines(system: str) -> int:
    """Engines a system runs: vLLM one; each pdserve (the compare starts it with one worker
    per tier) two. A pdserve-fifo on pdserve's engines runs none (not counted at all)."""
    return 1 if system == "vllm" else 2


# The systems still to boot must fit in the memory available with this much to spare, each
# engine taking what the first booted system's engines took. Their KV caches fill as they
# serve, so a tight fit at boot is not one under load.
MEMORY_HEADROOM = 1.25


def fits_in_memory(first: str, first_took_bytes: int, rest: list[str],
                   available_bytes: int) -> tuple[bool, int]:
    """Whether the systems in ``rest`` fit in ``available_bytes``, each engine taking what
    ``first``'s took at boot; and the bytes they need."""
    per_engine = first_took_bytes / engines(first)
    need = round(per_engine * sum(engines(s) for s in rest) * MEMORY_HEADROOM)
    return available_bytes >= need, need


def mem_available_bytes() -> int | None:
    """The kernel's estimate of memory available to new work; None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def no_room_reason(booted: str, before_bytes: int | None, after_bytes: int | None,
                   rest: list[str]) -> str | None:
    """Why the systems in ``rest`` cannot boot beside ``booted``, which took what
    MemAvailable fell by while it booted; None: they fit (or memory is not known)."""
    if not rest or before_bytes is None or after_bytes is None:
        return None
    took = max(before_bytes - after_bytes, 0)
    fits, need = fits_in_memory(booted, took, rest, after_bytes)
    if fits:
        return None
    return (f"{', '.join(rest)} would need about {need / 2**30:.1f} GiB beside {booted} "
            f"({took / 2**30:.1f} GiB at boot), {after_bytes / 2**30:.1f} GiB is available")


@dataclass(slots=True)
class Lane:
    """One booted system in the interleaved compare: its search and its time share."""

    result: SystemResult
    bench: BenchConfig
    backend: object
    server: ServerProcess | None  # None: a given address (neither frozen nor its CPU read)
    search: RateSearch | None = None
    budget: Budget | None = None
    done: bool = False
    freezable: bool = False  # stopped while another system measures (`--idle-systems freeze`)
    frozen: bool = False
    # The lanes whose servers this one's gateway needs running (`shared_fifo`: fifo needs
    # pdserve's stack); they are thawed for its turns, not frozen.
    needs: tuple[str, ...] = ()
    # While a lane that needs this one measures, the process whose CPU is this one's idle
    # cost (pdserve's gateway, its workers doing the other's work); None: not measured.
    idle_pid_when_lent: int | None = None

    @property
    def pid(self) -> int | None:
        return None if self.server is None else self.server.pid

    @property
    def name(self) -> str:
        return self.result.name

    def idle_pid(self, measuring: Lane) -> int | None:
        """The process tree whose CPU is this lane's idle cost while ``measuring`` measures."""
        return self.idle_pid_when_lent if self.name in measuring.needs else self.pid

    def measured(self) -> dict[float, RunResult]:
        return {r.load.rate_rps: r for r in self.result.runs}


def run_interleaved(cfg: CompareConfig) -> CompareResult:
    """Boots every system, then measures them in turns (see the module's docstring).

    When the systems left to boot would not fit in memory beside the first one (each engine
    taking what the first one's took), it stops that one and measures one system at a time
    instead (`compare.run_sequential`), saying why in the log and the JSON: seen on a 24 GiB
    machine, the mixed compare's five engines booted at once and the kernel killed one."""
    out = CompareResult(mode="interleaved")
    started = time.monotonic()
    deadline = started + cfg.plan.budget_s
    booted: dict[str, tuple[str, ServerProcess | None]] = {}  # system -> (address, server)
    order = cfg.run_order()
    shared = cfg.fifo_shares_engines()
    with contextlib.ExitStack() as servers:
        for k, system in enumerate(boot_order(order, shared)):
            result = out.systems[system] = SystemResult(system)
            existing = cfg.given_address(system)
            if existing is not None:
                booted[system] = (existing, None)
                continue
            port = free_port()
            try:
                spec = system_spec(cfg, port, system, booted if shared else None)
            except SharedFifoError as e:
                result.error = str(e)
                log(f"{system} failed: {e}")
                continue
            if shared and system == shared_fifo.SYSTEM:
                result.engines_of = shared_fifo.HOST
            result.command, result.env = spec.argv, spec.env
            log(f"starting {system}: {' '.join(spec.argv)}")
            available = mem_available_bytes()
            try:
                server = servers.enter_context(ServerProcess(spec, cfg.log_dir / f"{system}.log"))
            except (ServerError, OSError) as e:
                result.error = str(e)
                log(f"{system} failed: {e}")
                continue
            result.boot_s = server.boot_s
            log(f"{system} ready in {server.boot_s:.0f} s")
            address = f"http://127.0.0.1:{port}" if system == "vllm" else f"127.0.0.1:{port}"
            booted[system] = (address, server)
            if len(booted) > 1:
                continue
            rest = [s for s in boot_order(order, shared)[k + 1:]
                    if cfg.given_address(s) is None and not (shared and s == shared_fifo.SYSTEM)]
            reason = no_room_reason(system, available, mem_available_bytes(), rest)
            if reason is not None:
                servers.close()
                log(f"{reason}: measuring one system at a time instead (--sequential)")
                left_s = cfg.plan.budget_s - (time.monotonic() - started)
                fallback = run_sequential(dataclasses.replace(
                    cfg, sequential=True, plan=dataclasses.replace(cfg.plan, budget_s=left_s)))
                fallback.mode_reason = reason
                fallback.elapsed_s = time.monotonic() - started
                return fallback
        out.systems = {s: out.systems[s] for s in order}
        booted = {s: booted[s] for s in order if s in booted}
        if booted:
            asyncio.run(measure_interleaved(cfg, booted, out, deadline))
    out.elapsed_s = time.monotonic() - started
    return out


def boot_order(order: tuple[str, ...], shared: bool) -> list[str]:
    """The systems in the order they boot: ``order``, but with a shared pdserve-fifo after
    the pdserve whose workers it serves from."""
    if not shared:
        return list(order)
    rest = [s for s in order if s != shared_fifo.SYSTEM]
    at = rest.index(shared_fifo.HOST) + 1
    return [*rest[:at], shared_fifo.SYSTEM, *rest[at:]]


def system_spec(cfg: CompareConfig, port: int, system: str,
                shared_with: dict[str, tuple[str, ServerProcess | None]] | None) -> ServerSpec:
    """How ``system`` is started; with ``shared_with`` (the systems booted so far), a
    pdserve-fifo is a gateway over the booted pdserve's workers (SharedFifoError if
    pdserve did not boot or has none ready)."""
    if system == "vllm":
        return vllm_spec(cfg, port)
    if shared_with is not None and system == shared_fifo.SYSTEM:
        if shared_fifo.HOST not in shared_with:
            raise SharedFifoError(f"{shared_fifo.HOST} did not boot: {system}'s gateway "
                                  f"serves from its workers")
        return shared_fifo_spec(cfg, port, shared_with[shared_fifo.HOST][0])
    return pdserve_spec(cfg, port, system)


async def measure_interleaved(cfg: CompareConfig,
                              booted: dict[str, tuple[str, ServerProcess | None]],
                              out: CompareResult, deadline: float) -> None:
    async with contextlib.AsyncExitStack() as stack:
        lanes: list[Lane] = []
        for system, (address, server) in booted.items():
            bench = bench_config_for(cfg, system, address)
            backend = await stack.enter_async_context(make_backend(bench))
            lane = Lane(out.systems[system], bench, backend, server,
                        freezable=cfg.freeze_idle and server is not None)
            try:
                await warm_up(backend, bench)
            except OSError as e:
                lane.result.error = f"warm-up failed: {e}"
                log(f"{system} failed: {lane.result.error}")
                continue
            lanes.append(lane)
        if not lanes:
            return
        lend_engines(lanes, out)
        first = lanes[0]
        await take_the_machine(first, lanes)
        calibrating = time.monotonic()
        try:
            await calibrate_on(cfg, first.name, first.backend, first.bench, out)
        except CalibrationError as e:
            first.result.error = str(e)
            log(f"{first.name} failed: {e}")
            for lane in lanes[1:]:
                lane.result.error = f"no SLOs: the unloaded run on {first.name} failed"
            return
        assert out.calibration is not None and out.search is not None
        # The recheck takes what the unloaded run took. It is not kept out of the shares: a
        # search's rate says more than it does (`recheck`).
        recheck_s = time.monotonic() - calibrating + THAW_SETTLE_S
        weights = class_weights(cfg.bench.workload)
        share_s = (deadline - time.monotonic()) / len(lanes)
        for lane in lanes:
            lane.bench = dataclasses.replace(lane.bench, slo=out.calibration.slos())
            lane.search = RateSearch(out.search)
            lane.budget = Budget(time.monotonic() + share_s, cfg.bench.num_requests or 0,
                                 out.calibration.mean_e2e_s(weights), cfg.min_duration_s,
                                 cfg.bench.burstiness, cfg.bench.seed)
        await alternate(lanes, out)
        if cfg.recheck:
            await recheck(cfg, first, lanes, out, deadline + RECHECK_OVERRUN_S - recheck_s)


async def recheck(cfg: CompareConfig, first: Lane, lanes: list[Lane], out: CompareResult,
                  latest_s: float) -> None:
    """The unloaded run again on the system that calibrated (`compare.recheck_on`), unless
    it is past ``latest_s`` or that system failed. Its time is what the searches leave,
    and up to RECHECK_OVERRUN_S past the deadline: a search's next rate comes first, as it
    decides whether a goodput is a value or a bound (in the first long compare that kept
    the recheck's time out of the shares, vLLM's floor rate missed its share by 2 s)."""
    if first.result.error is not None:
        out.recheck_note = f"not run: {first.name} failed ({first.result.error})"
    elif time.monotonic() > latest_s:
        out.recheck_note = "not run: the searches left no time for it"
    if out.recheck_note is not None:
        log(f"unloaded run again at the end: {out.recheck_note}")
        return
    await take_the_machine(first, lanes)
    try:
        await recheck_on(cfg, first.name, first.backend, first.bench, out)
    except (CalibrationError, OSError) as e:
        out.recheck_note = f"failed: {e}"
        log(f"unloaded run again at the end {out.recheck_note}")


def lend_engines(lanes: list[Lane], out: CompareResult) -> None:
    """Marks the lanes whose gateway serves from another's workers (`SystemResult.engines_of`)
    as needing that lane running, and finds the gateway of the lane that lends them."""
    by_name = {lane.name: lane for lane in lanes}
    for lane in lanes:
        host = by_name.get(out.systems[lane.name].engines_of or "")
        if host is None:
            continue
        lane.needs = (host.name,)
        if host.pid is not None:
            host.idle_pid_when_lent = shared_fifo.gateway_pid(host.pid)


async def alternate(lanes: list[Lane], out: CompareResult) -> None:
    """Rounds of turns until every search is over (or out of its share): in `lanes`' order,
    then the reverse, and so on (A B, B A, A B ...), so that no system always measures
    first in a round: on this machine a minute can decode 25% slower than the next
    (docs/benchmarks.md, "Sixteenth session"), and an ABBA order cancels a steady drift
    between two rounds."""
    order = lanes
    while not all(lane.done for lane in lanes):
        progressed = False
        for lane in order:
            if not lane.done and await take_turn(lane, lanes, out):
                progressed = True
        if not progressed:
            break
        order = order[::-1]
    for lane in lanes:
        assert lane.search is not None
        lane.result.search = lane.search.outcome()
        log(f"{lane.name} goodput: {describe_outcome(lane.result.search)}")


def borrow(lane: Lane, lanes: list[Lane], rate: float, policy_rate: bool = False) -> bool:
    """A search going down, or pdserve at fifo's ``policy_rate``, takes the time that rate
    needs from the others' shares (`search.loans_for`); False when it is neither or they
    cannot cover it. The policy rate is the figure a mixed compare exists for: seen in the
    mixed compare, fifo missed at 0.237 req/s and at its 0.118 floor, pdserve's share had
    spent itself climbing to 0.474 and could not hold 0.118 (340 s) while fifo's, its search
    over, had time to spare, and the JSON gave no policy figure at that rate."""
    assert lane.search is not None and lane.budget is not None
    lenders = [x for x in lanes if x is not lane and x.budget is not None]
    if not (policy_rate or lane.search.going_down) or not lenders:
        return False
    needed_s = lane.budget.cost_s(rate) - lane.budget.left_s()
    loans = loans_for(needed_s, [x.budget.left_s() for x in lenders])
    if loans is None:
        return False
    for lender, loan in zip(lenders, loans, strict=True):
        lender.budget.end_s -= loan
    lane.budget.end_s += needed_s
    log(f"{lane.name}: {rate:g} req/s would take about {lane.budget.cost_s(rate):.0f} s, more "
        f"than its share has left; {needed_s:.0f} s taken from "
        + ", ".join(f"{x.name}'s share ({loan:.0f} s)" for x, loan in zip(lenders, loans,
                                                                             strict=True))
        + (": fifo's policy rate" if policy_rate else ": a lower rate says more than a higher one"))
    return True


async def take_turn(lane: Lane, lanes: list[Lane], out: CompareResult) -> bool:
    """Measures `lane`'s next rate (an extra rate first); False when it had nothing to do
    now (it is done, or waits for fifo's search to say whether it has a policy rate)."""
    assert lane.search is not None and lane.budget is not None
    measured = lane.measured()
    extras = [r for r in extra_rates(lane.name, out)
              if r not in measured and r not in lane.result.skipped_rates]
    if extras and not lane.budget.fits(extras[0]) and not borrow(lane, lanes, extras[0], policy_rate=True):
        log(f"{lane.name}: no time left for {extras[0]:g} req/s (fifo's policy rate)")
        lane.result.skipped_rates.append(extras[0])
        extras = []
    rate = extras[0] if extras else lane.search.next_rate()
    while not extras and rate is not None and rate in measured:  # measured as an extra
        lane.search.record(rate, measured[rate].summary.slo_attainment)
        rate = lane.search.next_rate()
    if rate is None:
        fifo = next((x for x in lanes if x.name == "pdserve-fifo"), None)
        waits = lane.name == "pdserve" and fifo is not None and not fifo.done
        lane.done = not waits
        return False
    if not extras and not lane.budget.fits(rate) and not borrow(lane, lanes, rate):
        log(f"{lane.name}: {rate:g} req/s would take about {lane.budget.cost_s(rate):.0f} s, "
            f"{lane.budget.left_s():.0f} s left of its share: search stopped")
        lane.result.stopped_by_budget = True
        lane.done = True
        return False
    others = {x.name: pid for x in lanes
              if x is not lane and (pid := x.idle_pid(lane)) is not None}
    started = time.monotonic()
    await take_the_machine(lane, lanes)
    cpu_before = {name: tree_cpu_s(pid) for name, pid in others.items()}
    measuring = time.monotonic()
    run = await measure(lane.backend, lane.bench, lane.name, rate, lane.budget.requests(rate))
    ended = time.monotonic()
    took = ended - started  # the thaw's too: this system's time, not the others'
    idle = {name: round((tree_cpu_s(pid) - cpu_before[name]) / (ended - measuring), 4)
            for name, pid in others.items()}
    for name, cores in idle.items():
        if cores > IDLE_CORES_WARNING:
            log(f"warning: {name} used {cores:.2f} cores while idle during {lane.name}'s "
                f"{rate:g} req/s; that measurement shared the machine")
    lane.result.runs.append(run)
    lane.result.others_idle_cores.append(idle)
    out.measured_in_order.append((lane.name, rate))
    if not extras:
        lane.search.record(rate, run.summary.slo_attainment)
    for other in lanes:  # time one system measures is not taken from the others' shares
        if other is not lane and other.budget is not None:
            other.budget.end_s += took
    return True


async def take_the_machine(lane: Lane, lanes: list[Lane]) -> None:
    """Freezes every other freezable system that ``lane`` does not need, and thaws those it
    needs and then ``lane`` if they were frozen, waiting until each answers its readiness
    check again (`ServerProcess.thaw`)."""
    for other in lanes:
        if (other is not lane and other.name not in lane.needs and other.freezable
                and not other.frozen):
            assert other.server is not None
            other.server.freeze()
            other.frozen = True
    for x in [*(other for other in lanes if other.name in lane.needs), lane]:
        if x.frozen:
            assert x.server is not None
            thawed = time.monotonic()
            await asyncio.to_thread(x.server.thaw, THAW_SETTLE_S)
            x.frozen = False
            log(f"{x.name} thawed, ready in {time.monotonic() - thawed:.1f} s")
