"""Where each system's CPU goes at one fixed load: pdserve's processes against vLLM's.

Starts each system as `pdserve bench compare` does (same engine settings), sends a warm-up,
then one Poisson run of the short workload at RATE with `pdserve bench run`, and reads every
process's CPU seconds (user + system, from /proc) before and after the run. Prints, per
process, CPU seconds, CPU microseconds per output token and the share of the run's wall
time, and the run's TPOT p50 and output tok/s: whether pdserve's slower decode at the same
load comes from CPU its other processes take from the engine's cores.

With `--idle S` it starts pdserve alone, sends nothing, and prints over S seconds each
process's CPU and, per thread name, the threads and their wake-ups a second (voluntary
context switches from /proc): what an idle stack takes from whatever else runs.

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/cpu_by_process.py --rate 1.3 -n 40
    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/cpu_by_process.py --idle 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.systems import pdserve_argv, source_root_env, vllm_dtype  # noqa: E402
from pdserve.bench.servers import ServerProcess, ServerSpec, descendants, free_port  # noqa: E402
from pdserve.model import resolve_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def label(pid: int) -> str:
    """A short name: the process title vLLM sets, or the module and role of a python one."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in cmd if a]
    if comm.startswith("VLLM") or (args and args[0].startswith("VLLM")):
        return args[0] if args else comm
    if "-m" in args:
        i = args.index("-m")
        rest = args[i + 1:i + 3]
        return " ".join(rest)
    if any("multiprocessing" in a for a in args):
        return "multiprocessing child"
    return " ".join(args[:2])[:60] or comm


def tree(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    for p in (pid, *descendants(pid)):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[p] = (label(p), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def bench(target_args: list[str], rate: float, n: int, seed: int, out: Path) -> dict:
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "run", *target_args, "--workload",
            "short", "--rate", str(rate), "--num-requests", str(n), "--warmup", "0", "--seed",
            str(seed), "--max-model-len", "4096", "--json", str(out)]
    subprocess.run(argv, check=True, env={**os.environ, **source_root_env()},
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def measure(spec: ServerSpec, target_args: list[str], rate: float, n: int, workdir: Path) -> None:
    with ServerProcess(spec, workdir / f"{spec.name}.log") as server:
        bench(target_args, rate, 10, 7, workdir / f"{spec.name}-warm.json")
        before = tree(server.pid)
        started = time.monotonic()
        result = bench(target_args, rate, n, 0, workdir / f"{spec.name}.json")
        wall = time.monotonic() - started
        after = tree(server.pid)
    run = result["runs"][0]["summary"]
    tokens = run["output_tokens"]
    print(f"\n{spec.name}: {n} requests at {rate} req/s, {wall:.1f} s, {tokens} output tokens, "
          f"TPOT p50 {run['tpot_s']['p50'] * 1e3:.1f} ms, TTFT p50 {run['ttft_s']['p50']:.3f} s, "
          f"{run['output_tok_s']:.1f} output tok/s")
    rows = []
    for pid, (name, cpu) in after.items():
        used = cpu - before.get(pid, (name, 0.0))[1]
        rows.append((used, name, pid))
    total = sum(r[0] for r in rows)
    for used, name, pid in sorted(rows, reverse=True):
        if used < 0.05:
            continue
        print(f"  {used:7.2f} s {used / tokens * 1e6:8.0f} us/token {used / wall:6.1%}  "
              f"{pid:>7} {name}")
    print(f"  {total:7.2f} s {total / tokens * 1e6:8.0f} us/token {total / wall:6.1%}  all")


def pdserve_server(port: int,
                   extra_flags: list[str] | None = None) -> tuple[ServerSpec, list[str]]:
    """`pdserve up` as the compare starts it, and `pdserve bench run`'s target arguments."""
    argv = pdserve_argv(port, resolve_model(None), 4096) + (extra_flags or [])
    spec = ServerSpec("pdserve", argv, source_root_env(),
                      ready_pattern=rf"^[^\[].*\bready\b.*:{port}\b",
                      grpc_health_target=f"127.0.0.1:{port}")
    return spec, ["--target", f"127.0.0.1:{port}"]


def vllm_server(port: int) -> tuple[ServerSpec, list[str]]:
    """One colocated vLLM engine with the compare's engine settings, and the target args."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(resolve_model(None)), "--dtype", vllm_dtype(), "--block-size", "32",
            "--max-model-len", "4096", "--enforce-eager", "--enable-prefix-caching",
            "--port", str(port), "--host", "127.0.0.1"]
    spec = ServerSpec("vllm", argv, {"VLLM_CPU_KVCACHE_SPACE": "2",
                                     "VLLM_CPU_OMP_THREADS_BIND": "0-1"},
                      health_url=f"http://127.0.0.1:{port}/health", engine_dir=True)
    return spec, ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}"]


def wakeups(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (thread name, voluntary context switches so far)."""
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                status = (task / "status").read_text()
                name = (task / "comm").read_text().strip()
            except OSError:
                continue
            switches = next(line for line in status.splitlines()
                            if line.startswith("voluntary_ctxt_switches"))
            out[(pid, int(task.name))] = (name, int(switches.split()[1]))
    return out


def measure_idle(seconds: float, workdir: Path) -> None:
    spec, _ = pdserve_server(free_port())
    with ServerProcess(spec, workdir / "pdserve.log") as server:
        time.sleep(10)  # past start-up's last work
        pids = [server.pid, *descendants(server.pid)]
        cpu_before, woken_before = tree(server.pid), wakeups(pids)
        time.sleep(seconds)
        cpu_after, woken_after = tree(server.pid), wakeups(pids)
    print(f"\nidle pdserve stack, {seconds:g} s: CPU per process")
    total = 0.0
    for pid, (name, cpu) in sorted(cpu_after.items()):
        used = cpu - cpu_before.get(pid, (name, 0.0))[1]
        total += used
        print(f"  {used:6.2f} s {used / seconds:6.1%}  {pid:>7} {name}")
    print(f"  {total:6.2f} s {total / seconds:6.1%}  all")
    per, threads = Counter(), Counter()
    for key, (name, switches) in woken_after.items():
        group = (key[0], cpu_after.get(key[0], ("?", 0.0))[0], name)
        per[group] += switches - woken_before.get(key, (name, 0))[1]
        threads[group] += 1
    print("wake-ups a second, by process and thread name:")
    for group, woken in per.most_common(12):
        print(f"  {woken / seconds:7.0f} /s {threads[group]:3d} threads  {group[0]:>7} "
              f"{group[1]} / {group[2]}")
    print(f"  {sum(per.values()) / seconds:7.0f} /s in all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.3)
    parser.add_argument("-n", type=int, default=40)
    parser.add_argument("--systems", default="pdserve,vllm")
    parser.add_argument("--pdserve-flags", default="", help="extra `pdserve up` flags")
    parser.add_argument("--idle", type=float, metavar="S",
                        help="instead: an idle pdserve stack's CPU and wake-ups over S s")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cpu-by-process."))
    print(f"logs in {workdir}")
    if args.idle:
        measure_idle(args.idle, workdir)
        return
    for system in args.systems.split(","):
        if system == "pdserve":
            spec, target = pdserve_server(free_port(), args.pdserve_flags.split())
        else:
            spec, target = vllm_server(free_port())
        measure(spec, target, args.rate, args.n, workdir)


if __name__ == "__main__":
    main()
