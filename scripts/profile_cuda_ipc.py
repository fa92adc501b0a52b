"""Where a cuda_ipc fetch spends its time, phase by phase, on a real GPU.

The consumer's ``recv`` replayed step by step with a timer around each step (the producer in
its own process, as in ``pdserve bench kv``), for one prompt length, ``--repeats`` times;
then the same with the consumer holding on to the mapped staging buffers across fetches
(``--keep``), which shows what re-opening the IPC handle on every fetch costs.

    python scripts/profile_cuda_ipc.py --tokens 4096 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from dataclasses import replace

import torch

from kvtransfer.bench import DEFAULT_LAYOUT, ProducerProcess, producer_config, random_layers
from kvtransfer.cuda_ipc import open_shared
from kvtransfer.layout import KVHandle
from kvtransfer.transport import transport_class
from kvtransfer.wire import recv_message


def profile(tokens: int, repeats: int, keep: bool) -> dict[str, float]:
    layout = replace(DEFAULT_LAYOUT, device="cuda")
    num_blocks = layout.num_blocks(tokens) + 64
    source = random_layers(layout, num_blocks, seed=0, device="cuda")
    destination = torch.zeros_like(source)
    layers = list(destination.unbind(0))
    consumer = transport_class("cuda_ipc")(layout, "profile-consumer", {"kv_timeout_s": 30.0})
    producer = ProducerProcess("cuda_ipc", layout, source, producer_config("cuda_ipc"))
    kept: list[torch.Tensor] = []
    phases: dict[str, list[float]] = {}

    def lap(name: str, started: float) -> float:
        now = time.perf_counter()
        phases.setdefault(name, []).append(now - started)
        return now

    try:
        n = layout.num_blocks(tokens)
        for _ in range(repeats):
            ids = torch.randperm(num_blocks)[:n]
            location, sent_s = producer.send(uuid.uuid4().hex, ids.tolist())
            phases.setdefault("send (producer gather)", []).append(sent_s)
            handle = KVHandle("cuda_ipc", location, tokens, layout, "p")
            dst_ids = torch.randperm(num_blocks)[:n].to("cuda")
            t = time.perf_counter()
            sock, fetch = consumer._open_fetch(handle, dst_ids, 0)
            t = lap("connect + fetch header", t)
            shared = recv_message(sock)
            t = lap("IPC handle message", t)
            staged = open_shared(shared)
            t = lap("open_shared (map)", t)
            for layer, src in zip(layers, staged, strict=True):
                layer.index_copy_(0, dst_ids, src[:n])
            t = lap("index_copy_ launches", t)
            torch.cuda.current_stream().synchronize()
            t = lap("synchronize", t)
            if keep:
                kept.append(staged)
                del kept[:-4]
            del staged
            t = lap("drop mapping", t)
            consumer._finish_fetch(sock)
            sock.close()
            lap("ack", t)
    finally:
        producer.stop()
        consumer.close()
    return {name: statistics.median(v) * 1e3 for name, v in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for keep in (False, True):
        result = profile(args.tokens, args.repeats, keep)
        print(f"{args.tokens} tokens, {'mappings kept' if keep else 'mapping dropped'} "
              f"(median ms of {args.repeats}):")
        for name, ms in result.items():
            print(f"  {name:>26}: {ms:8.3f}")
        print(f"  {'recv total':>26}: {sum(v for k, v in result.items() if 'send' not in k):8.3f}")


if __name__ == "__main__":
    main()
