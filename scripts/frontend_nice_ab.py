"""Does pdserve's decode speed up when its non-engine processes yield to the engines?

Starts `pdserve up` (the compare's settings), warms it, then alternates Poisson runs of the
short workload at RATE with the gateway, the workers' front ends and the launcher at nice 0
and at nice NICE (every thread of each; the engine-core and worker processes stay at 0),
REPEATS times each, and prints each run's TPOT and TTFT.

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/frontend_nice_ab.py --nice 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from cpu_by_process import bench, label, pdserve_server  # noqa: E402

from pdserve.bench.servers import ServerProcess, descendants, free_port  # noqa: E402


def renice(pids: list[int], nice: int) -> None:
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.3)
    parser.add_argument("-n", type=int, default=40)
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="nice-ab."))
    spec, target = pdserve_server(free_port())
    tpot: dict[int, list[float]] = {0: [], args.nice: []}
    with ServerProcess(spec, workdir / "up.log") as server:
        pids = [server.pid, *descendants(server.pid)]
        front = [p for p in pids if not label(p).startswith("VLLM")]
        print("reniced: " + ", ".join(f"{p} {label(p)}" for p in front), flush=True)
        bench(target, args.rate, 10, 7, workdir / "warm.json")
        for i in range(args.repeats):
            for nice in (0, args.nice):
                renice(front, nice)
                s = bench(target, args.rate, args.n, 0, workdir / f"{nice}-{i}.json")
                s = s["runs"][0]["summary"]
                tpot[nice].append(s["tpot_s"]["p50"])
                print(f"nice {nice:>2} #{i}: TPOT p50 {s['tpot_s']['p50'] * 1e3:6.1f} ms, mean "
                      f"{s['tpot_s']['mean'] * 1e3:6.1f}, p90 {s['tpot_s']['p90'] * 1e3:6.1f}; "
                      f"TTFT p50 {s['ttft_s']['p50'] * 1e3:5.0f} ms, p90 "
                      f"{s['ttft_s']['p90'] * 1e3:5.0f} ms; attainment "
                      f"{s['slo_attainment']:.0%}", flush=True)
    a, b = (statistics.median(tpot[k]) for k in (0, args.nice))
    print(f"median TPOT p50: nice 0 {a * 1e3:.1f} ms, nice {args.nice} {b * 1e3:.1f} ms: "
          f"{b / a:.3f}x")


if __name__ == "__main__":
    main()
