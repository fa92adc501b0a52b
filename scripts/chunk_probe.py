"""A short prompt sent to a decode worker while it prefills a long one, per chunk cap: starts
`pdserve decode --long-prefill-tokens CAP [--max-num-batched-tokens BUDGET]` for each
CAP[/BUDGET] given (in turn, ROUNDS times), and PAIRS times: one request decodes (a
24-token prompt, 200 tokens) so that the engine runs more than one request, a LONG-token
prompt is sent 0.5 s after its first token, and a SHORT-token prompt CHUNK_DELAY_S (0.2)
later; prints the short prompt's time to its first token and the long one's, then the short
prompt alone beside the decoding request. BESIDE=0: no decoding request, the long prompt
alone on the engine when the short one comes (vLLM lifts the chunk cap for a lone prompt).

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/chunk_probe.py 0 256 128
    BESIDE=0 flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/chunk_probe.py 256/2048 256
    (env: ROUNDS=1 PAIRS=4 LONG=1900 SHORT=67 BESIDE=1)
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


def decode(stub, request_id, token_ids, max_tokens, on_first=None):
    """(sent, first token) on the monotonic clock; streams to the end."""
    req = pb.DecodeRequest(request_id=request_id, token_ids=token_ids,
                           sampling=pb.EngineSampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0,
                                                      ignore_eos=True))
    sent, first = time.monotonic(), None
    for _ in stub.Decode(req, timeout=600):
        if first is None:
            first = time.monotonic()
            if on_first is not None:
                on_first()
    return sent, first


def probe(port: int, cap: str) -> tuple[list[float], list[float], list[float]]:
    stub = pbg.DecodeWorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    n = 0

    def ids(length):
        nonlocal n
        n += 1
        return [100 + (n * 7919 + j) % 20000 for j in range(length)]  # fresh: no prefix-cache hits

    decode(stub, f"warm-{cap}", ids(LONG), 2)
    short_behind, long_ttft, short_alone = [], [], []
    for i in range(PAIRS):
        decoder = None
        if BESIDE:
            started = threading.Event()
            decoder = threading.Thread(target=decode, args=(stub, f"d{i}-{cap}", ids(24), 200, started.set))
            decoder.start()
            started.wait(60)
            time.sleep(0.5)
        got = {}
        long_thread = threading.Thread(target=lambda: got.update(long=decode(stub, f"l{i}-{cap}", ids(LONG), 2)))
        long_thread.start()
        time.sleep(DELAY_S)
        sent, first = decode(stub, f"s{i}-{cap}", ids(SHORT), 2)
        short_behind.append(first - sent)
        long_thread.join()
        long_ttft.append(got["long"][1] - got["long"][0])
        sent, first = decode(stub, f"a{i}-{cap}", ids(SHORT), 2)
        short_alone.append(first - sent)
        if decoder is not None:
            decoder.join()
    return short_behind, long_ttft, short_alone


def main() -> None:
    caps = sys.argv[1:] or ["0", "256"]
    for round_ in range(ROUNDS):
        for spec in caps:
            cap, _, budget = spec.partition("/")
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "decode", "--port", "0",
                                     "--kv-cache-gib", "1", "--long-prefill-tokens", cap,
                                     *(["--max-num-batched-tokens", budget] if budget else [])],
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
                behind, long_, alone = probe(port, spec.replace("/", "_"))
            finally:
                proc.terminate()
                proc.wait(60)
            med = statistics.median
            print(f"round {round_ + 1} cap {spec:>8}: short behind a {LONG}-token prompt "
                  f"{' '.join(f'{t:.2f}' for t in behind)} s (median {med(behind):.2f}); long "
                  f"{' '.join(f'{t:.2f}' for t in long_)} s (median {med(long_):.2f}); short alone "
                  f"{' '.join(f'{t:.2f}' for t in alone)} s (median {med(alone):.2f})", flush=True)


if __name__ == "__main__":
    main()
