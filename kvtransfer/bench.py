"""``pdserve bench kv``: how fast each KV transport moves a prompt's paged blocks.

Synthetic paged KV with the default model's layout (30 layers, 3 KV heads, block 32, entry
128, bfloat16) is moved for prompts of several lengths through every transport this
machine offers, the producer in its own process (as in production: the prefill engine),
the consumer here (the decode engine). Source and destination block ids are random
permutations, as a long-running engine's block pool hands them out.

One transfer's time is ``send`` (the producer's gather, on the prefill engine's step) plus
``recv`` (the consumer's fetch and scatter, on the decode engine's step): the time the
prompt's KV spends between the two caches, which is what a request waits for. Each figure is
the median of ``--repeats`` transfers; the received blocks are checked bit for bit against
the sent ones before anything is reported. A plain single-threaded ``dst.copy_(src)`` of the
same bytes is the yardstick; everything runs single-threaded (``torch.set_num_threads(1)``)
so the ratio compares copies, not core counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.multiprocessing as mp

from kvtransfer.layout import KVHandle, KVLayout, layer_views
from kvtransfer.transport import transport_class

DEFAULT_LAYOUT = KVLayout(num_layers=30, block_size=32, num_kv_heads=3, entry_size=128,
                          dtype="bfloat16")
DEFAULT_SIZES = (128, 1024, 4096, 16384)
HEADROOM_BLOCKS = 64
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Result:
    transport: str
    num_tokens: int
    bytes: int
    seconds: float
    gbps: float
    ratio_to_memcpy: float
    send_seconds: float
    recv_seconds: float


class ProducerProcess:
    """A producer transport in a process of its own, driven over a pipe.

    ``layers`` is the whole cache in shared memory, ``(num_layers, *axis sizes in the
    layout's memory order)`` (``layer_views``; ``(num_layers, num_blocks, H, N, C)`` for
    vLLM's LBHNC): the child serves from the very bytes the parent later checks the
    consumer's copy against.
    """

    def __init__(self, transport: str, layout: KVLayout, layers: torch.Tensor,
                 extra_config: dict[str, Any], num_threads: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_producer_main,
            args=(child_conn, transport, layout.to_dict(), layers.share_memory_(), extra_config,
                  num_threads),
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.extra_config: dict[str, Any] = self._call(None)

    def send(self, key: str, block_ids: list[int]) -> tuple[str, float]:
        """Publishes ``block_ids`` under ``key``; returns the location and the send's seconds."""
        return self._call(("send", key, block_ids))

    def _call(self, message: Any) -> Any:
        if message is not None:
            self._conn.send(message)
        if not self._conn.poll(CALL_TIMEOUT_S):
            raise RuntimeError(f"producer process {self.process.pid} did not answer")
        answer = self._conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=CALL_TIMEOUT_S)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._call(("stop",))
            except (RuntimeError, OSError, EOFError):
                pass
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


