"""Cores shared by a prefill and a decode engine on one host: decode yields a slice per step.

With `pdserve up --cores shared` the prefill engine runs at idle priority, so a decode
engine that never idles keeps it off the cores: under steady decode load a long prompt
waits for the gaps between decode steps (the long benchmark's TTFT misses, with decode's
TPOT 20% inside its objective). With a yield set (`--decode-yield-ms`), the decode engine
sleeps that long at the start of each step while a prefill worker has prompts in hand, and
the prefill engine has the cores for that slice: decode's time per token grows by the slice
only while prefill has work.

A fixed slice is blind to what decode can spare. With `--decode-yield slack` the pause
follows the running requests' TPOT objectives instead (`pause_budget_s`): the SLO a request
is held to is its mean time per token, (last token - first) / (tokens - 1), so a request
that carries an objective (the gateway sends it with Decode) can absorb a pause as long as
its last token still comes by ``first + objective x (max_tokens - 1)``: the lead it has built
so far plus, for each token still to come, what the objective leaves over the engine's
time per step (`StepPace`, measured on steps that did not pause). The decode engine waits
for prefill (as in whole mode) for at most SLACK_SHARE of the smallest such budget per
step, at most `SLACK_SLICE_MAX_S`, and not at all while a request in the batch still waits
for its first token or has no objective, or while a prompt starts in the step. Decode
spends on prefill only the time its requests' objectives leave over: a prompt that comes
while decode runs well inside its objectives gets every core at once, one that comes while
decode is at its objectives gets the gaps between steps, until it is urgent: each prompt
carries what is left of its TTFT objective (PrefillRequest.ttft_left_ms), and once that is
no more than its prefill on every core (at the prefill worker's best recent speed, with
URGENT_MARGIN; `urgent_at`), decode waits for prefill whole (as in whole mode) whatever its
budget. A colocated engine makes every running request pay for every prompt at once; here
the running requests pay only for prompts that cannot wait, and a prompt that can wait
often does until the requests that could not afford it have finished.

Slack mode spends a request's budget as soon as a prompt comes, and a request that has
just started has little lead to spend. With `--decode-yield pace` the pause is a steady
share of each step instead (`pace_budget_s`): PACE_SHARE of what the tightest running
objective leaves over the engine's time per plain step, every step while prefill has
prompts in hand, so decode's time per token rises towards its objective (never past it)
and prefill gets every core for the rest; urgent prompts are waited for whole as in slack
mode. The same guards hold: no pause while a request waits for its first token or has no
objective, or while a prompt starts in the step.

With `--decode-yield whole` the decode engine gives the cores up whole instead: at a step
while prefill has prompts in hand it waits until one of them is done (polling every
WHOLE_POLL_S), at most WHOLE_MAX_S, then runs the step: one decode step between prompts,
as a colocated engine makes one between prefill chunks. Prefill then runs on every core at
once, as a colocated engine's prompt does when it stops the decodes of its batch, instead of
in the gaps decode leaves; decode's tokens wait for each prompt the way a colocated engine's
do. The gateway marks offline prompts as not worth a yield (PrefillRequest.yield_decode),
so an offline flood never holds decode up.

Each prefill worker counts its prompts in hand, with the earliest time one of them is
urgent, in a shared-memory word of its own, ``<base>.<pid>`` (`PrefillBusy`); the decode
engine's KV connector sums the words each step (`StepYield`), looking for new ones once a
second and dropping those whose process is gone, so a prefill worker killed with prompts in
hand does not keep decode yielding. The base
path is PDSERVE_CORE_SHARE_FILE, which `pdserve up` sets for the workers it starts; it
removes the words when it stops (`remove_words`).
"""

from __future__ import annotations

import glob
import math
import mmap
import os
import struct
import time
from collections import deque

import psutil

