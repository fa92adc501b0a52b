"""`pdserve bench`: run, compare and kv subcommands.

`register(subparsers)` adds ``bench`` to the top-level ``pdserve`` parser; each
subcommand's ``func`` takes the parsed args and returns an exit code. Flags become one
`BenchConfig` (or `CompareConfig`) here and nowhere else. Heavy imports (matplotlib,
transformers, kvtransfer.bench and its torch) happen only in the command that needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.backends import SamplingConfig
from pdserve.bench.metrics import SLO, SLOTable
from pdserve.bench.presets import PRESET_NAMES, preset_workload
from pdserve.bench.runner import BenchConfig
from pdserve.bench.workload import (
    WORKLOAD_KINDS,
    LengthRange,
    WorkloadConfig,
    default_classes,
    parse_class_mix,
)

if TYPE_CHECKING:
    from pdserve.bench.compare import CompareConfig

EPILOG = """examples:
  pdserve bench run --target 127.0.0.1:50051 --rate 1 --num-requests 100
  pdserve bench run --rates 0.25,0.5,1,1.5 --slo-ttft-s 2 --slo-tpot-s 0.25 --plot-dir plots
  pdserve bench run --backend openai --base-url http://127.0.0.1:8000 --concurrency 8
  pdserve bench run --workload mixed --rate 0.3 --gateway-metrics 127.0.0.1:9400
  pdserve bench compare --workload long --json long.json --plot-dir plots
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="load-test pdserve or an OpenAI-compatible server",
        description="Benchmarks: latency, throughput and goodput under load.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = bench.add_subparsers(dest="bench_command", metavar="{run,compare,kv,handoff}")
    bench.set_defaults(func=lambda args: _usage(bench))

    run = commands.add_parser("run", help="benchmark one running server",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_target_args(run)
    run.add_argument("--gateway-metrics", metavar="HOST:PORT",
                     help="pdserve gateway's metrics address: report its CPU per output token")
    _add_load_args(run, rates_default=None)
    _add_workload_args(run)
    _add_output_args(run)
    run.set_defaults(func=cmd_run)

    compare = commands.add_parser(
        "compare", help="pdserve vs colocated vLLM on the same workload (starts both)",
        description="Goodput found by search, SLOs from vLLM's unloaded latencies in the same "
                    "run. Default: --workload short, systems vllm,pdserve (mixed: also "
                    "pdserve-fifo: --policy fifo --local-prefill-max-tokens 0).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_compare_args(compare)
    _add_load_args(compare, rates_default=None, open_loop=False)
    _add_search_args(compare)
    _add_workload_args(compare)
    _add_output_args(compare)
    compare.set_defaults(func=cmd_compare, num_requests=40)

    # kvtransfer.bench (and torch) load only when this runs; its flags are parsed then,
    # so every argument is taken as is here ("\0" as prefix: nothing looks like a flag).
    kv = commands.add_parser("kv", help="KV transfer microbenchmark (kvtransfer.bench); "
                             "`pdserve bench kv --help` for its flags",
                             add_help=False, prefix_chars="\0")
    kv.add_argument("kv_args", nargs="*")
    kv.set_defaults(func=cmd_kv)

    from pdserve.bench import handoff

    share = commands.add_parser(
        "handoff", help="the KV handoff's share of a long prompt's TTFT, per transport (starts a worker pair)",
        description=handoff.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    handoff.add_arguments(share)
    share.set_defaults(func=handoff.run)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"want comma-separated numbers, got {text!r}") from e


def _class_slos(text: str) -> dict[str, SLO]:
    """``interactive=0.4:0.04,offline=3:`` -> {"interactive": SLO(0.4, 0.04), "offline": SLO(3.0, None)}."""
    out: dict[str, SLO] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, eq, objectives = item.partition("=")
        ttft, colon, tpot = objectives.partition(":")
        try:
            if not (name.strip() and eq and colon):
                raise ValueError
            slo = SLO(float(ttft) if ttft.strip() else None, float(tpot) if tpot.strip() else None)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: want CLASS=TTFT_S:TPOT_S in seconds, e.g. interactive=0.4:0.04 "
                "(either side may be empty)") from None
        if any(v is not None and v <= 0 for v in (slo.ttft_s, slo.tpot_s)):
            raise argparse.ArgumentTypeError(f"{item!r}: objectives must be > 0 s")
        out[name.strip()] = slo
    if not out:
        raise argparse.ArgumentTypeError("want at least one CLASS=TTFT_S:TPOT_S")
    return out


def _length_range(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    g.add_argument("--target", default="127.0.0.1:50051",
                   help="grpc: address of pdserve's Generation service")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="openai: server root (POST {base-url}/v1/completions)")
    g.add_argument("--model-name", help="openai: model field; unset: the first of /v1/models")


def _add_load_args(p: argparse.ArgumentParser, rates_default: str | None,
                   open_loop: bool = True) -> None:
    """`open_loop`: the flags that choose the load (compare's search chooses its own)."""
    g = p.add_argument_group("load")
    if open_loop:
        g.add_argument("--rate", type=float, help="open loop: mean request rate (req/s)")
        g.add_argument("--rates", type=_floats, default=_floats(rates_default or ""),
                       help="open loop sweep: comma-separated request rates (req/s)")
        g.add_argument("--concurrency", type=int,
                       help="closed loop with this many users; with a rate, a cap on in-flight")
        g.add_argument("--duration", type=float, dest="duration_s",
                       help="stop sending after this many seconds (per run)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier")
    g.add_argument("--num-requests", type=int,
                   help="measured requests per run (default 100 unless --duration is given)")
    g.add_argument("--warmup", type=int, default=2, help="requests sent and not measured")
    g.add_argument("--seed", type=int, default=0, help="same seed -> same workload")
    g.add_argument("--slo-ttft-s", type=float, help="SLO on time to first token (s)")
    g.add_argument("--slo-tpot-s", type=float, help="SLO on time per output token (s)")
    if open_loop:
        g.add_argument("--class-slo", type=_class_slos, metavar="CLASS=TTFT_S:TPOT_S,...",
                       help="per request class, the SLO it carries and is judged by (e.g. "
                            "interactive=0.4:0.04,offline=3:0.045; a side left empty has none); "
                            "other classes get --slo-ttft-s/--slo-tpot-s")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths then vary)")
    g.add_argument("--request-timeout-s", type=float, default=600.0)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=(*PRESET_NAMES, *WORKLOAD_KINDS),
                   help="a preset (short, long, mixed: see pdserve.bench.presets) or a kind; "
                        "default: compare short, run sharegpt with --dataset, else random")
    g.add_argument("--input-len-range", type=_length_range, metavar="LOW:HIGH",
                   help="random: prompt tokens (default 64:1536, or the preset's)")
    g.add_argument("--output-len-range", type=_length_range, metavar="LOW:HIGH",
                   help="random, shared-prefix: output tokens (default 32:256, or the preset's)")
    g.add_argument("--class-mix", help="classmix, mixed: class=weight list reweighting (and "
                   "selecting) the classes; classmix default: " + ",".join(
                       f"{c.name}={c.weight:g}" for c in default_classes()))
    g.add_argument("--num-prefix-groups", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens")
    g.add_argument("--suffix-len-range", type=_length_range, default=LengthRange(32, 256),
                   metavar="LOW:HIGH", help="shared-prefix: tokens after the prefix")
    g.add_argument("--dataset", type=Path, help="ShareGPT-style JSON file")
    g.add_argument("--model", type=Path,
                   help="model folder (tokenizer for --dataset; compare: the model served); "
                        "default: pdserve's default model")
    g.add_argument("--max-model-len", type=int, default=4096)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH|-", help="write results as JSON ('-': stdout)")
    g.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    g.add_argument("--save-records", action="store_true",
                   help="include every request's timeline in the JSON")


def _add_compare_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("systems")
    g.add_argument("--systems", help="some of vllm,pdserve-fifo,pdserve and the variants "
                   "(run in that order; pdserve-whole: the variant --decode-yield whole); default "
                   "vllm,pdserve, with --workload mixed vllm,pdserve-fifo,pdserve, and each "
                   "--variant")
    g.add_argument("--variant", action="append", default=[], metavar="NAME[@SOURCE]=FLAGS",
                   help="also measure pdserve-NAME, turn by turn with the others on the same "
                        "requests: `pdserve up` with FLAGS added, from the checkout at SOURCE "
                        "(default: this one); the JSON's ab_pdserve-NAME pairs it request by "
                        "request with pdserve. Repeatable. E.g. "
                        "--variant 'fixed=--no-long-prefill-adaptive' or --variant 'base@../base='")
    g.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM")
    g.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    g.add_argument("--pdserve-target", help="benchmark this running pdserve instead of starting one")
    g.add_argument("--vllm-url", help="benchmark this running vLLM instead of starting one")
    g.add_argument("--boot-timeout-s", type=float, default=600.0)
    g.add_argument("--sequential", action="store_true",
                   help="boot, measure and stop one system after the other (default: boot "
                        "all, alternate their rates, so the machine's drift hits both)")
    g.add_argument("--idle-systems", choices=("freeze", "run"), default="freeze",
                   help="interleaved: what the systems not measuring do: freeze (SIGSTOP, "
                        "so their idle polling takes no CPU from the one measuring) or run "
                        "(idle; their CPU is still reported per measurement)")
    g.add_argument("--fifo-engines", choices=("shared", "own"), default="shared",
                   help="interleaved: pdserve-fifo's engines: shared: a gateway with fifo's "
                        "flags over pdserve's workers (three engines with vLLM's, so the mixed "
                        "compare fits in memory and is measured in turns); own: a `pdserve up` "
                        "of its own")
    g.add_argument("--log-dir", type=Path,
                   help="server output goes to LOG_DIR/<system>.log (default: a directory per "
                        "compare, bench-logs/compare-<workload>-<UTC time>, with "
                        "bench-logs/latest pointing at it, so a run keeps its logs)")


def _add_search_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput search (pdserve.bench.search)")
    g.add_argument("--start-rate", type=float, dest="start_rps",
                   help="first rate measured (default: 1 / vLLM's unloaded mean E2E)")
    g.add_argument("--floor-rate", type=float, dest="floor_rps",
                   help="lowest rate measured; missing there reports 'below the floor' "
                        "(default: start rate / step factor)")
    g.add_argument("--step-factor", type=float, default=2.0, help="rate step up and down")
    g.add_argument("--bisections", type=int, default=2, help="narrowing steps of the bracket")
    g.add_argument("--max-up-steps", type=int, default=5,
                   help="steps up from the start rate before giving up ('above the ceiling')")
    g.add_argument("--budget-min", type=float, default=38.0,
                   help="whole compare's time budget; a rate that would not fit is skipped")
    g.add_argument("--calibration-requests", type=int, default=8,
                   help="unloaded requests per class that set the SLOs (sent one at a time, "
                        "their lengths the class's length quantiles)")
    g.add_argument("--no-recheck", dest="recheck", action="store_false",
                   help="do not repeat the unloaded run once the searches are over (it says how far "
                        "the machine's speed moved during the compare; interleaved only)")
    g.add_argument("--min-duration-s", type=float, default=60.0,
                   help="each rate is measured with --num-requests or as many requests as "
                        "arrive in this many seconds, whichever is more (0: always "
                        "--num-requests)")


# ---------------------------------------------------------------- config -----------------


def default_model_path() -> Path | None:
    """pdserve's default model folder if it has been prepared (`pdserve prepare-model`)."""
    try:
        from pdserve.model import default_model_path as find
    except ImportError:
        return None
    path = Path(find())
    return path if (path / "config.json").is_file() else None


RANDOM_INPUT, RANDOM_OUTPUT = LengthRange(64, 1536), LengthRange(32, 256)


def workload_config(args: argparse.Namespace, default: str = "random") -> WorkloadConfig:
    name = args.workload or ("sharegpt" if args.dataset else default)
    if name in PRESET_NAMES:
        cfg = preset_workload(name, args.max_model_len)
    else:
        model = args.model or (default_model_path() if name == "sharegpt" else None)
        cfg = WorkloadConfig(
            kind=name, input_len=RANDOM_INPUT, output_len=RANDOM_OUTPUT,
            num_prefix_groups=args.num_prefix_groups, prefix_len=args.prefix_len,
            suffix_len=args.suffix_len_range, dataset=args.dataset, tokenizer_path=model,
            max_model_len=args.max_model_len)
    return dataclasses.replace(
        cfg, input_len=args.input_len_range or cfg.input_len,
        output_len=args.output_len_range or cfg.output_len,
        classes=parse_class_mix(args.class_mix, cfg.classes) if args.class_mix else cfg.classes)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """`run`'s config; for `compare`, the template its search fills in (closed loop at 1,
    the unloaded run's load, until the search sets each rate)."""
    is_compare = args.func is cmd_compare
    rates = [] if is_compare else (sorted(args.rates) if args.rates
                                   else ([args.rate] if args.rate else []))
    duration_s = None if is_compare else args.duration_s
    return BenchConfig(
        backend=getattr(args, "backend", "grpc"), target=getattr(args, "target", ""),
        base_url=getattr(args, "base_url", ""), model_name=getattr(args, "model_name", None),
        workload=workload_config(args, "short" if is_compare else "random"), rates_rps=rates,
        concurrency=1 if is_compare else args.concurrency, burstiness=args.burstiness,
        # --duration alone means "as many requests as fit in it".
        num_requests=args.num_requests if args.num_requests is not None
        else (None if duration_s else 100),
        duration_s=duration_s, warmup=args.warmup, seed=args.seed,
        slo=(SLOTable(SLO(args.slo_ttft_s, args.slo_tpot_s), args.class_slo)
             if getattr(args, "class_slo", None) else SLO(args.slo_ttft_s, args.slo_tpot_s)),
        sampling=SamplingConfig(args.temperature, args.ignore_eos, args.request_timeout_s),
        gateway_metrics=getattr(args, "gateway_metrics", None))


def run_log_dir(root: Path, workload_name: str, now: float | None = None) -> Path:
    """A compare's own log directory under ``root``: bench-logs/<system>.log was overwritten
    by the next compare, so the logs of a run worth a second look were gone."""
    import time

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return root / f"compare-{workload_name}-{stamp}"


def link_latest(log_dir: Path) -> None:
    """Points ``log_dir``'s parent/latest at it (best effort: a link is a convenience)."""
    latest = log_dir.parent / "latest"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        if latest.is_symlink():
            latest.unlink()
        if not latest.exists():
            latest.symlink_to(log_dir.name)
    except OSError:
        pass


def compare_config(args: argparse.Namespace, model: Path) -> CompareConfig:
    from pdserve.bench.compare import CompareConfig, SearchPlan, default_systems
    from pdserve.bench.variants import Variant

    workload_name = args.workload or "short"
    systems = (tuple(s.strip() for s in args.systems.split(",") if s.strip()) if args.systems
               else default_systems(workload_name))
    variants = tuple(Variant.parse(spec) for spec in args.variant)
    plan = SearchPlan(args.start_rps, args.floor_rps, args.step_factor, args.bisections,
                      args.max_up_steps, args.budget_min * 60, args.calibration_requests)
    return CompareConfig(
        bench=bench_config(args), model=model, workload_name=workload_name, systems=systems,
        plan=plan, log_dir=args.log_dir or run_log_dir(Path("bench-logs"), workload_name),
        vllm_cpus=args.vllm_cpus,
        vllm_kv_cache_gib=args.vllm_kv_cache_gib, pdserve_target=args.pdserve_target,
        vllm_url=args.vllm_url, boot_timeout_s=args.boot_timeout_s,
        sequential=args.sequential, freeze_idle=args.idle_systems == "freeze",
        min_duration_s=args.min_duration_s, variants=variants, fifo_engines=args.fifo_engines,
        recheck=args.recheck)


def _write_json(doc: dict, where: str) -> None:
    text = json.dumps(doc, indent=2)
    if where == "-":
        print(text)
    else:
        Path(where).write_text(text + "\n")
        print(f"[bench] wrote {where}", file=sys.stderr)


# ---------------------------------------------------------------- commands ---------------


def cmd_run(args: argparse.Namespace) -> int:
    from pdserve.bench.gateway_cpu import GatewayMetricsError
    from pdserve.bench.report import format_result, result_dict, write_plots
    from pdserve.bench.runner import run_bench

    try:
        cfg = bench_config(args)
    except ValueError as e:
        print(f"pdserve bench run: {e}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_bench(cfg))
    except GatewayMetricsError as e:
        print(f"pdserve bench run: {e}", file=sys.stderr)
        return 2
    # With JSON on stdout, the table goes to stderr so stdout stays parseable.
    print(format_result(result), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        _write_json(result_dict(result, args.save_records), args.json)
    if args.plot_dir:
        for path in write_plots({cfg.backend: result.runs}, args.plot_dir):
            print(f"[bench] wrote {path}", file=sys.stderr)
    return 0 if all(r.summary.num_ok for r in result.runs) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from pdserve.bench import compare, compare_report, interleave
    from pdserve.bench.report import write_plots

    model = args.model or default_model_path()
    if model is None:
        print("pdserve bench compare: no model; give --model or run `pdserve prepare-model`",
              file=sys.stderr)
        return 2
    try:
        cfg = compare_config(args, model)
    except ValueError as e:
        print(f"pdserve bench compare: {e}", file=sys.stderr)
        return 2
    stop_on_sigterm()
    if args.log_dir is None:
        link_latest(cfg.log_dir)
    print(f"[bench] server logs in {cfg.log_dir.resolve()}/", file=sys.stderr)
    try:
        result = (compare.run_sequential if cfg.sequential else interleave.run_interleaved)(cfg)
    except KeyboardInterrupt:
        print("pdserve bench compare: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    doc = compare_report.compare_dict(cfg, result)
    print(compare_report.format_compare(doc),
          file=sys.stderr if args.json == "-" else sys.stdout)
    if args.save_records:
        doc["detail"] = compare_report.detail_dict(result)
    if args.json:
        _write_json(doc, args.json)
    series = {name: sorted(s.runs, key=lambda r: r.load.rate_rps)
              for name, s in result.systems.items() if s.runs}
    if args.plot_dir and series:
        for path in write_plots(series, args.plot_dir):
            print(f"[bench] wrote {path}", file=sys.stderr)
    return 0 if all(s.error is None for s in result.systems.values()) else 1


def stop_on_sigterm() -> None:
    """SIGTERM ends the command as Ctrl-C does (KeyboardInterrupt), so the servers it started
    are stopped on the way out: Python's default for SIGTERM exits without unwinding, and
    left both systems' engines running (seen when a compare was stopped with `kill`)."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def cmd_kv(args: argparse.Namespace) -> int:
    try:
        from kvtransfer import bench as kv_bench
    except ImportError as e:
        print(f"pdserve bench kv: kvtransfer.bench is not available ({e})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="pdserve bench kv",
                                     description=kv_bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    kv_bench.add_arguments(parser)
    return int(kv_bench.run(parser.parse_args(args.kv_args)) or 0)
