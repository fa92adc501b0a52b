"""`pdserve bench`: run, compare and kv subcommands.

`register(subparsers)` adds ``bench`` to the top-level ``pdserve`` parser; each
subcommand's ``func`` takes the parsed args and returns an exit code. Flags become one
`BenchConfig` (or `CompareConfig`) here and nowhere else. Heavy imports (matplotlib,
transformers, kvtransfer.bench and its torch) happen only in the command that needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pdserve.bench.backends import SamplingConfig
from pdserve.bench.metrics import SLO
from pdserve.bench.runner import BenchConfig
from pdserve.bench.workload import (
    WORKLOAD_KINDS,
    LengthRange,
    WorkloadConfig,
    default_classes,
    parse_class_mix,
)

EPILOG = """examples:
  pdserve bench run --target 127.0.0.1:50051 --rate 1 --num-requests 100
  pdserve bench run --rates 0.25,0.5,1,1.5 --slo-ttft-s 2 --slo-tpot-s 0.25 --plot-dir plots
  pdserve bench run --backend openai --base-url http://127.0.0.1:8000 --concurrency 8
  pdserve bench compare --json compare.json --plot-dir plots
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
    _add_load_args(run, rates_default=None)
    _add_workload_args(run)
    _add_output_args(run)
    run.set_defaults(func=cmd_run)

    compare = commands.add_parser(
        "compare", help="pdserve vs colocated vLLM on the same workload (starts both)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_compare_args(compare)
    _add_load_args(compare, rates_default=None)
    _add_workload_args(compare)
    _add_output_args(compare)
    from pdserve.bench import compare as compare_defaults  # light: no server code runs

    compare.set_defaults(func=cmd_compare, rates=list(compare_defaults.DEFAULT_RATES_RPS),
                         num_requests=compare_defaults.DEFAULT_NUM_REQUESTS,
                         input_len_range=compare_defaults.DEFAULT_INPUT_LEN,
                         output_len_range=compare_defaults.DEFAULT_OUTPUT_LEN,
                         slo_ttft_s=2.0, slo_tpot_s=0.25)

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


def _add_load_args(p: argparse.ArgumentParser, rates_default: str | None) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, help="open loop: mean request rate (req/s)")
    g.add_argument("--rates", type=_floats, default=_floats(rates_default or ""),
                   help="open loop sweep: comma-separated request rates (req/s)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier")
    g.add_argument("--concurrency", type=int,
                   help="closed loop with this many users; with a rate, a cap on in-flight")
    g.add_argument("--num-requests", type=int,
                   help="measured requests per run (default 100 unless --duration is given)")
    g.add_argument("--duration", type=float, dest="duration_s",
                   help="stop sending after this many seconds (per run)")
    g.add_argument("--warmup", type=int, default=2, help="requests sent and not measured")
    g.add_argument("--seed", type=int, default=0, help="same seed -> same workload")
    g.add_argument("--slo-ttft-s", type=float, help="SLO on time to first token (s)")
    g.add_argument("--slo-tpot-s", type=float, help="SLO on time per output token (s)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths then vary)")
    g.add_argument("--request-timeout-s", type=float, default=600.0)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOAD_KINDS,
                   help="default: sharegpt with --dataset, else random")
    g.add_argument("--input-len-range", type=_length_range, default=LengthRange(64, 1536),
                   metavar="LOW:HIGH", help="random: prompt tokens")
    g.add_argument("--output-len-range", type=_length_range, default=LengthRange(32, 256),
                   metavar="LOW:HIGH", help="random, shared-prefix: output tokens")
    g.add_argument("--class-mix", default=",".join(f"{c.name}={c.weight:g}"
                                                   for c in default_classes()),
                   help="classmix: class=weight list (priorities 0, 1, 2 in that order)")
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
    g.add_argument("--systems", default="pdserve,vllm", help="which to run, in order")
    g.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM")
    g.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    g.add_argument("--pdserve-target", help="benchmark this running pdserve instead of starting one")
    g.add_argument("--vllm-url", help="benchmark this running vLLM instead of starting one")
    g.add_argument("--boot-timeout-s", type=float, default=600.0)
    g.add_argument("--log-dir", type=Path, default=Path("bench-logs"),
                   help="server output goes to LOG_DIR/<system>.log")