ENV_FILE = "PDSERVE_CORE_SHARE_FILE"
ENV_YIELD_MS = "PDSERVE_DECODE_YIELD_MS"  # milliseconds per step, or SLACK
SLACK = "slack"
PACE = "pace"
WHOLE = "whole"
RESCAN_S = 1.0
# Slack mode: the share of the smallest lead spent in one step, the most one step yields,
# and the least worth a sleep.
SLACK_SHARE = 0.8
SLACK_SLICE_MAX_S = 0.5
SLACK_SLICE_MIN_S = 0.001
# Pace mode: the share of (objective - time per plain step) that each step waits for prefill.
PACE_SHARE = 0.7
# Whole mode: how often the waiting decode engine looks at prefill's words, and the longest
# it waits before running a step anyway (a prefill tier that never empties does not stop
# decode outright).
WHOLE_POLL_S = 0.005
WHOLE_MAX_S = 2.0
# Slack mode: a prompt whose TTFT objective leaves less than its prefill on every core times
# this margin is urgent, and decode waits for it whole (`urgent_at`).
URGENT_MARGIN = 1.25
# A prefill worker's word: prompts in hand, the earliest time (time.monotonic, which every
# process on the host shares) at which one of them can no longer wait for decode's slack
# and needs every core to meet its TTFT objective (+inf: none), and how many it has done.
_WORD = struct.Struct("<qdq")
NEVER = math.inf


def budget_mode_from_env() -> str | None:
    """SLACK or PACE when the decode engine sizes its pauses by its requests' objectives
    (the scheduler half computes the budget), else None."""
    mode = os.environ.get(ENV_YIELD_MS)
    return mode if os.environ.get(ENV_FILE) and mode in (SLACK, PACE) else None


def pause_budget_s(now_s: float,
                   running: list[tuple[int, float | None, float | None, int | None]],
                   step_s: float | None = None) -> float:
    """How long the decode engine may pause before this step, from the requests it runs:
    (tokens made so far, TPOT objective in seconds or None, when the first was seen (None
    only before it), the most tokens it may make or None), and ``step_s``, the engine's
    time per step when it does not pause (None: unknown).

    A request with an objective is ahead of its schedule by ``objective x (made - 1) -
    (now - first)``; when ``step_s`` and its length are known, each token still to come adds
    ``objective - step_s`` (never below 0): its last token comes by ``first + objective x
    (max_tokens - 1)`` if the pause is no longer than the sum. Without them the pause stays
    within the lead alone, which the next token's due time bounds. SLACK_SHARE of the
    smallest budget, between 0 and SLACK_SLICE_MAX_S; 0 when nothing runs, and while any
    request waits for its first token (a pause would add to its TTFT) or has no objective
    (nothing says what it tolerates)."""
    budgets = []
    for made, objective_s, first_s, max_tokens in running:
        if made < 1 or objective_s is None or first_s is None:
            return 0.0
        budget = objective_s * (made - 1) - (now_s - first_s)
        if step_s is not None and max_tokens is not None:
            budget += max(max_tokens - made, 0) * max(objective_s - step_s, 0.0)
        budgets.append(budget)
    return min(max(SLACK_SHARE * min(budgets), 0.0), SLACK_SLICE_MAX_S) if budgets else 0.0


def pace_budget_s(running: list[tuple[int, float | None, float | None, int | None]],
                  step_s: float | None) -> float:
    """Pace mode: how long the decode engine may pause before this step, from the requests
    it runs (as `pause_budget_s` takes them) and its time per plain step: PACE_SHARE of the
    smallest ``objective - step_s``, so that a request decoding while prefill always has
    prompts in hand makes a token every ``step_s + pause``, inside its objective. 0 when
    nothing runs, while the pace is unknown, and while any request waits for its first
    token or has no objective."""
    if not running or step_s is None:
        return 0.0
    spare = []
    for made, objective_s, first_s, _ in running:
        if made < 1 or objective_s is None or first_s is None:
            return 0.0
        spare.append(objective_s - step_s)
    return min(max(PACE_SHARE * min(spare), 0.0), SLACK_SLICE_MAX_S)


