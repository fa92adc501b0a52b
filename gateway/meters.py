"""What the gateway measures online, the ground of every prediction (pure: no grpc,
asyncio, torch):
- `ServiceMeter`: prompt tokens a worker prefills per second while it has work, over its
  last completions (busy time only, so an idle worker does not look slow), with and without
  decode beside it;
- `LatencyMeter`: a local prompt's time to first token, a fixed part plus a part per token;
- `StepMeter`: a decode worker's time per output token, by how many requests it runs, and
  a joining request's life (`predict_life`);
- `Arrivals` / `JoinMeter`: how often requests join a decode worker;
- `RatioMeter`: how far requests' measured TPOT ran from its estimate.

`gateway.admission` decides on them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Points a joining request's life is sampled at when requests are expected to join it.
LIFE_POINTS = 64

@dataclass(slots=True)
class ServiceMeter:
    """Tokens per second of busy time, over the last ``window`` completions.

    Each completion is charged the time since the later of the previous completion and the
    moment the worker turned busy, so requests batched into one engine step share the step's
    time instead of the second one looking infinitely fast.

    Only completions within ``max_age_s`` count: admission refuses the requests a slow
    estimate predicts would miss, so with nothing admitted the estimate would never be
    measured again (seen in the mixed benchmark: a rate from the warm-up's prefills, made
    while decode held the cores, refused every offline prompt for the whole run). With no
    recent completion the rate is unknown and the next request is admitted to measure it.

    Each completion is also marked ``contended`` when the decode tier had requests running
    at any time in its busy time (as it began, joined during it: `contend`, or as it
    ended): on cores shared by both engines (`pdserve up`'s
    default) a prefill at idle priority under decode load runs at a fraction of its rate
    alone. ``tokens_per_s(..., contended=...)`` reads the completions made the same way;
    with none recent, a rate measured alone stands in for one beside decode (an optimistic
    bound), and a prompt sent with decode idle has no rate (admit, and measure it). Seen in the
    mixed benchmark: an offline prompt of 1,373 tokens sent with decode idle was refused on
    a predicted 6.34 s (216 tokens/s, measured under decode load) while such prompts
    prefilled alone at about 1,000 tokens/s; 9 of 13 offline prompts were refused.
    """

    window: int = 8
    max_age_s: float = 60.0
    _samples: deque[tuple[int, float, float, bool]] = field(default_factory=deque)  # tokens, busy s, when, contended
    _busy_since_s: float | None = None
    _num_busy: int = 0
    _busy_contended: bool = False  # decode had requests running when the busy time began
    _abandoned: tuple[float, float] | None = None  # rate bound, when
    # The last ``window`` completions made with decode idle, however old (tokens, busy s):
    # what the worker does with the cores to itself (`alone_tokens_per_s`).
    _alone: deque[tuple[int, float]] = field(default_factory=deque)

    def start(self, now_s: float, contended: bool = False) -> None:
        if self._num_busy == 0:
            self._busy_since_s = now_s
            self._busy_contended = contended
        self._num_busy += 1

    def contend(self) -> None:
        """A decode request started running: the busy time in progress is contended. Seen
        in the mixed benchmark: a completion whose busy time began and ended with decode
        idle, while interactive requests came and went in between, read 304 tokens/s as
        a rate "alone" (about 1,000 alone) and refused an offline prompt on it."""
        if self._num_busy:
            self._busy_contended = True

    def finish(self, num_tokens: int, now_s: float, contended: bool = False) -> None:
        assert self._num_busy > 0 and self._busy_since_s is not None
        self._samples.append((num_tokens, max(now_s - self._busy_since_s, 0.0), now_s,
                              self._busy_contended or contended))
        if len(self._samples) > self.window:
            self._samples.popleft()
        if not self._samples[-1][3]:
            self._alone.append(self._samples[-1][:2])
            if len(self._alone) > self.window:
                self._alone.popleft()
        self._num_busy -= 1
        self._busy_since_s = now_s if self._num_busy else None
        self._busy_contended = contended  # the next busy time begins now
        self._abandoned = None

    @property
    def busy(self) -> bool:
        """Whether a request is in service (started, neither finished nor cancelled)."""
        return self._num_busy > 0

    def cancel(self, now_s: float) -> None:
        """A request that left without completing: no sample, but it stops counting busy."""
        assert self._num_busy > 0
        self._num_busy -= 1
        self._busy_since_s = self._busy_since_s if self._num_busy else None

    def abandon(self, num_tokens: int, waited_s: float, now_s: float) -> None:
        """A request taken back unanswered after ``waited_s`` (moved elsewhere): the worker
        ran at most ``num_tokens / waited_s`` for it. Until its next completion (or for
        ``max_age_s``) its rate reads at most that: the completions before it were made
        while it had the cores, and a sum over them would hide that it has none now."""
        self.cancel(now_s)
        if waited_s > 0 and num_tokens > 0:
            self._abandoned = (num_tokens / waited_s, now_s)

    def stalled(self, now_s: float) -> bool:
        """A request was taken back from this worker unanswered, and nothing has completed
        since: its rate now is a bound, not an estimate to promise a start on."""
        return self._abandoned is not None and now_s - self._abandoned[1] <= self.max_age_s

    def working_s(self, now_s: float) -> float:
        """How long the busy time in progress has run since its start or the last completion
        (0 when idle): the work in hand has had that long at the cores."""
        if not self._num_busy or self._busy_since_s is None:
            return 0.0
        return max(now_s - self._busy_since_s, 0.0)

    def tokens_per_s(self, now_s: float, pending_tokens: int = 0,
                     contended: bool | None = None, exact: bool = False) -> float | None:
        """Measured over the recent completions; None: none recent. With ``contended``
        given, over those marked the same; with none of them, a prefill beside running
        decodes (True) is read from the others (alone it was never slower: the rate errs
        towards admitting) unless ``exact``, a prefill alone (False) is unknown.

        ``pending_tokens``: the tokens sent and not yet answered. A worker that has worked
        on them for longer than they take at the measured rate is slower now than it was
        (its cores taken by another engine, a stuck request): the rate is then at most
        ``pending_tokens`` over that time, so the next prompt is not promised a start it
        will not get (seen in the short benchmark: prompts of 20-47 tokens sent to a
        prefill engine that decode kept off the cores waited 9-29 s).
        """
        recent = [(n, s, busy) for n, s, when, busy in self._samples
                  if now_s - when <= self.max_age_s]
        same = [x for x in recent if x[2] == contended]
        if contended is not None and (same or not contended or exact):
            recent = same
        tokens = sum(n for n, _, _ in recent)
        busy_s = sum(s for _, s, _ in recent)
        if busy_s <= 0 or tokens <= 0:
            return None
        rate = tokens / busy_s
        if self.stalled(now_s):
            rate = min(rate, self._abandoned[0])
        return self._bounded(rate, now_s, pending_tokens)

    def alone_tokens_per_s(self, now_s: float, pending_tokens: int = 0,
                           fallback: float | None = None) -> float | None:
        """Its rate with decode idle over its last completions made so, however old (else
        ``fallback``); None: neither. For a prompt sent with decode idle when nothing
        recent says (`tokens_per_s` None: a minute without completions alone, or a request
        taken back since), so that it is not given up on before it could have finished.

        Seen in the long benchmark: with "no rate" a prompt's remote prefill was moved to
        the decode worker after `PlacementConfig.stall_unknown_s` (1 s), fewer tokens than a
        long prompt takes alone (about 800 tokens/s); each move left the worker "stalled",
        so the next prompt had no rate either, and every prompt of over about 650 tokens
        went the same way for as long as prompts kept coming: 27 of 39 at 0.114 req/s,
        first tokens about 1 s later than colocated vLLM's on an idle machine, and the
        worker's prefills of them thrown away (lease expired)."""
        tokens = sum(n for n, _ in self._alone)
        busy_s = sum(s for _, s in self._alone)
        rate = tokens / busy_s if tokens > 0 and busy_s > 0 else fallback
        return None if rate is None else self._bounded(rate, now_s, pending_tokens)

    def _bounded(self, rate: float, now_s: float, pending_tokens: int) -> float:
        if pending_tokens > 0 and self._num_busy and self._busy_since_s is not None:
            working_s = now_s - self._busy_since_s
            if working_s > 0:
                rate = min(rate, pending_tokens / working_s)
        return rate


