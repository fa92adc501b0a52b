"""`pdserve bench handoff`: the KV handoff's share of a long prompt's time to first token.

Starts one prefill and one decode worker (pinned to cores 0 and 1, as `pdserve up` does),
then for each KV transport sends fresh prompts of ``--prompt-tokens`` random tokens (no
prefix-cache hits) straight to the workers, as the gateway does:

- prefill: the Prefill call, client side: the prompt's forward pass and first token, which
  is what the client waits for before its first token (TTFT, less the gateway);
- handoff: the KV's time between the two caches, measured inside the engines by the
  connector (``pdserve_kv_transfer_duration_seconds``: the producer's publish on the prefill
  step plus the consumer's load on the decode step);
- share: handoff / (prefill + handoff), the fraction of prefill-then-handoff spent moving KV;
- first decode reply: the Decode call until its first tokens (load + one decode step + gRPC).

Medians over ``--repeats`` prompts per transport.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass

from pdserve.bench.servers import start_quiet_thread

TRANSPORTS = ("shm", "tcp", "nccl")


@dataclass
class HandoffResult:
    transport: str
    prompt_tokens: int
    prefill_s: float
    handoff_s: float
    send_s: float
    recv_s: float
    share: float
    first_decode_reply_s: float


class _Worker:
    def __init__(self, role: str, model: str, cpus: str, metrics_port: int) -> None:
        self.role = role
        self.metrics_port = metrics_port
        self.address = ""
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", role, "--port", "0", "--cpus", cpus, "--model", model,
             "--metrics-port", str(metrics_port), "--kv-cache-gib", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )
        start_quiet_thread(self._pump)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            found = re.match(r"READY (\S+)", line)
            if found:
                self.address = found.group(1)

    def metric_sum(self, name: str, labels: str, default: float | None = None) -> float:
        from pdserve.prom import sample_sum

        return sample_sum(self.metrics_port, name, labels, default=default)

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3, help="prompts per transport (median taken)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--model", default=None, help="model folder (default: pdserve's default model)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def run(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.ports import free_port_block
    from pdserve.model import resolve_model
    from protos import worker_pb2, worker_pb2_grpc

    model = str(resolve_model(args.model))
    transports = [t for t in args.transports.split(",") if t]
    ports = free_port_block(2)
    workers = [_Worker("prefill", model, "0", ports), _Worker("decode", model, "1", ports + 1)]
    prefill, decode = workers
    results: list[HandoffResult] = []
    try:
        started = time.monotonic()
        while not all(w.address for w in workers):
            for w in workers:
                if w.proc.poll() is not None or time.monotonic() - started > 600:
                    raise RuntimeError(f"{w.role} worker did not start:\n" + "".join(w.log[-20:]))
            time.sleep(0.5)
        _progress(f"workers ready in {time.monotonic() - started:.0f} s")
        prefill_stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(prefill.address))
        decode_stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode.address))
        sampling = worker_pb2.EngineSampling(max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True)
        rng = random.Random(0)

        def one(transport: str) -> tuple[float, float, float, float]:
            prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
            send0 = prefill.metric_sum("pdserve_kv_transfer_duration_seconds_sum", f'transport="{transport}",direction="send"', 0.0)
            recv0 = decode.metric_sum("pdserve_kv_transfer_duration_seconds_sum", f'transport="{transport}",direction="recv"', 0.0)
            t0 = time.perf_counter()
            first = prefill_stub.Prefill(worker_pb2.PrefillRequest(
                request_id=uuid.uuid4().hex, token_ids=prompt, sampling=sampling, kv_transport=transport), timeout=120)
            t1 = time.perf_counter()
            call = decode_stub.Decode(worker_pb2.DecodeRequest(
                request_id=uuid.uuid4().hex, token_ids=prompt + [first.first_token_id], sampling=sampling, kv=first.kv),
                timeout=120)
            replies = iter(call)
            first_reply = next(replies)
            t2 = time.perf_counter()
            last = first_reply
            for last in replies:
                pass
            if not last.num_external_tokens:
                raise RuntimeError(f"{transport}: the decode worker computed the prompt instead of receiving it")
            send_s = prefill.metric_sum("pdserve_kv_transfer_duration_seconds_sum", f'transport="{transport}",direction="send"') - send0
            recv_s = decode.metric_sum("pdserve_kv_transfer_duration_seconds_sum", f'transport="{transport}",direction="recv"') - recv0
            return t1 - t0, send_s, recv_s, t2 - t1

        one(transports[0])  # warm-up: first-call costs (mapping, pairing) stay out of the figures
        for transport in transports:
            samples = [one(transport) for _ in range(args.repeats)]
            prefill_s, send_s, recv_s, reply_s = (statistics.median(col) for col in zip(*samples))
            handoff_s = send_s + recv_s
            results.append(HandoffResult(transport, args.prompt_tokens, prefill_s, handoff_s, send_s, recv_s,
                                         handoff_s / (prefill_s + handoff_s), reply_s))
            _progress(f"{transport}: prefill {prefill_s * 1000:.0f} ms, handoff {handoff_s * 1000:.1f} ms "
                      f"({results[-1].share:.1%})")
    finally:
        for w in workers:
            w.stop()
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results]}, indent=2))
    else:
        print(format_table(results))
    return 0


def format_table(results: list[HandoffResult]) -> str:
    lines = [f"{'transport':>9} {'tokens':>6} {'prefill s':>9} {'handoff s':>9} {'send s':>8} {'recv s':>8} "
             f"{'share':>6} {'1st decode reply s':>18}"]
    for r in results:
        lines.append(f"{r.transport:>9} {r.prompt_tokens:>6} {r.prefill_s:>9.4f} {r.handoff_s:>9.4f} "
                     f"{r.send_s:>8.4f} {r.recv_s:>8.4f} {r.share:>6.1%} {r.first_decode_reply_s:>18.4f}")
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"[bench handoff] {message}", file=sys.stderr, flush=True)
