"""One prefill thread beside a stepping decode engine (`pdserve up --prefill-threads solo`).

The prefill engine's OpenMP team needs every one of its threads at each barrier, so at idle
priority beside a decode engine that holds even one of the shared cores (a step's threads,
or its engine-core process spinning while its worker computes or waits) the team runs at
the pace of the thread that has no core. With PDSERVE_PREFILL_THREADS=solo the prefill
engine computes on one thread, free to run on any of the shared cores, while a decode
engine on them is stepping, and on its whole team while decode idles: the decode engine's
KV connector stamps its word (`DecodeBeat`, ``<base>.d<pid>`` beside kvtransfer.coreshare's
prefill words) as each step starts and ends, and the prefill engine's connector reads the
words at the start of each of its steps (`PrefillThreads`). ``always``: one thread at every
step (for measuring).

Measured (docs/benchmarks.md, "Thirteenth session"): while decode steps, the idle-priority
prefill engine gets no core with one thread or two; where decode waits for prefill
(`--decode-yield whole`), one thread beat the team of two (2.10-2.85 s against 2.85-6.56 s
for a 1,400-token prompt beside two decoding requests).
"""

from __future__ import annotations

import os
import struct
import time

from kvtransfer.coreshare import ENV_FILE, NEVER, Words, map_word, unmap_word

ENV_PREFILL_THREADS = "PDSERVE_PREFILL_THREADS"
SOLO = "solo"
ALWAYS = "always"
# Decode counts as stepping while in a step and for this long after one ended: its engine
# builds the next step within a millisecond or two while requests run.
SOLO_WINDOW_S = 0.05
_BEAT = struct.Struct("<qd")  # in a step (0/1), when it last started or ended
BEAT_PREFIX = "d"  # a decode engine's word is <base>.d<pid>; a prefill worker's <base>.<pid>


class DecodeBeat:
    """A decode engine's word, ``<base>.d<pid>`` (one process writes it): whether it is in
    a step, and when the last step started or ended."""

    def __init__(self, base: str, clock=time.monotonic) -> None:
        self.path = f"{base}.{BEAT_PREFIX}{os.getpid()}"
        self._map = map_word(self.path, create=True, size=_BEAT.size)
        self._clock = clock
        self._stepping = False
        _BEAT.pack_into(self._map, 0, 0, -NEVER)  # never stepped

    @classmethod
    def from_env(cls) -> DecodeBeat | None:
        base = os.environ.get(ENV_FILE)
        return cls(base) if base and os.environ.get(ENV_PREFILL_THREADS) in (SOLO, ALWAYS) else None

    def step_started(self) -> None:
        self._stepping = True
        _BEAT.pack_into(self._map, 0, 1, self._clock())

    def step_ended(self) -> None:
        """After every step's forward; only one that `step_started` counts."""
        if self._stepping:
            self._stepping = False
            _BEAT.pack_into(self._map, 0, 0, self._clock())

    def close(self) -> None:
        unmap_word(self._map, self.path)


def decode_stepping(now_s: float, beats: list[tuple[int, float]], window_s: float = SOLO_WINDOW_S) -> bool:
    """Whether any decode engine is in a step or ended one within ``window_s``."""
    return any(in_step or now_s - at <= window_s for in_step, at in beats)


class PrefillThreads:
    """The prefill side: ``step()`` at each of the engine's steps sets its compute threads,
    one while a decode engine on these cores is stepping (`decode_stepping`), ``team``
    otherwise (``always``: one at every step). ``set_threads`` is torch's own setter
    (vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op after binding)."""

    def __init__(self, base: str, team: int, set_threads, always: bool = False,
                 clock=time.monotonic) -> None:
        self.team = team
        self.always = always
        self._set_threads = set_threads
        self._clock = clock
        self._words = Words(base, prefix=BEAT_PREFIX, size=_BEAT.size, clock=clock)
        self.threads = team
        self.solo_steps = 0
        self.team_steps = 0

    @classmethod
    def from_env(cls) -> PrefillThreads | None:
        base, mode = os.environ.get(ENV_FILE), os.environ.get(ENV_PREFILL_THREADS)
        if not base or mode not in (SOLO, ALWAYS):
            return None
        import torch

        # torch.set_num_threads is torch._C's; vLLM's CPU worker rebinds the name only.
        return cls(base, torch.get_num_threads(), torch._C.set_num_threads, always=mode == ALWAYS)

    def beats(self) -> list[tuple[int, float]]:
        return [_BEAT.unpack_from(word) for word in self._words.read()]

    def step(self) -> int:
        """Sets the threads for the step about to run; returns how many."""
        solo = self.always or decode_stepping(self._clock(), self.beats())
        want = 1 if solo else self.team
        if want != self.threads:
            self._set_threads(want)
            self.threads = want
        if solo:
            self.solo_steps += 1
        else:
            self.team_steps += 1
        return want