@dataclass(slots=True)
class LatencyMeter:
    """Seconds from sending a prompt to a decode worker to its first token, as a fixed part
    plus a part per prompt token (``a + b * tokens``), fit over the last ``window`` local
    prefills younger than ``max_age_s``, at least ``min_samples`` of them.

    A short prompt prefilled by a decode engine waits for the step in progress, then runs in
    the next step together with every other prompt waiting there: its time is mostly the
    fixed part. A rate (tokens per second) charges that fixed part to every token: seen in
    the short benchmark at 1 req/s, 11 of 60 prompts of 41-64 tokens refused on a predicted
    time to first token over 0.45 s while the ones served had a p99 of 0.37 s. ``tokens``
    is what the step runs: the prompt and the local prompts pending with it.

    The fit is a median one (Theil-Sen: the median slope between pairs, the median
    intercept), and needs three samples: admission refuses on it, and a refusal adds no
    sample, so one slow prefill must not set it. Seen in the interleaved short compare: the
    first request after 75 s idle took 1.03 s to its first token, and as the only sample it
    refused the next 31 requests (objective 0.48 s) for the minute it took to age out, while
    the requests served after it ran at a TTFT p50 of 0.21 s.
    """

    window: int = 16
    min_samples: int = 3
    max_age_s: float = 60.0
    _samples: deque[tuple[int, float, float]] = field(default_factory=deque)  # tokens, seconds, when

    def observe(self, num_tokens: int, seconds: float, now_s: float) -> None:
        self._samples.append((num_tokens, seconds, now_s))
        if len(self._samples) > self.window:
            self._samples.popleft()

    def fit(self, now_s: float) -> tuple[float, float] | None:
        """(seconds, seconds per token); None with fewer than ``min_samples`` recent. With
        the tokens all alike (or a fit that slopes down) the fixed part is their median and
        the slope 0; with an intercept below zero, through the origin (a rate) instead."""
        recent = [(x, y) for x, y, when in self._samples if now_s - when <= self.max_age_s]
        if len(recent) < self.min_samples:
            return None
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(recent)
                  for x2, y2 in recent[i + 1:] if x2 != x1]
        slope = statistics.median(slopes) if slopes else 0.0
        if slope <= 0:
            return statistics.median(y for _, y in recent), 0.0
        base = statistics.median(y - slope * x for x, y in recent)
        if base < 0:
            return 0.0, statistics.median(y / x for x, y in recent)
        return base, slope


