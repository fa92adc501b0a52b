"""Cores shared by a prefill and a decode engine on one host: decode yields a slice per step.

With `pdserve up --cores shared` the prefill engine runs at idle priority, so a decode
engine that never idles keeps it off the cores: under steady decode load a long prompt
waits for the gaps between decode steps (the long benchmark's TTFT misses, with decode's
TPOT 20% inside its objective). With a yield set (`--decode-yield-ms`), the decode engine
sleeps that long at the start of each step while a prefill worker has prompts in hand, and
the prefill engine has the cores for that slice: decode's time per token grows by the slice
only while prefill has work.

A fixed slice is blind to what decode can spare. With `--decode-yield slack` the slice
follows the running requests' TPOT objectives instead (`pause_budget_s`): each request
that carries one (the gateway sends it with Decode) is ahead of its schedule by its
objective times the tokens it has made since its first, less the time since that first
token; the decode engine may spend SLACK_SHARE of the smallest such lead per step, at most
`SLACK_SLICE_MAX_S`, and nothing while a request in the batch still waits for its first
token or has no objective. Decode spends on prefill only the time its requests' objectives
leave over, so the prefill share grows when decode runs fast and vanishes when it runs at
its objective.

With `--decode-yield whole` the decode engine gives the cores up whole instead: at a step
while prefill has prompts in hand it waits until prefill has none (polling every
WHOLE_POLL_S), at most WHOLE_MAX_S, then runs the step. Prefill then runs on every core at
once, as a colocated engine's prompt does when it stops the decodes of its batch, instead of
in the gaps decode leaves; decode's tokens wait for each prompt the way a colocated engine's
do. The gateway marks offline prompts as not worth a yield (PrefillRequest.yield_decode),
so an offline flood never holds decode up.

Each prefill worker counts its prompts in hand in a shared-memory word of its own,
``<base>.<pid>`` (`PrefillBusy`); the decode engine's KV connector sums the words each step
(`StepYield`), looking for new ones once a second and dropping those whose process is gone,
so a prefill worker killed with prompts in hand does not keep decode yielding. The base
path is PDSERVE_CORE_SHARE_FILE, which `pdserve up` sets for the workers it starts; it
removes the words when it stops (`remove_words`).
"""

from __future__ import annotations

import glob
import mmap
import os
import struct
import time

import psutil

ENV_FILE = "PDSERVE_CORE_SHARE_FILE"
ENV_YIELD_MS = "PDSERVE_DECODE_YIELD_MS"  # milliseconds per step, or SLACK
SLACK = "slack"
WHOLE = "whole"
RESCAN_S = 1.0
# Slack mode: the share of the smallest lead spent in one step, the most one step yields,
# and the least worth a sleep.
SLACK_SHARE = 0.8
SLACK_SLICE_MAX_S = 0.5
SLACK_SLICE_MIN_S = 0.001
# Whole mode: how often the waiting decode engine looks at prefill's words, and the longest
# it waits before running a step anyway (a prefill tier that never empties does not stop
# decode outright).
WHOLE_POLL_S = 0.005
WHOLE_MAX_S = 2.0
_WORD = struct.Struct("<q")


def slack_mode_from_env() -> bool:
    return bool(os.environ.get(ENV_FILE)) and os.environ.get(ENV_YIELD_MS) == SLACK


def pause_budget_s(now_s: float, running: list[tuple[int, float | None, float | None]]) -> float:
    """How long the decode engine may pause before this step, from the requests it runs:
    (tokens made so far, TPOT objective in seconds or None, when the first was seen; None
    only before it). A request with an objective is ahead of its schedule by ``objective x
    (tokens - 1) - (now - first)``: the step after the pause still meets the next token's
    due time if it takes no longer than the objective. SLACK_SHARE of the smallest lead,
    between 0 and SLACK_SLICE_MAX_S; 0 when nothing runs, and while any request waits for
    its first token (a pause would add to its TTFT) or has no objective (nothing says what
    it tolerates)."""
    leads = []
    for made, objective_s, first_s in running:
        if made < 1 or objective_s is None or first_s is None:
            return 0.0
        leads.append(objective_s * (made - 1) - (now_s - first_s))
    return min(max(SLACK_SHARE * min(leads), 0.0), SLACK_SLICE_MAX_S) if leads else 0.0


