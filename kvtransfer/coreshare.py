"""Cores shared by a prefill and a decode engine on one host: decode yields a slice per step.

With `pdserve up --cores shared` the prefill engine runs at idle priority, so a decode
engine that never idles keeps it off the cores: under steady decode load a long prompt
waits for the gaps between decode steps (the long benchmark's TTFT misses, with decode's
TPOT 20% inside its objective). With a yield set (`--decode-yield-ms`), the decode engine
sleeps that long at the start of each step while the prefill worker has prompts in hand,
and the prefill engine has both cores for that slice: decode's time per token grows by the
slice only while prefill has work.

The prefill worker counts its prompts in hand in a shared-memory word (`PrefillBusy`); the
decode engine's KV connector reads it each step (`StepYield`). Both find the word by the
path in PDSERVE_CORE_SHARE_FILE, which `pdserve up` sets for the workers it starts and
removes when it stops.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time

ENV_FILE = "PDSERVE_CORE_SHARE_FILE"
ENV_YIELD_MS = "PDSERVE_DECODE_YIELD_MS"
_WORD = struct.Struct("<q")


def _map(path: str, create: bool) -> tuple[int, mmap.mmap]:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        if create:
            with _locked(fd):
                if os.fstat(fd).st_size < _WORD.size:
                    os.ftruncate(fd, _WORD.size)
        return fd, mmap.mmap(fd, _WORD.size)
    except BaseException:
        os.close(fd)
        raise


class _locked:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


class PrefillBusy:
    """The prefill side: how many prompts this host's prefill workers have in hand."""

    def __init__(self, path: str) -> None:
        self._fd, self._map = _map(path, create=True)

    @classmethod
    def from_env(cls) -> PrefillBusy | None:
        path = os.environ.get(ENV_FILE)
        return cls(path) if path else None

    def _add(self, delta: int) -> None:
        with _locked(self._fd):  # several prefill workers may share the word
            (count,) = _WORD.unpack_from(self._map)
            _WORD.pack_into(self._map, 0, max(count + delta, 0))

    def enter(self) -> None:
        self._add(1)

    def leave(self) -> None:
        self._add(-1)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


class StepYield:
    """The decode side: ``pause()`` at each step sleeps ``yield_s`` while prefill has work."""

    def __init__(self, path: str, yield_s: float, sleep=time.sleep) -> None:
        self._path = path
        self.yield_s = yield_s
        self._sleep = sleep
        self._map: mmap.mmap | None = None

    @classmethod
    def from_env(cls) -> StepYield | None:
        path, ms = os.environ.get(ENV_FILE), os.environ.get(ENV_YIELD_MS)
        if not path or not ms or float(ms) <= 0:
            return None
        return cls(path, float(ms) / 1000)

    def prefill_busy(self) -> int:
        if self._map is None:
            try:  # the prefill worker creates the word; until then nothing is in hand
                fd, self._map = _map(self._path, create=False)
            except FileNotFoundError:
                return 0
            os.close(fd)
        return _WORD.unpack_from(self._map)[0]

    def pause(self) -> bool:
        """Sleeps the slice if prefill has prompts in hand; whether it did."""
        if self.prefill_busy() <= 0:
            return False
        self._sleep(self.yield_s)
        return True