class StepPace:
    """The decode engine's time per step when it neither pauses nor computes a prompt, from
    the times its scheduler builds steps: ``observe`` at each step says when it was built
    and whether it is such a plain decode step; the time to the next build is a sample of
    the previous one's length, kept if that step was plain and took at most ``max_gap_s``
    (longer: the engine sat idle between steps). ``step_s`` is an exponential moving
    average of the samples (weight ``alpha``), None before the first."""

    def __init__(self, alpha: float = 0.2, max_gap_s: float = 1.0) -> None:
        self.alpha = alpha
        self.max_gap_s = max_gap_s
        self.step_s: float | None = None
        self._last: tuple[float, bool] | None = None

    def observe(self, now_s: float, plain: bool) -> None:
        if self._last is not None:
            last_s, last_plain = self._last
            gap = now_s - last_s
            if last_plain and 0 <= gap <= self.max_gap_s:
                self.step_s = (gap if self.step_s is None
                               else self.step_s + self.alpha * (gap - self.step_s))
        self._last = (now_s, plain)


def urgent_at(now_s: float, ttft_left_s: float | None, num_tokens: int,
              tokens_per_s: float | None) -> float:
    """When a prompt taken in hand now can wait no longer for decode's slack: its TTFT due
    time less its prefill on every core (``num_tokens`` at the best recent speed, times
    URGENT_MARGIN). NEVER without an objective; at once (``now_s``) while no speed is known."""
    if ttft_left_s is None:
        return NEVER
    if not tokens_per_s:
        return now_s
    return now_s + ttft_left_s - URGENT_MARGIN * num_tokens / tokens_per_s


class BestRate:
    """A prefill worker's best recent speed: the highest prompt tokens per second over its
    last ``window`` prompts, each timed from taken in hand to done. A prompt that waited
    behind others or for decode looks slow; the best of the recent ones ran on every core."""

    def __init__(self, window: int = 16) -> None:
        self._rates: deque[float] = deque(maxlen=window)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._rates.append(num_tokens / seconds)

    @property
    def tokens_per_s(self) -> float | None:
        return max(self._rates, default=None)


