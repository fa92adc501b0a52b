"""A prompt on the prefill tier when the decode engine has just finished (scripts/idle_spin_probe.sh
runs it per environment): against a running `pdserve up`, PAIRS times: a short request
decodes OUT tokens on the decode worker (its 24-token prompt is prefilled there), a
PROMPT-token prompt is sent to the prefill tier 0.5 s after its first token, and the time
from the decoding request's end to the prompt's first token is printed ("after decode"),
then the same prompt length alone with decode idle for 3 s ("alone").

    python scripts/idle_spin_probe.py ADDRESS [PAIRS] [PROMPT_TOKENS] [OUT]
"""

import statistics
import sys
import threading
import time

import grpc

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pbg


def stream(stub, token_ids, max_tokens, on_first=None):
    """(send, first token, end) on the monotonic clock."""
    req = pb.GenerateRequest(token_ids=token_ids, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sent, first = time.monotonic(), None
    for _ in stub.Generate(req, timeout=600):
        if first is None:
            first = time.monotonic()
            if on_first is not None:
                on_first()
    return sent, first, time.monotonic()


def main():
    address = sys.argv[1]
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 1400
    out = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    stub = pbg.GenerationStub(grpc.insecure_channel(address))
    prompts = iter([[100 + (i * 7 + j) % 20000 for j in range(length)] for i in range(3 * pairs + 2)])
    stream(stub, next(prompts), 2)  # warm both tiers
    stream(stub, [99] * 24, 8)
    after, alone = [], []
    for i in range(pairs):
        time.sleep(3.0)
        first_seen = threading.Event()
        result = {}
        decoder = threading.Thread(target=lambda: result.update(
            d=stream(stub, [300 + i] * 24, out, first_seen.set)))
        decoder.start()
        first_seen.wait(60)
        time.sleep(0.5)
        sent, first, _ = stream(stub, next(prompts), 2)
        decoder.join()
        decode_end = result["d"][2]
        after.append(first - max(decode_end, sent))
        time.sleep(3.0)
        sent, first, _ = stream(stub, next(prompts), 2)
        alone.append(first - sent)
        print(f"pair {i}: {length}-token prompt's first token {after[-1]:.2f} s after decode's "
              f"last ({first - sent:.2f} s alone)", flush=True)
    print(f"after decode: median {statistics.median(after):.2f} s ({' '.join(f'{x:.2f}' for x in after)}); "
          f"alone: median {statistics.median(alone):.2f} s ({' '.join(f'{x:.2f}' for x in alone)})",
          flush=True)


if __name__ == "__main__":
    main()
