"""Reading a process's Prometheus text exposition: what tests and benchmarks check.

A reader never turns a missing metric into 0: a name that is misspelt, renamed, or not
exported at all must fail the check that reads it. A counter no event has touched yet is
absent from a multiprocess registry too, so a baseline read before the first event passes
``default=0.0`` explicitly.
"""

from __future__ import annotations

import re
import urllib.request

# name, {labels} (a quoted value may hold any character), value, optional timestamp
_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})? (\S+)(?: \S+)?$', re.M
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricAbsent(LookupError):
    """No sample of a metric (with the wanted labels) on a /metrics page."""


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> str:
    return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s).read().decode()


def parse_labels(text: str) -> dict[str, str]:
    """``a="1",b="x"`` -> ``{"a": "1", "b": "x"}`` (values left escaped, as written)."""
    return dict(_LABEL.findall(text))


def body_sum(body: str, name: str, labels: str = "", default: float | None = None) -> float:
    """The sum of ``name``'s samples in an exposition ``body`` whose labels include every
    ``key="value"`` of ``labels``; raises MetricAbsent when there is none, unless
    ``default`` is given."""
    wanted = parse_labels(labels).items()
    values = [
        float(value)
        for sample_name, sample_labels, value in _SAMPLE.findall(body)
        if sample_name == name and wanted <= parse_labels(sample_labels).items()
    ]
    if values:
        return sum(values)
    if default is not None:
        return default
    namespace = _namespace(name)
    kin = sorted({n for n, _, _ in _SAMPLE.findall(body) if _namespace(n) == namespace})
    raise MetricAbsent(
        f"no sample of {name}{{{labels}}} on this /metrics page; "
        f"{namespace} names there: {', '.join(kin[:12]) or 'none'}"
    )


def _namespace(name: str) -> str:
    return name.split(":")[0] if ":" in name else name.split("_")[0]


def sample_sum(
    port: int, name: str, labels: str = "", host: str = "127.0.0.1", default: float | None = None,
    timeout_s: float = 5.0,
) -> float:
    """``body_sum`` of ``host:port/metrics``."""
    try:
        return body_sum(scrape(port, host, timeout_s), name, labels, default)
    except MetricAbsent as e:
        raise MetricAbsent(f"{host}:{port}: {e}") from None


def samples_sum(body: str, name: str, labels: str = "") -> float | None:
    """``body_sum``, but None when the metric is absent (for callers that report it)."""
    try:
        return body_sum(body, name, labels)
    except MetricAbsent:
        return None
