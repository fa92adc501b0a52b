"""Tokenization in worker processes, outside the gateway's GIL.

Each pool process loads the model's tokenizer once (the pool initializer); the functions
below run there. The pool uses the 'spawn' start method: forking a process that already
runs gRPC threads is unsafe. Streamed output is detokenized in the gateway process
(gateway.text.IncrementalDecoder): a round trip per message cost more than the decode.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import psutil

# Set once per pool process by _init; never touched in the gateway process.
_tokenizer = None


def _init(model: str) -> None:
    global _tokenizer
    from transformers import AutoTokenizer

    _tokenizer = AutoTokenizer.from_pretrained(model)


def _encode_text(text: str) -> list[int]:
    return _tokenizer.encode(text)


def _encode_chat(messages: tuple[tuple[str, str], ...]) -> list[int]:
    conversation = [{"role": role, "content": content} for role, content in messages]
    # The template writes the special tokens itself.
    text = _tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return _tokenizer.encode(text, add_special_tokens=False)



def _ping() -> bool:
    return _tokenizer is not None


class TokenizerPool:
    def __init__(self, model: str, num_workers: int) -> None:
        self._num_workers = num_workers
        self._pool = ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(model,),
        )
        self._cpu = ProcessCpu()

    async def start(self) -> None:
        """Waits until every process has loaded the tokenizer, so no request pays for it."""
        await asyncio.gather(*(self._run(_ping) for _ in range(self._num_workers)))

    async def encode_text(self, text: str) -> list[int]:
        return await self._run(_encode_text, text)

    async def encode_chat(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        return await self._run(_encode_chat, messages)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the pool's processes, live and exited, so far."""
        # ProcessPoolExecutor lists its processes only in this private dict (pid -> Process).
        return self._cpu.read(list(self._pool._processes or ()))

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class ProcessCpu:
    """Sums the CPU of a changing set of processes; one that exits keeps its last reading."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[psutil.Process, float]] = {}
        self._exited_s = 0.0

    def read(self, pids: list[int]) -> float:
        live: dict[int, tuple[psutil.Process, float]] = {}
        for pid in pids:
            proc = self._live[pid][0] if pid in self._live else None
            try:
                proc = proc or psutil.Process(pid)
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            live[pid] = (proc, times.user + times.system)
        # CPU spent between the last reading and the exit is lost: a pool process exits
        # only when the pool breaks or shuts down.
        self._exited_s += sum(s for pid, (_, s) in self._live.items() if pid not in live)
        self._live = live
        return self._exited_s + sum(s for _, s in live.values())
