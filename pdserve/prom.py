"""Reading a process's Prometheus text exposition: what tests and benchmarks check."""

from __future__ import annotations

import re
import urllib.request


def sample_sum(port: int, name: str, labels: str = "", host: str = "127.0.0.1") -> float:
    """The sum of ``name``'s samples on ``host:port/metrics`` whose labels contain every
    comma-separated ``key="value"`` part of ``labels`` (0 when there are none)."""
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    wanted = [part for part in labels.split(",") if part]
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", body, re.M):
        if all(part in (match.group(1) or "") for part in wanted):
            total += float(match.group(2))
    return total
