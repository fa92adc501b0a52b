"""`python -m pdserve.bench.detok`: the gateway's CPU per generated token for streamed text.

No engines: replays ``--streams`` streams of ``--tokens`` real token ids (the model's own
tokenization of this repository's documentation plus multilingual text, a different slice
per stream) through two reply paths, as a decode tier delivers them: each step brings
``--chunk`` tokens to every stream, every stream's message handled in its own asyncio task
on uvloop, as in the gateway.

- pool: the reply path before gateway/stream.py: Detokenizer windows decoded in the
  tokenizer pool, one process round trip per message (baseline);
- stream: gateway.stream.Stream.reply, decoding in the gateway process.

CPU: this process's time.process_time() plus the pool processes' user + system CPU
(psutil), before and after each path; reported in µs per generated token. Both paths must
produce the same text for every stream (checked). gRPC's own cost per message is not here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.request import Job, Sampling
from gateway.stream import PROMETHEUS, Stream
from gateway.text import Detokenizer, StopMatcher, decode_delta, load_tokenizer
from gateway.tokenizer_pool import ProcessCpu
from protos import generation_pb2

MULTILINGUAL = (
    "Prix : 15 € — naïve café, crème brûlée. 東京タワーは高いです。 Ünïcödé ✓ 🙂🚀 "
    "Здравствуйте, как дела? مرحبا بالعالم. नमस्ते दुनिया। "
)

# --- the reply path before gateway/stream.py (baseline), kept here to measure against ---

_pool_tokenizer = None  # set in each pool process by _init_pool


def _init_pool(model: str) -> None:
    global _pool_tokenizer
    from transformers import AutoTokenizer

    _pool_tokenizer = AutoTokenizer.from_pretrained(model)


def _decode_pair(ids: list[int], read_offset: int) -> tuple[str, str]:
    prefix = _pool_tokenizer.decode(ids[:read_offset], skip_special_tokens=True)
    return prefix, _pool_tokenizer.decode(ids, skip_special_tokens=True)


def _ping() -> bool:
    return _pool_tokenizer is not None


class PoolPathStream:
    """GenerationServicer._reply as it was: a decode_pair round trip per message."""

    def __init__(self, job: Job, num_prompt_tokens: int, pool: ProcessPoolExecutor) -> None:
        self.job = job
        self.num_prompt_tokens = num_prompt_tokens
        self.pool = pool
        self.detok = Detokenizer()
        self.stop = StopMatcher(job.sampling.stop)
        self.started = time.monotonic()
        self.last_sent: float | None = None
        self.num_generated = 0

    async def reply(self, new_ids: list[int], finish_reason: str) -> generation_pb2.GenerateResponse:
        ids, read_offset = self.detok.window(new_ids)
        loop = asyncio.get_running_loop()
        prefix_text, full_text = await loop.run_in_executor(self.pool, _decode_pair, ids, read_offset)
        delta = decode_delta(prefix_text, full_text, bool(finish_reason))
        text = self.stop.feed(self.detok.advance(delta))
        if self.stop.stopped:
            finish_reason = "stop"
        elif finish_reason:
            text += self.stop.flush()
        self.num_generated += len(new_ids)
        reply = generation_pb2.GenerateResponse(
            request_id=self.job.request_id, text=text, token_ids=new_ids, finish_reason=finish_reason
        )
        now = time.monotonic()
        if self.last_sent is None:
            PROMETHEUS.first_token(self.job, now - self.started)
        elif new_ids:
            PROMETHEUS.tokens(self.job, len(new_ids), now - self.last_sent)
        self.last_sent = now
        if finish_reason:
            reply.usage.prompt_tokens = self.num_prompt_tokens
            reply.usage.completion_tokens = self.num_generated
            PROMETHEUS.finished(self.job, now - self.started, self.num_prompt_tokens, self.num_generated)
        return reply


# --- the benchmark ---------------------------------------------------------------------


@dataclass
class PathResult:
    path: str
    num_tokens: int
    gateway_cpu_s: float
    pool_cpu_s: float
    us_per_token: float


def corpus_ids(tokenizer, num_streams: int, num_tokens: int) -> list[list[int]]:
    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in docs if p.is_file())
    ids = tokenizer.encode(text).ids
    extra = tokenizer.encode(MULTILINGUAL).ids
    streams = []
    for s in range(num_streams):
        start = (s * num_tokens) % max(1, len(ids) - num_tokens)
        # Every fourth stream opens with multi-byte characters split over several tokens.
        head = extra if s % 4 == 0 else []
        streams.append((head + ids[start:start + num_tokens])[:num_tokens])
    return streams


def make_job(i: int, stop: tuple[str, ...]) -> Job:
    sampling = Sampling(
        max_tokens=1 << 20, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=stop,
        stop_token_ids=(), ignore_eos=True,
    )
    return Job(request_id=f"bench-{i}", prompt="x", messages=None, token_ids=None, sampling=sampling)


async def replay(
    reply_fns: list[Callable[[list[int], str], Awaitable[generation_pb2.GenerateResponse]]],
    streams: list[list[int]],
    chunk: int,
) -> list[str]:
    texts = [""] * len(streams)
    done = [False] * len(streams)

    async def deliver(i: int, ids: list[int], reason: str) -> None:
        reply = await reply_fns[i](ids, reason)
        texts[i] += reply.text
        done[i] = bool(reply.finish_reason)

    length = max(len(s) for s in streams)
    for start in range(0, length, chunk):
        await asyncio.gather(*(
            deliver(i, s[start:start + chunk], "length" if start + chunk >= len(s) else "")
            for i, s in enumerate(streams) if not done[i] and start < len(s)
        ))
    return texts


async def measure(
    name: str, make_fns, streams: list[list[int]], chunk: int, pool_cpu: Callable[[], float]
) -> tuple[PathResult, list[str]]:
    reply_fns = make_fns()
    cpu0, pool0 = time.process_time(), pool_cpu()
    texts = await replay(reply_fns, streams, chunk)
    gateway_s, pool_s = time.process_time() - cpu0, pool_cpu() - pool0
    num_tokens = sum(len(s) for s in streams)
    us_per_token = (gateway_s + pool_s) / num_tokens * 1e6
    return PathResult(name, num_tokens, gateway_s, pool_s, us_per_token), texts


async def run(args: argparse.Namespace) -> list[PathResult]:
    tokenizer = load_tokenizer(args.model)
    streams = corpus_ids(tokenizer, args.streams, args.tokens)
    stop = tuple(args.stop)
    pool = ProcessPoolExecutor(
        max_workers=args.tokenizer_workers, mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_pool, initargs=(args.model,),
    )
    cpu = ProcessCpu()
    loop = asyncio.get_running_loop()
    try:
        await asyncio.gather(*(loop.run_in_executor(pool, _ping) for _ in range(args.tokenizer_workers)))

        def pool_cpu() -> float:
            return cpu.read(list(pool._processes or ()))

        def pool_fns():
            return [PoolPathStream(make_job(i, stop), 16, pool).reply for i in range(len(streams))]

        def stream_fns():
            out = []
            for i in range(len(streams)):
                stream = Stream(make_job(i, stop), 16, tokenizer)

                async def reply(ids, reason, stream=stream):
                    return stream.reply(ids, reason)

                out.append(reply)
            return out

        results, all_texts = [], []
        for _ in range(args.repeats):
            for name, fns in (("pool", pool_fns), ("stream", stream_fns)):
                result, texts = await measure(name, fns, streams, args.chunk, pool_cpu)
                results.append(result)
                all_texts.append(texts)
        first = all_texts[0]
        for texts in all_texts[1:]:
            if texts != first:
                raise AssertionError("the two reply paths produced different text for the same ids")
        return results
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    from pdserve.model import default_model_path

    p = argparse.ArgumentParser(prog="python -m pdserve.bench.detok", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()), help="model folder (its tokenizer.json)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per stream")
    p.add_argument("--chunk", type=int, default=1, help="tokens per message")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--tokenizer-workers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="runs of each path, alternating")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    import uvloop

    results = uvloop.run(run(args))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"{args.streams} streams x {args.tokens} tokens, {args.chunk} token(s) per message")
        for r in results:
            print(
                f"{r.path:>6}: {r.us_per_token:7.1f} us CPU per generated token "
                f"(gateway {r.gateway_cpu_s:.3f} s + pool {r.pool_cpu_s:.3f} s over {r.num_tokens} tokens)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
