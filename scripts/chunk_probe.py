"""A short prompt sent to a decode worker while it prefills a long one, per chunk cap: starts
`pdserve decode --long-prefill-tokens CAP [--max-num-batched-tokens BUDGET]
[--long-prefill-adaptive]` for each CAP[/BUDGET][a] given (in turn, ROUNDS times), and
PAIRS times: one request decodes (a 24-token prompt, 200 tokens) so that the engine runs
more than one request, LONGS (1) LONG-token prompts are sent together 0.5 s after its first
token, and a SHORT-token prompt CHUNK_DELAY_S (0.2) later; prints the short prompt's time to
its first token and the first long one's, then the short prompt alone beside the decoding
request, and the decoding request's mean time per output token. BESIDE=0: no decoding
request, the long prompt alone on the engine when the short one comes (vLLM lifts the
chunk cap for a lone prompt).

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/chunk_probe.py 0 256 128
    BESIDE=0 flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/chunk_probe.py 256/2048 256
    LONGS=2 flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/chunk_probe.py 256/512 128/512a
    (env: ROUNDS=1 PAIRS=4 LONG=1900 LONGS=1 SHORT=67 BESIDE=1)
"""

import os
import re
import statistics
import subprocess
import sys
import threading
import time

import grpc

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pbg

ROUNDS = int(os.environ.get("ROUNDS", "1"))
PAIRS = int(os.environ.get("PAIRS", "4"))
LONG = int(os.environ.get("LONG", "1900"))
SHORT = int(os.environ.get("SHORT", "67"))
DELAY_S = float(os.environ.get("CHUNK_DELAY_S", "0.2"))
BESIDE = os.environ.get("BESIDE", "1") != "0"
LONGS = int(os.environ.get("LONGS", "1"))


def decode(stub, request_id, token_ids, max_tokens, on_first=None):
    """(sent, first token, last token, tokens) on the monotonic clock; streams to the end."""
    req = pb.DecodeRequest(request_id=request_id, token_ids=token_ids,
                           sampling=pb.EngineSampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0,
                                                      ignore_eos=True))
    sent, first, last, n = time.monotonic(), None, None, 0
    for reply in stub.Decode(req, timeout=600):
        last = time.monotonic()
        n += len(reply.token_ids)
        if first is None:
            first = last
            if on_first is not None:
                on_first()
    return sent, first, last, n


def probe(port: int, cap: str) -> tuple[list[float], list[float], list[float], list[float]]:
    stub = pbg.DecodeWorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    n = 0

    def ids(length):
        nonlocal n
        n += 1
        return [100 + (n * 7919 + j) % 20000 for j in range(length)]  # fresh: no prefix-cache hits

    decode(stub, f"warm-{cap}", ids(LONG), 2)
    short_behind, long_ttft, short_alone, tpot = [], [], [], []
    got: dict = {}
    for i in range(PAIRS):
        decoder = None
        if BESIDE:
            started = threading.Event()
            prompt = ids(24)
            decoder = threading.Thread(target=lambda: got.update(
                d=decode(stub, f"d{i}-{cap}", prompt, 200, started.set)))
            decoder.start()
            started.wait(60)
            time.sleep(0.5)
        prompts = [ids(LONG) for _ in range(LONGS)]  # here: ids() counts, unlocked
        longs = [threading.Thread(target=lambda k=k: got.update({f"long{k}": decode(stub, f"l{i}.{k}-{cap}",
                                                                                    prompts[k], 2)}))
                 for k in range(LONGS)]
        for t in longs:
            t.start()
        time.sleep(DELAY_S)
        sent, first, _, _ = decode(stub, f"s{i}-{cap}", ids(SHORT), 2)
        short_behind.append(first - sent)
        for t in longs:
            t.join()
        long_ttft.append(got["long0"][1] - got["long0"][0])
        sent, first, _, _ = decode(stub, f"a{i}-{cap}", ids(SHORT), 2)
        short_alone.append(first - sent)
        if decoder is not None:
            decoder.join()
            _, first, last, tokens = got["d"]
            tpot.append((last - first) / max(tokens - 1, 1) * 1000)
    return short_behind, long_ttft, short_alone, tpot


def main() -> None:
    caps = sys.argv[1:] or ["0", "256"]
    for round_ in range(ROUNDS):
        for spec in caps:
            adaptive = spec.endswith("a")
            cap, _, budget = spec.removesuffix("a").partition("/")
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "decode", "--port", "0",
                                     "--kv-cache-gib", "1", "--long-prefill-tokens", cap,
                                     *(["--max-num-batched-tokens", budget] if budget else []),
                                     *(["--long-prefill-adaptive"] if adaptive else [])],
                                    stdout=subprocess.PIPE, stderr=open(os.environ.get("PROBE_LOG", os.devnull), "w"), text=True)
            try:
                port = None
                for line in proc.stdout:
                    if m := re.match(r"READY [\d.]+:(\d+)", line):
                        port = int(m.group(1))
                        break
                if port is None:
                    sys.exit(f"decode worker {spec} did not start")
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
                behind, long_, alone, tpot = probe(port, spec.replace("/", "_"))
            finally:
                proc.terminate()
                proc.wait(60)
            med = statistics.median
            print(f"round {round_ + 1} cap {spec:>8}: short behind {LONGS} x {LONG}-token prompts "
                  f"{' '.join(f'{t:.2f}' for t in behind)} s (median {med(behind):.2f}); long "
                  f"{' '.join(f'{t:.2f}' for t in long_)} s (median {med(long_):.2f}); short alone "
                  f"{' '.join(f'{t:.2f}' for t in alone)} s (median {med(alone):.2f})"
                  + (f"; decoding beside: TPOT {' '.join(f'{t:.0f}' for t in tpot)} ms" if tpot else ""), flush=True)


if __name__ == "__main__":
    main()