def _map(path: str, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, _WORD.size)
        return mmap.mmap(fd, _WORD.size)
    finally:
        os.close(fd)  # the mapping stays


def remove_words(base: str) -> None:
    for path in glob.glob(f"{glob.escape(base)}.*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class PrefillBusy:
    """A prefill worker's count of prompts in hand, in its own word (one process writes it)."""

    def __init__(self, base: str) -> None:
        self.path = f"{base}.{os.getpid()}"
        self._map = _map(self.path, create=True)
        self._count = 0

    @classmethod
    def from_env(cls) -> PrefillBusy | None:
        base = os.environ.get(ENV_FILE)
        return cls(base) if base else None

    def _set(self, count: int) -> None:
        self._count = max(count, 0)
        _WORD.pack_into(self._map, 0, self._count)

    def enter(self) -> None:
        self._set(self._count + 1)

    def leave(self) -> None:
        self._set(self._count - 1)

    def close(self) -> None:
        self._map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class StepYield:
    """The decode side: ``pause()`` at each step sleeps while any prefill worker on these
    cores has prompts in hand: ``yield_s`` (fixed), in slack mode (``yield_s`` None) the
    step's budget (`pause_budget_s`), at most SLACK_SLICE_MAX_S, or in whole mode until
    prefill has none left, at most WHOLE_MAX_S."""

    def __init__(self, base: str, yield_s: float | None, sleep=time.sleep,
                 clock=time.monotonic, whole: bool = False) -> None:
        self._base = base
        self.yield_s = yield_s
        self.whole = whole
        self._sleep = sleep
        self._clock = clock
        self._words: dict[str, tuple[int, mmap.mmap]] = {}  # path -> (pid, word)
        self._scanned_s = float("-inf")

    @classmethod
    def from_env(cls) -> StepYield | None:
        base, ms = os.environ.get(ENV_FILE), os.environ.get(ENV_YIELD_MS)
        if not base or not ms:
            return None
        if ms == SLACK:
            return cls(base, None)
        if ms == WHOLE:
            return cls(base, None, whole=True)
        return cls(base, float(ms) / 1000) if float(ms) > 0 else None

    def _rescan(self) -> None:
        present = set()
        for path in glob.glob(f"{glob.escape(self._base)}.*"):
            suffix = path.rsplit(".", 1)[1]
            if not suffix.isdigit():
                continue
            present.add(path)
            if path not in self._words:
                try:
                    self._words[path] = (int(suffix), _map(path, create=False))
                except (FileNotFoundError, ValueError):  # gone, or not yet sized
                    present.discard(path)
        for path in list(self._words):
            pid, word = self._words[path]
            if path not in present or not psutil.pid_exists(pid):
                word.close()
                del self._words[path]

    def prefill_busy(self) -> int:
        now = self._clock()
        if now - self._scanned_s >= RESCAN_S:
            self._scanned_s = now
            self._rescan()
        return sum(_WORD.unpack_from(word)[0] for _, word in self._words.values())

    def pause(self, budget_s: float = 0.0) -> float:
        """Sleeps the slice if prefill has prompts in hand; the seconds it slept. Slack mode
        takes the step's budget; whole mode waits for prefill to finish."""
        if self.whole:
            return self._wait_for_prefill()
        slice_s = self.yield_s if self.yield_s is not None else min(budget_s, SLACK_SLICE_MAX_S)
        if slice_s < SLACK_SLICE_MIN_S:
            return 0.0
        if self.prefill_busy() <= 0:
            return 0.0
        self._sleep(slice_s)
        return slice_s

    def _wait_for_prefill(self) -> float:
        if self.prefill_busy() <= 0:
            return 0.0
        start = self._clock()
        while True:
            self._sleep(WHOLE_POLL_S)
            waited = self._clock() - start
            if waited >= WHOLE_MAX_S or self.prefill_busy() <= 0:
                return waited