# ---------------------------------------------------------------- config -----------------


def default_model_path() -> Path | None:
    """pdserve's default model folder if it has been prepared (`pdserve prepare-model`)."""
    try:
        from pdserve.model import default_model_path as find
    except ImportError:
        return None
    path = Path(find())
    return path if (path / "config.json").is_file() else None


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    kind = args.workload or ("sharegpt" if args.dataset else "random")
    model = args.model or (default_model_path() if kind == "sharegpt" else None)
    return WorkloadConfig(
        kind=kind, input_len=args.input_len_range, output_len=args.output_len_range,
        classes=parse_class_mix(args.class_mix), num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len_range, dataset=args.dataset,
        tokenizer_path=model, max_model_len=args.max_model_len)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    rates = sorted(args.rates) if args.rates else ([args.rate] if args.rate else [])
    return BenchConfig(
        backend=getattr(args, "backend", "grpc"), target=getattr(args, "target", ""),
        base_url=getattr(args, "base_url", ""), model_name=getattr(args, "model_name", None),
        workload=workload_config(args), rates_rps=rates, concurrency=args.concurrency,
        burstiness=args.burstiness,
        # --duration alone means "as many requests as fit in it".
        num_requests=args.num_requests if args.num_requests is not None
        else (None if args.duration_s else 100),
        duration_s=args.duration_s, warmup=args.warmup, seed=args.seed,
        slo=SLO(args.slo_ttft_s, args.slo_tpot_s),
        sampling=SamplingConfig(args.temperature, args.ignore_eos, args.request_timeout_s))


def _write_json(doc: dict, where: str) -> None:
    text = json.dumps(doc, indent=2)
    if where == "-":
        print(text)
    else:
        Path(where).write_text(text + "\n")
        print(f"[bench] wrote {where}", file=sys.stderr)


# ---------------------------------------------------------------- commands ---------------


def cmd_run(args: argparse.Namespace) -> int:
    from pdserve.bench.report import format_result, result_dict, write_plots
    from pdserve.bench.runner import run_bench

    try:
        cfg = bench_config(args)
    except ValueError as e:
        print(f"pdserve bench run: {e}", file=sys.stderr)
        return 2
    result = asyncio.run(run_bench(cfg))
    # With JSON on stdout, the table goes to stderr so stdout stays parseable.
    print(format_result(result), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        _write_json(result_dict(result, args.save_records), args.json)
    if args.plot_dir:
        for path in write_plots({cfg.backend: result.runs}, args.plot_dir):
            print(f"[bench] wrote {path}", file=sys.stderr)
    return 0 if all(r.summary.num_ok for r in result.runs) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from pdserve.bench import compare
    from pdserve.bench.report import write_plots

    model = args.model or default_model_path()
    if model is None:
        print("pdserve bench compare: no model; give --model or run `pdserve prepare-model`",
              file=sys.stderr)
        return 2
    try:
        cfg = compare.CompareConfig(
            bench=bench_config(args), model=model,
            systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
            log_dir=args.log_dir, vllm_cpus=args.vllm_cpus,
            vllm_kv_cache_gib=args.vllm_kv_cache_gib, pdserve_target=args.pdserve_target,
            vllm_url=args.vllm_url, boot_timeout_s=args.boot_timeout_s)
    except ValueError as e:
        print(f"pdserve bench compare: {e}", file=sys.stderr)
        return 2
    results = compare.run_compare(cfg)
    doc = compare.compare_dict(cfg, results)
    print(compare.format_compare(doc, results), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.save_records:
        doc["detail"] = compare.detail_dict(results)
    if args.json:
        _write_json(doc, args.json)
    series = {name: r.result.runs for name, r in results.items() if r.result is not None}
    if args.plot_dir and series:
        for path in write_plots(series, args.plot_dir):
            print(f"[bench] wrote {path}", file=sys.stderr)
    return 0 if all(r.error is None for r in results.values()) else 1


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