def map_word(path: str, create: bool, size: int = _WORD.size) -> mmap.mmap:
    """A shared-memory word of ``size`` bytes at ``path``: made (zeroed) or opened."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping stays


def unmap_word(word: mmap.mmap, path: str) -> None:
    """The owner's end of a word: unmapped and its file removed (once; readers drop it)."""
    word.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_words(base: str) -> None:
    for path in glob.glob(f"{glob.escape(base)}.*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Words:
    """The live words ``<base>.<prefix><pid>`` on this host, each ``size`` bytes: looked for
    again at most once per RESCAN_S (``read()``), dropping those whose file or process is
    gone, so a worker killed in the middle of its work stops counting."""

    def __init__(self, base: str, prefix: str = "", size: int = _WORD.size,
                 clock=time.monotonic) -> None:
        self._base, self._prefix, self._size, self._clock = base, prefix, size, clock
        self._words: dict[str, tuple[int, mmap.mmap]] = {}  # path -> (pid, word)
        self._scanned_s = float("-inf")

    def _rescan(self) -> None:
        present = set()
        for path in glob.glob(f"{glob.escape(self._base)}.{self._prefix}*"):
            suffix = path.rsplit(".", 1)[1].removeprefix(self._prefix)
            if not suffix.isdigit():
                continue
            present.add(path)
            if path not in self._words:
                try:
                    self._words[path] = (int(suffix), map_word(path, create=False, size=self._size))
                except (FileNotFoundError, ValueError):  # gone, or not yet sized
                    present.discard(path)
        for path in list(self._words):
            pid, word = self._words[path]
            if path not in present or not psutil.pid_exists(pid):
                word.close()
                del self._words[path]

    def read(self) -> list[mmap.mmap]:
        now = self._clock()
        if now - self._scanned_s >= RESCAN_S:
            self._scanned_s = now
            self._rescan()
        return [word for _, word in self._words.values()]


class PrefillBusy:
    """A prefill worker's prompts in hand, in its own word (one process writes it): how
    many, and the earliest of their urgent times (`urgent_at`)."""

    def __init__(self, base: str) -> None:
        self.path = f"{base}.{os.getpid()}"
        self._map = map_word(self.path, create=True)
        self._in_hand: dict[int, float] = {}  # token -> urgent at
        self._next = 0
        self._done = 0
        self._write()

    @classmethod
    def from_env(cls) -> PrefillBusy | None:
        base = os.environ.get(ENV_FILE)
        return cls(base) if base else None

    def _write(self) -> None:
        urgent = min(self._in_hand.values(), default=NEVER)
        _WORD.pack_into(self._map, 0, len(self._in_hand), urgent, self._done)

    def enter(self, urgent_at: float = NEVER) -> int:
        """A prompt taken in hand; the token to leave it with."""
        self._next += 1
        self._in_hand[self._next] = urgent_at
        self._write()
        return self._next

    def leave(self, token: int | None = None) -> None:
        """The prompt is done (without a token: the latest taken; none in hand: nothing)."""
        if token is None and self._in_hand:
            token = max(self._in_hand)
        if self._in_hand.pop(token, None) is not None:
            self._done += 1
        self._write()

    def close(self) -> None:
        unmap_word(self._map, self.path)


class StepYield:
    """The decode side: ``pause()`` at each step sleeps while any prefill worker on these
    cores has prompts in hand: ``yield_s`` (fixed), or waits until prefill has none left, at
    most the step's budget (`pause_budget_s`) in slack mode (``yield_s`` None), at most
    WHOLE_MAX_S in whole mode. ``prefill_state()`` alone serves the scheduler's half."""

    def __init__(self, base: str, yield_s: float | None, sleep=time.sleep,
                 clock=time.monotonic, whole: bool = False) -> None:
        self.yield_s = yield_s
        self.whole = whole
        self._sleep = sleep
        self._clock = clock
        self._words = Words(base, clock=clock)

    @classmethod
    def from_env(cls) -> StepYield | None:
        base, ms = os.environ.get(ENV_FILE), os.environ.get(ENV_YIELD_MS)
        if not base or not ms:
            return None
        if ms in (SLACK, PACE):
            return cls(base, None)
        if ms == WHOLE:
            return cls(base, None, whole=True)
        return cls(base, float(ms) / 1000) if float(ms) > 0 else None

    def prefill_state(self) -> tuple[int, float, int]:
        """Prompts in hand on every prefill worker on these cores, the earliest time one of
        them is urgent (NEVER: none), and how many prompts they have done."""
        count, urgent, done = 0, NEVER, 0
        for word in self._words.read():
            n, at, d = _WORD.unpack_from(word)
            done += d
            if n > 0:
                count, urgent = count + n, min(urgent, at)
        return count, urgent, done

    def prefill_busy(self) -> int:
        return self.prefill_state()[0]

    def urgent(self) -> bool:
        """A prompt in hand can no longer wait for decode's slack."""
        count, at, _ = self.prefill_state()
        return count > 0 and at <= self._clock()

    def pause(self, budget_s: float = 0.0) -> float:
        """Pauses if prefill has prompts in hand; the seconds it paused. Slack and pace
        modes wait for prefill at most the step's budget, or whole while a prompt is urgent; whole mode
        at most WHOLE_MAX_S."""
        if self.whole:
            return self._wait_for_prefill(WHOLE_MAX_S, one_prompt=True)
        if self.yield_s is None:
            budget_s = min(budget_s, SLACK_SLICE_MAX_S)
            if budget_s >= SLACK_SLICE_MIN_S or self.urgent():
                return self._wait_for_prefill(budget_s, whole_when_urgent=True)
            return 0.0
        if self.prefill_busy() <= 0:
            return 0.0
        self._sleep(self.yield_s)
        return self.yield_s

    def _wait_for_prefill(self, limit_s: float, whole_when_urgent: bool = False,
                          one_prompt: bool = False) -> float:
        """Waits while prefill has prompts in hand, at most ``limit_s`` (WHOLE_MAX_S while
        one of them is urgent, with ``whole_when_urgent``); with ``one_prompt``, only until
        one of the prompts in hand is done, so that decode makes a token between prompts
        as a colocated engine's decodes do between prefill chunks."""
        start = self._clock()
        waited = 0.0
        done_before = self.prefill_state()[2]
        while True:
            count, urgent_at, done = self.prefill_state()
            if count <= 0 or (one_prompt and done > done_before):
                return waited
            now = self._clock()
            cap = WHOLE_MAX_S if whole_when_urgent and urgent_at <= now else limit_s
            if waited >= cap:
                return waited
            self._sleep(min(WHOLE_POLL_S, cap - waited))
            waited = self._clock() - start
