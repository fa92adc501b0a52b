"""How far a compare's calibration moves from one unloaded run to the next: boots colocated
vLLM as `pdserve bench compare` does, then repeats the compare's unloaded run (N requests
of the workload's one class, one at a time) R times per mode, the modes alternating:

- ``drawn``: lengths drawn at random, another seed each repeat (what the compare did
  before the thirty-eighth session, there always with seed 0);
- ``quantiles``: the class's length quantiles (`workload.stratified_requests`, what it
  does now), other token ids each repeat.

Each repeat's TTFT p50 and TPOT p50 (the SLOs are 3x and 1.5x them) and its median prefill
rate (prompt tokens / TTFT: the machine's speed, whatever the lengths); then per mode the
range of each over the repeats. Every repeat has fresh token ids: no prefix-cache hits.

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/unloaded_scatter.py --workload long --repeats 5
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
from pdserve.bench.runner import make_backend, run_load, warm_up
from pdserve.bench.servers import ServerProcess, free_port
from pdserve.bench.systems import bench_config_for, vllm_spec
from pdserve.bench.workload import stratified_requests
from pdserve.cli import build_parser

MODES = ("drawn", "quantiles")


async def one_run(backend, bench, mode: str, n: int, seed: int):
    requests = (stratified_requests(bench.workload, n, seed, f"{mode}-{seed}-")
                if mode == "quantiles" else None)
    load = LoadConfig(concurrency=1, num_requests=n, seed=seed)
    run = await run_load(backend, dataclasses.replace(bench, seed=seed), load,
                         f"{mode}-{seed}-", seed, requests)
    unloaded = calibrate(run.records, "vllm").unloaded["default"]
    rate = statistics.median(r.prompt_len / r.ttft_s for r in run.records if r.ttft_s)
    return unloaded.ttft_p50_s, unloaded.tpot_p50_s, rate


async def scatter(address: str, cfg, repeats: int, n: int) -> dict[str, list[tuple[float, float, float]]]:
    bench = bench_config_for(cfg, "vllm", address)
    seen: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    async with make_backend(bench) as backend:
        await warm_up(backend, bench)
        for i in range(repeats):
            for mode in MODES:
                ttft, tpot, rate = await one_run(backend, bench, mode, n, 7_000_001 + 1_000 * i)
                seen[mode].append((ttft, tpot, rate))
                print(f"{time.strftime('%H:%M:%S', time.gmtime())} {mode:9s} repeat {i}: "
                      f"TTFT p50 {ttft:.3f} s, TPOT p50 {tpot * 1000:.1f} ms, "
                      f"prefill {rate:.0f} tokens/s", flush=True)
    return seen


def spread(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.3g}-{hi:.3g} (max/min {hi / lo:.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="long", choices=("short", "long"))
    ap.add_argument("--repeats", type=int, default=5, help="unloaded runs per mode")
    ap.add_argument("--requests", type=int, default=8, help="requests per unloaded run")
    args = ap.parse_args()
    compare = build_parser().parse_args(["bench", "compare", "--workload", args.workload])
    cfg = bench_cli.compare_config(compare, compare.model or bench_cli.default_model_path())
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="unloaded-scatter-") as logs:
        print(f"booting vllm (log {logs}/vllm.log)", file=sys.stderr, flush=True)
        with ServerProcess(vllm_spec(cfg, port), Path(logs) / "vllm.log"):
            seen = asyncio.run(scatter(f"http://127.0.0.1:{port}", cfg, args.repeats, args.requests))
    for mode, runs in seen.items():
        print(f"{mode}: TTFT p50 {spread([r[0] for r in runs])} s, "
              f"TPOT p50 {spread([r[1] * 1000 for r in runs])} ms, "
              f"prefill {spread([r[2] for r in runs])} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
