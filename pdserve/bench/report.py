"""Results out: a terminal table, a JSON document and PNG plots.

JSON keeps every number in seconds (names end in ``_s``); the table shows milliseconds,
which is the scale these latencies are read at. Plots need matplotlib (the ``dev``
extra); it is imported only when plots are asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.metrics import LatencyStats, Summary
from pdserve.bench.runner import BenchResult, RunResult

LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))


# ---------------------------------------------------------------- JSON -------------------


def summary_dict(summary: Summary) -> dict:
    return dataclasses.asdict(summary)


def run_dict(run: RunResult, include_records: bool = False) -> dict:
    out = {"load": dataclasses.asdict(run.load), "summary": summary_dict(run.summary),
           "gateway_cpu": None if run.gateway_cpu is None else dataclasses.asdict(run.gateway_cpu),
           "machine": None if run.machine is None else dataclasses.asdict(run.machine)}
    if include_records:
        out["records"] = [dataclasses.asdict(r) for r in run.records]
    return out


def result_dict(result: BenchResult, include_records: bool = False) -> dict:
    cfg = result.config
    return {
        "backend": cfg.backend,
        "target": cfg.target if cfg.backend == "grpc" else cfg.base_url,
        "workload": jsonable(dataclasses.asdict(cfg.workload)),
        "seed": cfg.seed,
        "slo": dataclasses.asdict(cfg.slo),
        "sampling": dataclasses.asdict(cfg.sampling),
        "warmup": cfg.warmup,
        "distserve_goodput_rps": result.distserve_goodput_rps(),
        "runs": [run_dict(r, include_records) for r in result.runs],
    }


def jsonable(value: object) -> object:
    """Paths as strings; everything else dataclasses.asdict already made plain."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# ---------------------------------------------------------------- table ------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def latency_rows(summary: Summary, prefix: str = "") -> list[str]:
    rows = []
    for label, attr in LATENCIES:
        stats: LatencyStats | None = getattr(summary, attr)
        if stats is None:
            rows.append(f"{prefix + label:<24}{'-':>10}{'-':>10}{'-':>10}{'-':>10}")
            continue
        rows.append(f"{prefix + label:<24}{_ms(stats.mean):>10}{_ms(stats.p50):>10}"
                    f"{_ms(stats.p90):>10}{_ms(stats.p99):>10}")
    return rows


def format_summary(summary: Summary, title: str) -> str:
    s = summary
    lines = [
        f"== {title} ==",
        f"requests: {s.num_ok}/{s.num_requests} ok in {s.duration_s:.1f} s"
        + (f"; errors: {', '.join(f'{k} x{v}' for k, v in s.errors.items())}" if s.errors
           else ""),
        f"throughput: {s.request_throughput_rps:.3f} req/s, {s.output_tok_s:.1f} output tok/s"
        f"; goodput {s.request_goodput_rps:.3f} req/s (SLO attainment {s.slo_attainment:.1%})",
        f"{'latency (ms)':<24}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
        *latency_rows(s),
    ]
    for name, cls in s.by_class.items():
        lines.append(f"-- class {name}: {cls.num_ok}/{cls.num_requests} ok, "
                     f"goodput {cls.request_goodput_rps:.3f} req/s "
                     f"(attainment {cls.slo_attainment:.1%})")
        lines.extend(latency_rows(cls, prefix="  "))
    return "\n".join(lines)


SWEEP_HEADER = (f"{'rate':>6} {'ok':>7} {'attain':>7} {'goodput':>8} {'tok/s':>7} "
                f"{'TTFT50':>8} {'TTFT99':>8} {'TPOT50':>8} {'TPOT99':>8}")


def sweep_row(run: RunResult) -> str:
    s = run.summary
    rate = "-" if run.load.rate_rps is None else f"{run.load.rate_rps:g}"

    def stat(attr: str, q: str) -> str:
        stats = getattr(s, attr)
        return _ms(None if stats is None else getattr(stats, q))

    return (f"{rate:>6} {f'{s.num_ok}/{s.num_requests}':>7} {s.slo_attainment:>7.1%} "
            f"{s.request_goodput_rps:>8.3f} {s.output_tok_s:>7.1f} "
            f"{stat('ttft_s', 'p50'):>8} {stat('ttft_s', 'p99'):>8} "
            f"{stat('tpot_s', 'p50'):>8} {stat('tpot_s', 'p99'):>8}")


