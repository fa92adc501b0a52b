"""The Grafana dashboard in deploy/: its panels, and the metrics their PromQL reads.

Shared by the unit test (the file is valid, every panel queries something) and the
integration test (every metric it reads is exported by a running stack).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/grafana/dashboards/pdserve.json"
# Prometheus job (deploy/prometheus/prometheus.yml) -> the process it scrapes.
JOBS = {"pdserve-gateway": "gateway", "pdserve-prefill": "prefill", "pdserve-decode": "decode"}

# Words of PromQL that may stand where a metric name does.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"(?<![\w:$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!=|!~|=)\s*"([^"]*)"')


@dataclass(frozen=True)
class Selector:
    metric: str              # the series name as exported: vllm:time_to_first_token_seconds_bucket
    processes: frozenset[str]  # gateway, prefill, decode: those its job matcher allows


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel that shows data (rows' own panels included, rows left out)."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def selectors(expr: str) -> list[Selector]:
    """The series a PromQL expression reads, each with the processes its job matcher allows."""
    text = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    text = _GROUPING.sub("", text)
    found = []
    for name, matchers, call in _SELECTOR.findall(text):
        if call or name.lower() in _KEYWORDS:
            continue  # a function, or an operator word
        found.append(Selector(name, _processes(matchers)))
    return found


def _processes(matchers: str) -> frozenset[str]:
    allowed = set(JOBS.values())
    for label, op, value in _MATCHER.findall(matchers):
        if label != "job":
            continue
        if op == "=":
            allowed &= {JOBS.get(value)}
        elif op == "=~":
            allowed &= {JOBS.get(v) for v in value.split("|")}
        else:
            raise ValueError(f"negative job matcher {label}{op}{value!r}: say which jobs instead")
    return frozenset(p for p in allowed if p)


def all_selectors(dashboard: dict) -> dict[Selector, list[str]]:
    """Each selector the dashboard uses, with the titles of the panels that use it."""
    used: dict[Selector, list[str]] = {}
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            for sel in selectors(target["expr"]):
                used.setdefault(sel, []).append(panel["title"])
    return used
