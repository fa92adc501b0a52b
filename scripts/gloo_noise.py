"""What an idle vLLM worker's gloo threads cost a busy engine beside it.

A vLLM worker with world size 1 still holds 13 gloo process groups (the world group and a
device and a CPU group for each parallel dimension), and each gloo group's TCP device runs
a loop thread that wakes every 10 ms: about 1,300 wake-ups a second from an idle worker.
`--hold` makes this process such a neighbour (N gloo groups of world size 1, then sleep;
with `--burn P`, instead a process busy P% of each 10 ms, as pdserve's gateway and worker
front ends are beside the decode engine);
`--ab` starts one colocated vLLM engine, then measures the same Poisson run of the short
workload with and without such a neighbour (alternating, REPEATS times each), and prints
each run's TPOT p50 and mean.

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/gloo_noise.py --ab --rate 1.3 -n 40
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def hold(num_groups: int) -> None:
    import torch.distributed as dist

    from pdserve.bench.servers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    groups = [dist.new_group([0], backend="gloo") for _ in range(num_groups - 1)]
    print(f"holding {len(groups) + 1} gloo groups", flush=True)
    time.sleep(3600)


def burn(percent: float, period_ms: float = 10.0) -> None:
    """Busy for ``percent`` of each ``period_ms``, asleep the rest: a gateway-like load."""
    print(f"burning {percent}% of a core in {period_ms} ms periods", flush=True)
    busy_s, period_s = period_ms * percent / 100 / 1e3, period_ms / 1e3
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            pass
        time.sleep(max(period_s - (time.perf_counter() - start), 0.0))


def ab(rate: float, n: int, repeats: int, groups: int, sched: str, burn_pct: float) -> None:
    from cpu_by_process import bench, vllm_server

    from pdserve.bench.servers import ServerProcess, free_port

    workdir = Path(tempfile.mkdtemp(prefix="gloo-noise."))
    spec, target = vllm_server(free_port())

    def run(tag: str, seed: int) -> dict:
        return bench(target, rate, n, seed, workdir / f"{tag}.json")["runs"][0]["summary"]

    results: dict[str, list[float]] = {"alone": [], "with neighbour": []}
    with ServerProcess(spec, workdir / "vllm.log"):
        run("warm", 7)
        for i in range(repeats):
            for tag in ("alone", "with neighbour"):
                neighbour = None
                if tag == "with neighbour":
                    prefix = ["chrt", "--idle", "0"] if sched == "idle" else []
                    neighbour = subprocess.Popen(
                        [*prefix, sys.executable, __file__, "--hold", "--groups", str(groups),
                         "--burn", str(burn_pct)],
                        stdout=subprocess.PIPE, text=True)
                    assert neighbour.stdout is not None
                    print("  " + neighbour.stdout.readline().strip(), flush=True)
                    time.sleep(2)
                try:
                    s = run(f"{tag}-{i}", 0)
                finally:
                    if neighbour is not None:
                        neighbour.kill()
                        neighbour.wait()
                results[tag].append(s["tpot_s"]["p50"])
                print(f"{tag:>15} #{i}: TPOT p50 {s['tpot_s']['p50'] * 1e3:6.1f} ms, mean "
                      f"{s['tpot_s']['mean'] * 1e3:6.1f} ms, p90 {s['tpot_s']['p90'] * 1e3:6.1f}"
                      f" ms, {s['output_tok_s']:.1f} tok/s", flush=True)
    a, b = (statistics.median(results[t]) for t in ("alone", "with neighbour"))
    what = f"{burn_pct}% of a core burnt" if burn_pct else f"{groups} gloo groups"
    print(f"median TPOT p50: alone {a * 1e3:.1f} ms, with {what} beside it "
          f"({sched} priority) {b * 1e3:.1f} ms: {b / a:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--ab", action="store_true")
    parser.add_argument("--groups", type=int, default=13)
    parser.add_argument("--rate", type=float, default=1.3)
    parser.add_argument("-n", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sched", choices=["idle", "normal"], default="idle")
    parser.add_argument("--burn", type=float, default=0.0,
                        help="the neighbour burns this percent of a core instead of holding "
                             "gloo groups")
    args = parser.parse_args()
    if args.hold and args.burn:
        burn(args.burn)
    elif args.hold:
        hold(args.groups)
    else:
        ab(args.rate, args.n, args.repeats, args.groups, args.sched, args.burn)


if __name__ == "__main__":
    main()