def _bucket(num_running: int) -> int:
    """Power-of-two bucket of a batch size: 1, 2, 4, 8, ..."""
    return 1 << (max(num_running, 1) - 1).bit_length()


@dataclass(slots=True)
class StepMeter:
    """A decode worker's seconds per output token, by batch-size bucket: the median of the
    bucket's recent measurements.

    A bucket counts once it holds ``min_samples`` measurements younger than ``max_age_s``.
    Admission refuses requests that would grow the batch past a slow bucket, so a bucket
    set by one slow gap would keep refusing until it aged out: seen in the short benchmark,
    five requests in 8 s refused on "95 ms" against a 93 ms objective while the requests
    served ran at a TPOT p99 of 80 ms. The median of several gaps is not moved by one.
    A step takes well under a second, so a batch size that runs at all is measured many
    times within ``max_age_s``; one that refusals keep from running is forgotten after it:
    seen in the short benchmark, batch 2's 87 ms from the first steps after start (later
    69 ms) refused 12 requests at a batch of 1 over 16 s while it aged out of 20 s.
    """

    window: int = 32
    min_samples: int = 3
    max_age_s: float = 5.0
    _by_bucket: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)  # bucket -> (value, when)

    def observe(self, num_running: int, seconds_per_token: float, now_s: float) -> None:
        bucket = _bucket(num_running)
        samples = self._by_bucket.get(bucket)
        if samples is None:  # not setdefault: this runs per streamed message
            samples = self._by_bucket[bucket] = deque(maxlen=self.window)
        samples.append((seconds_per_token, now_s))

    def predict(self, num_running: int, now_s: float) -> float | None:
        """The time per token at this batch size: its bucket's, or the nearest measured
        smaller bucket's (a larger batch is never faster); None with nothing recent."""
        b = _bucket(num_running)
        for k in sorted((k for k in self._by_bucket if k <= b), reverse=True):
            if (value := self._median(k, now_s)) is not None:
                return value
        return None

    def _median(self, bucket: int, now_s: float) -> float | None:
        recent = [v for v, when in self._by_bucket[bucket] if now_s - when <= self.max_age_s]
        return statistics.median(recent) if len(recent) >= self.min_samples else None

    def _predict_or_above(self, num_running: int, now_s: float) -> float | None:
        """`predict`, or with no smaller bucket measured the nearest larger one's (an upper
        bound: a smaller batch is never slower)."""
        if (value := self.predict(num_running, now_s)) is not None:
            return value
        b = _bucket(num_running)
        for k in sorted(k for k in self._by_bucket if k > b):
            if (value := self._median(k, now_s)) is not None:
                return value
        return None

    def predict_life(self, remaining: list[int], steps: int, now_s: float,
                     arrivals: Arrivals | None = None) -> float | None:
        """Mean time per token over the ``steps`` decode steps of a request joining a batch
        whose running requests have ``remaining`` tokens each still to generate: they leave
        as they finish, so the batch at step j is 1 + those with more than j to go, plus
        the requests ``arrivals`` expects to join by then (each staying its mean length).

        The batch size when a request joins overstates what it runs with when the running
        requests are near their ends; seen in the short benchmark at 1 req/s: requests
        refused on a predicted 101-105 ms against a 90 ms objective while the served ones
        ran at a TPOT p99 of 88 ms. Leaving out the requests that join later understates
        it under a burst: seen at 2.72 req/s, 40 of 40 admitted and 35 late, the ratio of
        measured to predicted (`RatioMeter`) catching up only as requests finished. None
        with no step measured."""
        steps = max(steps, 1)
        by_bucket: dict[int, float | None] = {}  # each bucket's estimate, once per call

        def step_at(batch: int) -> float | None:
            bucket = _bucket(batch)
            if bucket not in by_bucket:
                by_bucket[bucket] = self._predict_or_above(bucket, now_s)
            return by_bucket[bucket]

        if arrivals is None or arrivals.per_step <= 0:
            return _life_of_running(step_at, remaining, steps)
        ends = sorted(remaining)
        stride = -(-steps // LIFE_POINTS)
        total, k = 0.0, 0
        for j in range(0, steps, stride):
            while k < len(ends) and ends[k] <= j:
                k += 1
            joined = arrivals.per_step * min(j, arrivals.mean_steps)
            step = step_at(1 + len(ends) - k + round(joined))
            if step is None:
                return None
            total += step * min(stride, steps - j)
        return total / steps


def _life_of_running(step_at: Callable[[int], float | None], remaining: list[int],
                     steps: int) -> float | None:
    """`StepMeter.predict_life` with nobody joining: the batch only shrinks, so the mean is
    exact over the segments between the running requests' ends."""
    total, j, num_left = 0.0, 0, len(remaining)
    for end in sorted(min(r, steps) for r in remaining) + [steps]:
        if end > j:
            step = step_at(1 + num_left)
            if step is None:
                return None
            total += step * (end - j)
            j = end
        num_left -= 1
    return total / steps


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Requests expected to join a decode worker: how many per decode step, and how many
    steps each stays (its max_tokens)."""

    per_step: float
    mean_steps: float


@dataclass(slots=True)
class JoinMeter:
    """Requests joining a decode worker over the last ``window_s``: their rate and mean
    max_tokens (`Arrivals`, once converted to steps with a step time).

    The rate is over the time since the window's first join (at least ``min_span_s``), not
    the whole window: a burst that began 2 s ago is counted at its own rate. Seen at 2.72
    req/s: over the whole window the rate read a third of that 3 s into the burst."""

    window_s: float = 10.0
    min_span_s: float = 2.0
    _joins: deque[tuple[float, int]] = field(default_factory=deque)  # when, max_tokens

    def observe(self, max_tokens: int, now_s: float) -> None:
        self._joins.append((now_s, max_tokens))
        self._trim(now_s)

    def arrivals(self, step_s: float | None, now_s: float) -> Arrivals | None:
        """None with no join in the window or no step time to count steps in."""
        self._trim(now_s)
        if not self._joins or not step_s:
            return None
        per_s = len(self._joins) / max(now_s - self._joins[0][0], self.min_span_s)
        mean_steps = sum(n for _, n in self._joins) / len(self._joins)
        return Arrivals(per_s * step_s, mean_steps)

    def _trim(self, now_s: float) -> None:
        while self._joins and now_s - self._joins[0][0] > self.window_s:
            self._joins.popleft()


@dataclass(slots=True)
class RatioMeter:
    """How far requests' measured time per token ran from the step estimate made when they
    joined: the median of the last ``window`` finished requests' ratios (at least
    ``min_samples``, younger than ``max_age_s``); 1.0 without them.

    The step estimate leaves out the gaps in which other requests' prompts were prefilled
    and the batch growing after a request joined; a request's TPOT has both. Seen in the
    short benchmark at 1 req/s: 7 of 60 requests admitted on a predicted 60-90 ms missed
    a 93.4 ms objective by 0-15%. Scaling the estimate by what recent requests saw keeps
    admission to what it can promise.
    """

    window: int = 16
    min_samples: int = 3
    max_age_s: float = 60.0
    # ratio, when, and whether it missed its TPOT objective (None: it had none)
    _samples: deque[tuple[float, float, bool | None]] = field(default_factory=deque)
    # When the worker last ran out of requests (`drained`); misses before it are not counted.
    _drained_s: float = float("-inf")

    def observe(self, measured: float, predicted: float, now_s: float,
                objective: float | None = None) -> None:
        """One finished request's TPOT ``measured`` against the step estimate it joined on,
        and against its own TPOT ``objective`` where it had one (`miss_share`)."""
        if measured > 0 and predicted > 0:
            missed = None if objective is None else measured > objective
            self._samples.append((measured / predicted, now_s, missed))
            if len(self._samples) > self.window:
                self._samples.popleft()

    def drained(self, now_s: float) -> None:
        """The worker's last running request left: the misses so far are forgotten.

        They said the batch the worker ran then was too big for the objectives; an empty
        worker runs none of it. Seen in the mixed benchmark at 0.147 req/s, measured right
        after 0.295 req/s had overloaded the worker: the first request, sent to an idle
        worker, refused on "69 ms" against 68 ms, and 2 of 27 interactive ones in the next
        minute on 76-83 ms against 65 ms while those served beside them ran at 50-58 ms;
        no refusal named a best case apart from the forecast, so the overload's misses had
        raised it to the median. Under a sustained overload the worker never drains, and
        the misses count as before."""
        self._drained_s = now_s

    def miss_share(self, now_s: float) -> float | None:
        """The share of the recent requests with a TPOT objective that missed it, among
        those that finished since the worker last drained; None with fewer than
        ``min_samples`` of them."""
        judged = [missed for _, when, missed in self._samples
                  if missed is not None and now_s - when <= self.max_age_s and when > self._drained_s]
        return sum(judged) / len(judged) if len(judged) >= self.min_samples else None

    def ratio(self, now_s: float) -> float:
        recent = self._recent(now_s)
        return statistics.median(recent) if len(recent) >= self.min_samples else 1.0

    def quantile(self, q: float, now_s: float) -> float:
        """The recent ratio that a ``q`` share of them is at or below (the lower of two
        neighbours, no interpolation); 1.0 without ``min_samples`` of them."""
        recent = sorted(self._recent(now_s))
        if len(recent) < self.min_samples:
            return 1.0
        return recent[math.floor(q * (len(recent) - 1))]

    def _recent(self, now_s: float) -> list[float]:
        return [r for r, when, _ in self._samples if now_s - when <= self.max_age_s]
