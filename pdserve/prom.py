"""Reading a process's Prometheus text exposition: what tests and benchmarks check."""

from __future__ import annotations

import re
import urllib.request


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> str:
    """The text of ``host:port/metrics``."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
        return resp.read().decode()


def samples_sum(body: str, name: str, labels: str = "") -> float | None:
    """The sum of ``name``'s samples in an exposition text whose labels contain every
    comma-separated ``key="value"`` part of ``labels``; None when no sample matches, so a
    missing metric never reads as zero."""
    wanted = [part for part in labels.split(",") if part]
    values = [float(match.group(2))
              for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", body, re.M)
              if all(part in (match.group(1) or "") for part in wanted)]
    return sum(values) if values else None


def sample_sum(port: int, name: str, labels: str = "", host: str = "127.0.0.1") -> float:
    """`samples_sum` of ``host:port/metrics``, 0 when there are none (a counter that has
    not been incremented yet is not exported by every client)."""
    return samples_sum(scrape(port, host), name, labels) or 0.0