def gateway_cpu_line(run: RunResult) -> str:
    cpu = run.gateway_cpu
    if cpu is None:
        return ""
    per_token = "-" if cpu.us_per_token is None else f"{cpu.us_per_token:.0f}"
    pool = "-" if cpu.pool_cpu_s is None else f"{cpu.pool_cpu_s:.2f}"
    return (f"\ngateway CPU: {per_token} us per output token ({cpu.gateway_cpu_s:.2f} s "
            f"gateway, {pool} s pool, {cpu.output_tokens} tokens; {cpu.note})")


def format_result(result: BenchResult) -> str:
    parts = [format_summary(r.summary, r.load.describe()) + gateway_cpu_line(r)
             for r in result.runs]
    if result.is_sweep:
        parts.append("== sweep (latencies in ms, goodput in req/s) ==\n" + SWEEP_HEADER + "\n"
                     + "\n".join(sweep_row(r) for r in result.runs))
        parts.append(f"DistServe goodput (>= 90% of requests within SLO): "
                     f"{result.distserve_goodput_rps():.3f} req/s")
    return "\n\n".join(parts)


# ---------------------------------------------------------------- plots ------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    return plt


def _latency_values(run: RunResult, attr: str) -> list[float]:
    ok = [r for r in run.records if r.ok]
    if attr == "itl_s":
        return sorted(x for r in ok for x in r.itls_s())
    return sorted(v for r in ok if (v := getattr(r, attr)) is not None)


def _run_label(run: RunResult) -> str:
    if run.load.rate_rps is None:
        return f"concurrency {run.load.concurrency}"
    return f"{run.load.rate_rps:g} req/s"


def plot_cdfs(series: dict[str, Sequence[RunResult]], path: Path) -> None:
    """One panel per latency; one line per (system, run)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (label, attr) in zip(axes.flat, LATENCIES):
        for system, runs in series.items():
            for run in runs:
                values = _latency_values(run, attr)
                if not values:
                    continue
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                name = _run_label(run) if len(series) == 1 else f"{system} {_run_label(run)}"
                ax.step(values, fractions, where="post", label=name)
        ax.set_xlabel(f"{label} (s)")
        ax.set_ylabel("fraction of requests" if attr != "itl_s" else "fraction of tokens")
        ax.set_title(f"{label} CDF")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(series: dict[str, Sequence[RunResult]], path: Path) -> None:
    """Request goodput and p99 TTFT against the offered request rate."""
    plt = _pyplot()
    fig, (ax_goodput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for system, runs in series.items():
        rates = [r.load.rate_rps for r in runs]
        ax_goodput.plot(rates, [r.summary.request_goodput_rps for r in runs], "o-",
                        label=system)
        ttft = [(r.load.rate_rps, r.summary.ttft_s.p99) for r in runs if r.summary.ttft_s]
        ax_ttft.plot([x for x, _ in ttft], [y for _, y in ttft], "o-", label=system)
    ax_goodput.set(xlabel="request rate (req/s)", ylabel="goodput (req/s within SLO)",
                   title="goodput vs request rate")
    ax_ttft.set(xlabel="request rate (req/s)", ylabel="p99 TTFT (s)",
                title="p99 TTFT vs request rate")
    for ax in (ax_goodput, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(series: dict[str, Sequence[RunResult]], plot_dir: Path) -> list[Path]:
    """latency_cdf.png always; sweep.png when some system ran more than one rate."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_dir / "latency_cdf.png"]
    plot_cdfs(series, paths[0])
    if any(len(runs) > 1 and all(r.load.rate_rps is not None for r in runs)
           for runs in series.values()):
        paths.append(plot_dir / "sweep.png")
        plot_sweep(series, paths[1])
    return paths