def _producer_main(conn: Any, transport: str, layout: dict[str, Any], layers: torch.Tensor,
                   extra_config: dict[str, Any], num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    cls = transport_class(transport)
    producer = cls(KVLayout.from_dict(layout), "bench-producer", extra_config)
    config = getattr(producer, "extra_config", extra_config)
    conn.send(config)
    if transport == "shm":  # an shm producer's KV cache lives in shared memory
        from kvtransfer.shm import share

        layers = share(layers, "bench-producer")
    kv_layout = KVLayout.from_dict(layout)
    layer_list = [kv_layout.block_view(t) for t in layer_views(kv_layout, layers)]
    try:
        while True:
            message = conn.recv()
            if message[0] == "stop":
                conn.send("stopped")
                return
            _, key, block_ids = message
            try:
                location = cls.location_for(key, config)
                started = time.perf_counter()
                producer.send(location, layer_list, torch.tensor(block_ids, dtype=torch.long))
                conn.send((location, time.perf_counter() - started))
            except Exception as e:  # reported to the parent, which raises it
                conn.send(e)
    finally:
        producer.close()


def available_transports() -> list[str]:
    names = ["shm", "tcp", "nccl"]
    return names + ["cuda_ipc"] if torch.cuda.is_available() else names


def producer_config(transport: str) -> dict[str, Any]:
    if transport == "shm":
        return {}
    return {f"{transport}_host": "127.0.0.1", f"{transport}_port": 0, "kv_timeout_s": 30.0}


def random_layers(layout: KVLayout, num_blocks: int, seed: int,
                  device: str = "cpu") -> torch.Tensor:
    """``(num_layers, num_blocks, *block_shape)`` of random bits (viewed as ``layout.dtype``):
    the block views of a layer-major cache."""
    generator = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, num_blocks, *layout.block_shape)
    nbytes = layout.num_layers * num_blocks * layout.block_nbytes
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (nbytes // 4,), dtype=torch.int32,
                         generator=generator)
    return bits.view(layout.torch_dtype).view(shape).to(device)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of the bits (random bits include NaNs, which ``==`` calls unequal)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memcpy(nbytes: int, repeats: int, device: str = "cpu") -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch outside the timing
    times = []
    for _ in range(repeats):
        _sync(src.device)
        started = time.perf_counter()
        dst.copy_(src)
        _sync(src.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_transport(name: str, layout: KVLayout, source: torch.Tensor, sizes: list[int],
                    repeats: int, memcpy_s: dict[int, float]) -> list[Result]:
    num_blocks = source.shape[1]
    destination = torch.zeros_like(source)
    dst_layers = list(destination.unbind(0))
    consumer = transport_class(name)(layout, "bench-consumer", {"kv_timeout_s": 30.0})
    producer = ProducerProcess(name, layout, source, producer_config(name))
    generator = torch.Generator().manual_seed(len(name))
    results = []
    try:
        for num_tokens in sizes:
            n = layout.num_blocks(num_tokens)
            send_s, recv_s = [], []
            for repeat in range(repeats):
                src_ids = torch.randperm(num_blocks, generator=generator)[:n]
                dst_ids = torch.randperm(num_blocks, generator=generator)[:n]
                if repeat == repeats - 1:
                    destination.zero_()  # the checked transfer must not find old copies
                location, sent_s = producer.send(uuid.uuid4().hex, src_ids.tolist())
                handle = KVHandle(name, location, num_tokens, layout, "bench-producer")
                started = time.perf_counter()
                consumer.recv(handle, dst_layers, dst_ids.to(destination.device), 0)
                _sync(destination.device)
                recv_s.append(time.perf_counter() - started)
                send_s.append(sent_s)
                type(consumer).release(location)
            if not bitwise_equal(destination[:, dst_ids], source[:, src_ids]):
                raise AssertionError(f"{name}: received KV differs from sent KV at {num_tokens}")
            results.append(_result(name, layout, num_tokens, statistics.median(send_s),
                                   statistics.median(recv_s), memcpy_s[num_tokens]))
            _progress(results[-1])
    finally:
        producer.stop()
        consumer.close()
    return results


def _result(name: str, layout: KVLayout, num_tokens: int, send_s: float, recv_s: float,
            memcpy_s: float) -> Result:
    nbytes = layout.nbytes(num_tokens)
    seconds = send_s + recv_s
    return Result(name, num_tokens, nbytes, seconds, nbytes / seconds / 1e9, memcpy_s / seconds,
                  send_s, recv_s)


def _progress(result: Result) -> None:
    print(f"  {result.transport:>8} {result.num_tokens:>6} tokens: {result.gbps:6.2f} GB/s "
          f"({result.ratio_to_memcpy:.2f}x memcpy)", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(DEFAULT_SIZES), help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="transfers per size (median taken)")
    parser.add_argument("--device", default="cpu", help="where both KV caches live: cpu or cuda")
    parser.add_argument("--transports", type=lambda s: s.split(","), default=None,
                        help="comma-separated subset of: " + ",".join(available_transports()))


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    layout = replace(DEFAULT_LAYOUT, device=torch.device(args.device).type)
    names = args.transports or available_transports()
    unknown = set(names) - set(available_transports())
    if unknown:
        print(f"transports not available here: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    num_blocks = layout.num_blocks(max(args.sizes)) + HEADROOM_BLOCKS
    print(f"KV bench: {layout}, {num_blocks} blocks per layer", file=sys.stderr, flush=True)
    memcpy_s = {n: measure_memcpy(layout.nbytes(n), args.repeats, args.device) for n in args.sizes}
    results = [_result("memcpy", layout, n, 0.0, memcpy_s[n], memcpy_s[n]) for n in args.sizes]
    source = random_layers(layout, num_blocks, seed=0, device=args.device)
    for name in names:
        print(f"{name}:", file=sys.stderr, flush=True)
        results += bench_transport(name, layout, source, args.sizes, args.repeats, memcpy_s)
    memcpy_gbps = layout.nbytes(max(args.sizes)) / memcpy_s[max(args.sizes)] / 1e9
    if args.json:
        print(json.dumps({"memcpy_gbps": memcpy_gbps, "results": [asdict(r) for r in results]}))
    else:
        print(format_table(results))
    return 0


def format_table(results: list[Result]) -> str:
    lines = [f"{'transport':>9} {'tokens':>7} {'bytes':>11} {'seconds':>9} {'GB/s':>6} "
             f"{'x memcpy':>8} {'send s':>8} {'recv s':>8}"]
    for r in results:
        lines.append(f"{r.transport:>9} {r.num_tokens:>7} {r.bytes:>11} {r.seconds:>9.5f} "
                     f"{r.gbps:>6.2f} {r.ratio_to_memcpy:>8.2f} {r.send_seconds:>8.5f} "
                     f"{r.recv_seconds:>8.5f}")
    return "\n".join(lines)
