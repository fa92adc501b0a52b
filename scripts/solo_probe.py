"""Prefill under decode load (scripts/solo_probe.sh runs it per set of flags): against a running `pdserve up`
(started with --local-prefill-max-tokens 0 --rescue-prefill-max-tokens 0, so that every
prompt goes through the prefill tier), time the first token of long prompts sent one after
the other, alone and while requests decode.

    python scripts/solo_probe.py ADDRESS [NUM_PROMPTS] [PROMPT_TOKENS]
"""

import sys
import threading
import time

import grpc

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pbg


def request(stub, token_ids, max_tokens):
    req = pb.GenerateRequest(token_ids=token_ids, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sent = time.monotonic()
    first = None
    n = 0
    for r in stub.Generate(req, timeout=600):
        if first is None:
            first = time.monotonic() - sent
        n += len(r.token_ids)
    return first, time.monotonic() - sent, n


def main():
    address = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 1400
    stub = pbg.GenerationStub(grpc.insecure_channel(address))
    prompts = [[100 + (i * 7 + j) % 20000 for j in range(length)] for i in range(2 * count + 1)]
    request(stub, prompts[-1], 2)  # warm
    alone = [request(stub, prompts[i], 2)[0] for i in range(count)]
    print(f"alone: {length}-token prompt TTFT " + " ".join(f"{t:.2f}" for t in alone) + " s", flush=True)
    results = []
    decoders = [threading.Thread(target=lambda k=k: results.append(request(stub, [200 + k] * 24, 1200)))
                for k in range(2)]
    for t in decoders:
        t.start()
    time.sleep(3.0)
    loaded = [request(stub, prompts[count + i], 2)[0] for i in range(count)]
    print(f"beside 2 decoding requests: TTFT " + " ".join(f"{t:.2f}" for t in loaded) + " s", flush=True)
    for t in decoders:
        t.join()
    for first, total, n in results:
        print(f"decoding request: {n} tokens, TPOT {(total - first) / (n - 1) * 1000:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
