"""When an open-loop benchmark sends each request: inter-arrival gaps of a renewal process.

As in ``vllm bench serve``: gaps are gamma distributed with shape ``burstiness`` and scale
``1 / (rate * burstiness)``, so the mean rate is ``rate`` for every burstiness; shape 1 is
a Poisson process (exponential gaps), below 1 burstier, above 1 more regular, and
infinity a constant gap. Pure and seeded: the same seed gives the same schedule.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator


def arrival_gaps_s(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Endless gaps (seconds) between consecutive requests."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return itertools.repeat(0.0)
    if math.isinf(burstiness):
        return itertools.repeat(1.0 / rate)
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return (rng.gammavariate(burstiness, scale) for _ in itertools.count())


def arrival_offsets_s(rate: float, burstiness: float, seed: int, n: int) -> list[float]:
    """Send times of n requests, relative to the start of the run; the first goes at 0."""
    if n <= 0:
        return []
    gaps = itertools.islice(arrival_gaps_s(rate, burstiness, seed), n - 1)
    return list(itertools.accumulate(gaps, initial=0.0))
